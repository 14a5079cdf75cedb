"""torch DDP's settings, gradient-sync skipping, unwrapping, and exact global-batch loss weights
(the strategies that use them: ``ampddp.distributed.strategies``)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.choices import COMM_HOOKS
from ampddp.distributed.data import DataPlace, data_shard, sum_across_ranks
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

    def changed(self, where: str = "") -> list[str]:
        """The settings given other values than their defaults, as ``{where}name=value``."""
        return [f"{where}{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP/DataParallel/apex DDP wrappers."""
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)) or type(model).__name__ == "DistributedDataParallel":
        model = model.module
    return model


class GradSync:
    """Skip gradient all-reduce on the micro-steps of an accumulation window but the last.

    ``with sync.micro_step(is_last):`` runs backward under the wrapper's ``no_sync`` unless
    ``is_last``; models without one (single process, DataParallel) are unaffected. A strategy that
    syncs otherwise gives its own (``ampddp.distributed.strategies``: FSDP2's).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def micro_step(self, is_last: bool) -> AbstractContextManager[Any]:
        if is_last:
            return contextlib.nullcontext()
        no_sync = getattr(self._model, "no_sync", None)
        return contextlib.nullcontext() if no_sync is None else no_sync()


def global_batch_loss_weight(local_samples: int, place: DataPlace) -> float:
    """Factor for the local mean loss so that DDP's mean over ranks is the global-batch gradient.

    DDP averages rank gradients with equal weight 1/k. When rank j holds m_j of the step's n
    samples, the true gradient weights rank j by m_j/n, so the local loss is scaled by m_j*k/n
    (1.0 when every rank holds the same count). Costs one small all-reduce over the data ranks
    (``place``: a ``DistEnv``, every rank one, or a ``DataShard``).
    """
    shard = data_shard(place)
    if not shard.distributed:
        return 1.0
    total = float(sum_across_ranks(float(local_samples), shard.group).item())
    if total <= 0:
        raise ValueError("global batch is empty on every rank")
    return local_samples * shard.size / total
