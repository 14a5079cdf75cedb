"""``Parallel``: how a run's model is spread over processes, as one object built once and handed down.

The strategy, the sync-BN choice, torch DDP's settings and the wrapper's own options used to cross
the Trainer, the run's set-up and ``prepare`` as loose arguments; as one value they are checked
together where they are made (a recipe, a user's code) and ``prepare`` asks it to do its two jobs:
synchronise the BatchNorms before the model is placed, wrap it once the optimizer is bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampddp.choices import STRATEGIES, SYNC_BN_CHOICES
from ampddp.distributed.env import DistEnv
from ampddp.distributed.fsdp2 import FSDPOptions, shard_model
from ampddp.distributed.sync_bn import convert_sync_batchnorm
from ampddp.distributed.wrap import DDPOptions, wrap_model
from ampddp.errors import ConfigError, choice_error


@dataclass(frozen=True)
class Parallel:
    """``strategy``: ddp | apex-ddp | fsdp2 | dp | none (``ddp`` and ``apex-ddp`` leave a single
    process's model bare; ``fsdp2`` needs 2+ processes). ``sync_bn``: off | auto | torch | apex |
    portable. ``ddp``: torch DDP's settings (refused with another strategy). ``fsdp``: FSDP2's
    settings (refused with another strategy). ``wrap_options``: the wrapper's other keyword
    arguments (apex-ddp's own, nn.DataParallel's, torch DDP's others)."""

    strategy: str = "ddp"
    sync_bn: str = "off"
    ddp: DDPOptions = field(default_factory=DDPOptions)
    wrap_options: Mapping[str, Any] = field(default_factory=dict)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise choice_error("distributed strategy", self.strategy, STRATEGIES)
        if self.sync_bn not in SYNC_BN_CHOICES:
            raise choice_error("sync_bn", self.sync_bn, SYNC_BN_CHOICES)
        if not isinstance(self.ddp, DDPOptions):
            raise ConfigError(f"Parallel ddp={self.ddp!r} is not valid; it must be a DDPOptions")
        if not isinstance(self.wrap_options, Mapping):
            raise ConfigError(f"Parallel wrap_options={self.wrap_options!r} is not valid; it must be a mapping of keyword arguments")
        self.ddp.check_strategy(self.strategy)
        if not isinstance(self.fsdp, FSDPOptions):
            raise ConfigError(f"Parallel fsdp={self.fsdp!r} is not valid; it must be an FSDPOptions")
        self.fsdp.check_strategy(self.strategy)
        if self.strategy == "fsdp2" and self.wrap_options:
            raise ConfigError(
                f"wrap_options {sorted(self.wrap_options)} do not apply to strategy fsdp2; its settings are Parallel(fsdp=FSDPOptions(...))"
            )
        object.__setattr__(self, "wrap_options", dict(self.wrap_options))

    def synchronise_batchnorm(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``model`` with its BatchNorms synchronised as ``sync_bn`` says (itself when ``off``)."""
        return model if self.sync_bn == "off" else convert_sync_batchnorm(model, self.sync_bn, device=device)

    @property
    def shards_params(self) -> bool:
        """Whether the strategy shards the params (FSDP2): the precision set-up then maps onto it."""
        return self.strategy == "fsdp2"

    def wrap(self, model: nn.Module, env: DistEnv, sharded_param_dtype: torch.dtype | None = None,
             recompute_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> nn.Module:  # fmt: skip
        """``model`` (placed, cast and bound to its optimizer) in the strategy's wrapper. Under FSDP2,
        the precision engine's word: ``sharded_param_dtype``, the dtype the params compute in, and
        ``recompute_context``, its forward context for recomputed (activation-checkpointed) blocks."""
        if self.shards_params:
            return shard_model(model, env, self.fsdp, sharded_param_dtype, recompute_context)
        return wrap_model(model, self.strategy, env, self.ddp, **self.wrap_options)
