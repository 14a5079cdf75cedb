"""Model wrapping by one setting, gradient-sync skipping, and exact global-batch loss weights."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.choices import COMM_HOOKS, STRATEGIES
from ampddp.distributed.apex_ddp import DistributedDataParallel as ApexDistributedDataParallel
from ampddp.distributed.data import sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.distributed.fsdp2 import gradient_sync_off, is_sharded
from ampddp.distributed.installed_apex import installed_apex_parallel
from ampddp.distributed.model_agreement import check_models_agree
from ampddp.errors import ConfigError, choice_error


@dataclass(frozen=True)
class DDPOptions:
    """torch DDP's settings that people tune; checked when made.

    ``find_unused_parameters``: look each step for parameters that got no gradient (models with
    unused branches; costs a graph traversal). ``static_graph``: the used parameters and graph are
    the same every step (DDP optimises for it; reentrant activation checkpointing works).
    ``gradient_as_bucket_view``: gradients are views into the all-reduce buckets (one gradient-sized
    copy less). ``bucket_cap_mb``: all-reduce bucket size in MiB (None: torch's default, 25).
    ``comm_hook``: none, fp16 or bf16 (gradients compressed for the all-reduce, then averaged back).
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None
    comm_hook: str = "none"

    def __post_init__(self) -> None:
        for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid; it must be true or false")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0):
            raise ConfigError(f"bucket_cap_mb={cap!r} is not valid; it must be a finite number of MiB > 0, or None for torch's default")
        if self.comm_hook not in COMM_HOOKS:
            raise choice_error("comm_hook", self.comm_hook, COMM_HOOKS)

    def check_strategy(self, strategy: str, where: str = "") -> None:
        """Refuse settings that the wrapper of ``strategy`` would not use (they belong to torch DDP);
        ``where``: the settings' prefix in messages (``distributed.`` for a recipe)."""
        changed = [f"{where}{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        if strategy != "ddp" and changed:
            raise ConfigError(f"{', '.join(changed)}: torch DDP settings, but {where}strategy={strategy}; unset them or use strategy ddp")

    def wrap(self, model: nn.Module, device_ids: list[int] | None, **options: Any) -> DistributedDataParallel:
        """``model`` in torch DDP with these settings (and ``options``, torch DDP's other arguments)."""
        owned = sorted(set(options) & {f.name for f in dataclasses.fields(self)})
        if owned:
            raise ConfigError(f"wrap option {owned[0]} is a DDPOptions setting; pass it as Parallel(ddp=DDPOptions({owned[0]}=...))")
        settings = {"find_unused_parameters": self.find_unused_parameters, "static_graph": self.static_graph,
                    "gradient_as_bucket_view": self.gradient_as_bucket_view}  # fmt: skip
        if self.bucket_cap_mb is not None:
            settings["bucket_cap_mb"] = self.bucket_cap_mb
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **settings, **options)
        if self.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if self.comm_hook == "fp16" else default_hooks.bf16_compress_hook
            wrapped.register_comm_hook(state=None, hook=hook)
        return wrapped


Wrapper = Callable[[nn.Module, DistEnv, DDPOptions, dict[str, Any]], nn.Module]
"""``wrap(model, env, ddp, options)`` -> the model as the strategy trains it."""


def _torch_ddp(model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
    if not env.distributed:
        return model  # nobody to synchronise with
    check_models_agree(model, env)
    return ddp.wrap(model, [env.device.index] if env.device.type == "cuda" else None, **options)


def _apex_ddp(model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
    if not env.distributed:
        return model
    check_models_agree(model, env)
    wrapper = installed_apex_parallel("DistributedDataParallel") or ApexDistributedDataParallel
    return wrapper(model, **options)


def _data_parallel(model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
    if env.distributed:
        raise ConfigError("strategy 'dp' (nn.DataParallel) is single-process; with several processes use 'ddp'")
    return nn.DataParallel(model, **options)


def _unwrapped(model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
    return model


WRAPPERS: Mapping[str, Wrapper] = MappingProxyType({"ddp": _torch_ddp, "apex-ddp": _apex_ddp, "dp": _data_parallel, "none": _unwrapped})
"""Each strategy's wrapper, by the name a recipe gives (``choices.STRATEGIES``, where the names are
listed without importing torch)."""


def wrap_model(model: nn.Module, strategy: str, env: DistEnv, ddp: DDPOptions | None = None, **options: Any) -> nn.Module:
    """Wrap an already converted, placed and optimizer-bound model for data parallelism.

    ``ddp``: torch DDP (device_ids bound on CUDA); ``apex-ddp``: apex's DDP (NVIDIA's from an old
    apex build, else ampddp's apex-style one, with apex's options); ``dp``: nn.DataParallel
    over all visible GPUs (single process); ``none``: the model itself. A single-process run gets
    the bare model for ``ddp``/``apex-ddp`` since there is nobody to synchronise with. The ``ddp``
    argument holds torch DDP's settings (refused with another strategy); ``options`` are the
    wrapper's other keyword arguments (apex-ddp's own, nn.DataParallel's, torch DDP's others).
    """
    if strategy == "fsdp2":
        raise ConfigError(
            "strategy fsdp2 shards through prepare(..., parallel=Parallel(strategy='fsdp2')), which maps the precision "
            "mode onto FSDP2's; wrap_model wraps whole models (ddp, apex-ddp, dp, none)"
        )
    if strategy not in WRAPPERS:
        raise choice_error("distributed strategy", strategy, STRATEGIES)
    ddp = ddp if ddp is not None else DDPOptions()
    ddp.check_strategy(strategy)
    return WRAPPERS[strategy](model, env, ddp, options)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP/DataParallel/apex DDP wrappers."""
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)) or type(model).__name__ == "DistributedDataParallel":
        model = model.module
    return model


class GradSync:
    """Skip gradient all-reduce on the micro-steps of an accumulation window but the last.

    ``with sync.micro_step(is_last):`` runs backward under DDP's ``no_sync`` (FSDP2: gradient sync
    off) unless ``is_last``; models without either (single process, DataParallel) are unaffected.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def micro_step(self, is_last: bool) -> AbstractContextManager[Any]:
        if is_last:
            return contextlib.nullcontext()
        if is_sharded(self._model):
            return gradient_sync_off(self._model)
        no_sync = getattr(self._model, "no_sync", None)
        return contextlib.nullcontext() if no_sync is None else no_sync()


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
