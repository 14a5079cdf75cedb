"""Model wrapping by one setting, gradient-sync skipping, and exact global-batch loss weights."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.distributed.apex_parallel import apex_parallel_attr
from ampddp.distributed.data import sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.errors import ConfigError, choice_error

STRATEGIES = ("ddp", "apex-ddp", "dp", "none")


def wrap_model(model: nn.Module, strategy: str, env: DistEnv, **options: Any) -> nn.Module:
    """Wrap an already converted, placed and optimizer-bound model for data parallelism.

    ``ddp``: torch DDP (device_ids bound on CUDA); ``apex-ddp``: apex's DDP (NVIDIA's from an old
    apex build, else ``ampddp.apex.parallel``'s, with apex's options); ``dp``: nn.DataParallel
    over all visible GPUs (single process); ``none``: the model itself. A single-process run gets
    the bare model for ``ddp``/``apex-ddp`` since there is nobody to synchronise with.
    """
    if strategy not in STRATEGIES:
        raise choice_error("distributed strategy", strategy, STRATEGIES)
    if strategy == "none":
        return model
    if strategy == "dp":
        if env.distributed:
            raise ConfigError("strategy 'dp' (nn.DataParallel) is single-process; with several processes use 'ddp'")
        return nn.DataParallel(model, **options)
    if not env.distributed:
        return model
    if strategy == "apex-ddp":
        return apex_parallel_attr("DistributedDataParallel")(model, **options)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **options)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP/DataParallel/apex DDP wrappers."""
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)) or type(model).__name__ == "DistributedDataParallel":
        model = model.module
    return model


class GradSync:
    """Skip gradient all-reduce on the micro-steps of an accumulation window but the last.

    ``with sync.micro_step(is_last):`` runs backward under DDP's ``no_sync`` unless ``is_last``;
    models without ``no_sync`` (single process, DataParallel) are unaffected.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def micro_step(self, is_last: bool) -> AbstractContextManager[Any]:
        no_sync = getattr(self._model, "no_sync", None)
        if is_last or no_sync is None:
            return contextlib.nullcontext()
        return no_sync()


def global_batch_loss_weight(local_samples: int, env: DistEnv) -> float:
    """Factor for the local mean loss so that DDP's mean over ranks is the global-batch gradient.

    DDP averages rank gradients with equal weight 1/k. When rank j holds m_j of the step's n
    samples, the true gradient weights rank j by m_j/n, so the local loss is scaled by m_j*k/n
    (1.0 when every rank holds the same count). Costs one small all-reduce.
    """
    if not env.distributed:
        return 1.0
    total = float(sum_across_ranks(float(local_samples)).item())
    if total <= 0:
        raise ValueError("global batch is empty on every rank")
    return local_samples * env.world_size / total
