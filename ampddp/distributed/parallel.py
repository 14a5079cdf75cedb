"""``Parallel``: how a run's model is spread over processes, as one object built once and handed down.

The strategy, the sync-BN choice, torch DDP's settings and the wrapper's own options used to cross
the Trainer, the run's set-up and ``prepare`` as loose arguments; as one value they are checked
together where they are made (a recipe, a user's code) and ``prepare`` asks it to do its two jobs:
synchronise the BatchNorms before the model is placed, wrap it once the optimizer is bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampddp.choices import STRATEGIES, SYNC_BN_CHOICES
from ampddp.distributed.env import DistEnv
from ampddp.distributed.sync_bn import convert_sync_batchnorm
from ampddp.distributed.wrap import DDPOptions, wrap_model
from ampddp.errors import ConfigError, choice_error


@dataclass(frozen=True)
class Parallel:
    """``strategy``: ddp | apex-ddp | dp | none (``ddp`` and ``apex-ddp`` leave a single process's
    model bare). ``sync_bn``: off | auto | torch | apex | portable. ``ddp``: torch DDP's settings
    (refused with another strategy). ``wrap_options``: the wrapper's other keyword arguments
    (apex-ddp's own, nn.DataParallel's, torch DDP's others)."""

    strategy: str = "ddp"
    sync_bn: str = "off"
    ddp: DDPOptions = field(default_factory=DDPOptions)
    wrap_options: Mapping[str, Any] = field(default_factory=dict)

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
        object.__setattr__(self, "wrap_options", dict(self.wrap_options))

    def synchronise_batchnorm(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``model`` with its BatchNorms synchronised as ``sync_bn`` says (itself when ``off``)."""
        return model if self.sync_bn == "off" else convert_sync_batchnorm(model, self.sync_bn, device=device)

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        """``model`` (placed, cast and bound to its optimizer) in the strategy's wrapper."""
        return wrap_model(model, self.strategy, env, self.ddp, **self.wrap_options)
