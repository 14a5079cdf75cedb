"""One object per way of spreading a model over processes, each holding its own settings
(``base``: what every strategy is; ``replicated``: DDP, apex's DDP, DataParallel, none; ``sharded``:
FSDP2 and HSDP; ``table``: the names, and the one place settings reach their strategy)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ampddp.distributed.env import DistEnv
from ampddp.distributed.strategies.base import MakeOptimizer, SetUp, Strategy
from ampddp.distributed.strategies.replicated import ApexDDP, DataParallel, TorchDDP, Unwrapped
from ampddp.distributed.strategies.sharded import FSDP2, HSDP, ShardedGradSync
from ampddp.distributed.strategies.table import STRATEGY_TABLE, make_strategy, strategy_class, takers
from ampddp.distributed.wrap import DDPOptions
from ampddp.errors import ConfigError

__all__ = [
    "FSDP2",
    "HSDP",
    "STRATEGY_TABLE",
    "ApexDDP",
    "DataParallel",
    "MakeOptimizer",
    "SetUp",
    "ShardedGradSync",
    "Strategy",
    "TorchDDP",
    "Unwrapped",
    "make_strategy",
    "strategy_class",
    "takers",
    "wrap_model",
]


def wrap_model(model: nn.Module, strategy: str, env: DistEnv, ddp: DDPOptions | None = None, **options: Any) -> nn.Module:
    """Wrap an already converted, placed and optimizer-bound model for data parallelism.

    ``ddp``: torch DDP (device_ids bound on CUDA); ``apex-ddp``: apex's DDP (NVIDIA's from an old
    apex build, else ampddp's apex-style one, with apex's options); ``dp``: nn.DataParallel
    over all visible GPUs (single process); ``none``: the model itself. A single-process run gets
    the bare model for ``ddp``/``apex-ddp`` since there is nobody to synchronise with. The ``ddp``
    argument holds torch DDP's settings (refused with another strategy); ``options`` are the
    wrapper's other keyword arguments (apex-ddp's own, nn.DataParallel's, torch DDP's others).
    """
    if strategy_class(strategy).shards_params:
        raise ConfigError(
            f"strategy {strategy} shards through prepare(..., parallel=Parallel(strategy='{strategy}')), which maps the precision "
            "mode onto its sharding; wrap_model wraps whole models (ddp, apex-ddp, dp, none)"
        )
    return make_strategy(strategy, ddp=ddp, wrap_options=options).wrap(model, env)
