"""``Parallel``: how a run's model is spread over processes, as one object built once and handed down.

The strategy, the sync-BN choice, torch DDP's settings, FSDP2's and the wrapper's own options used
to cross the Trainer, the run's set-up and ``prepare`` as loose arguments; as one value they are
checked together where they are made (a recipe, a user's code), by the strategy they belong to
(``ampddp.distributed.strategies``), and ``prepare`` asks it to do its two jobs: synchronise the
BatchNorms before the model is placed, set the model up under its strategy once the engine exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
from torch import nn

from ampddp.choices import SYNC_BN_CHOICES
from ampddp.distributed.env import DistEnv
from ampddp.distributed.fsdp2 import FSDPOptions
from ampddp.distributed.mesh import ParallelDims
from ampddp.distributed.meta_init import InitProgram, ModelBuild, ModelSource
from ampddp.distributed.pipeline import PPOptions
from ampddp.distributed.strategies import MakeOptimizer, SetUp, Strategy, make_strategy
from ampddp.distributed.sync_bn import convert_sync_batchnorm
from ampddp.distributed.tensor_parallel import TPOptions
from ampddp.distributed.wrap import DDPOptions
from ampddp.errors import ConfigError, choice_error
from ampddp.precision.engine import PrecisionEngine


@dataclass(frozen=True)
class Parallel:
    """``strategy``: ddp | apex-ddp | fsdp2 | hsdp | dp | none (``ddp`` and ``apex-ddp`` leave a single
    process's model bare; ``fsdp2`` on one process needs a process group of that one rank). ``sync_bn``: off | auto | torch | apex |
    portable. ``ddp``: torch DDP's settings (refused with another strategy). ``fsdp``: FSDP2's
    settings (refused with another strategy). ``tp``: tensor parallelism inside the strategy (fsdp2, hsdp,
    none: ``TPOptions(size=..., plan=...)``). ``pp``: pipeline parallelism (none: ``PPOptions(size=..., schedule=...)``).
    ``wrap_options``: the wrapper's other keyword
    arguments (apex-ddp's own, nn.DataParallel's, torch DDP's others). ``where``: the settings'
    prefix in messages (a recipe's ``distributed.``)."""

    strategy: str = "ddp"
    sync_bn: str = "off"
    ddp: DDPOptions = field(default_factory=DDPOptions)
    wrap_options: Mapping[str, Any] = field(default_factory=dict)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    tp: TPOptions = field(default_factory=TPOptions)
    pp: PPOptions = field(default_factory=PPOptions)
    where: InitVar[str] = ""

    def __post_init__(self, where: str) -> None:
        if self.sync_bn not in SYNC_BN_CHOICES:
            raise choice_error("sync_bn", self.sync_bn, SYNC_BN_CHOICES)
        if not isinstance(self.ddp, DDPOptions):
            raise ConfigError(f"Parallel ddp={self.ddp!r} is not valid; it must be a DDPOptions")
        if not isinstance(self.wrap_options, Mapping):
            raise ConfigError(f"Parallel wrap_options={self.wrap_options!r} is not valid; it must be a mapping of keyword arguments")
        if not isinstance(self.fsdp, FSDPOptions):
            raise ConfigError(f"Parallel fsdp={self.fsdp!r} is not valid; it must be an FSDPOptions")
        if not isinstance(self.tp, TPOptions):
            raise ConfigError(f"Parallel tp={self.tp!r} is not valid; it must be a TPOptions (tensor parallelism's settings)")
        if not isinstance(self.pp, PPOptions):
            raise ConfigError(f"Parallel pp={self.pp!r} is not valid; it must be a PPOptions (pipeline parallelism's settings)")
        if self.pp.enabled and self.sync_bn != "off":
            raise ConfigError(f"{where}sync_bn={self.sync_bn} with {where}pp_size={self.pp.size}: a synchronised BatchNorm averages "
                              "over the data-parallel ranks, and a pipeline's ranks hold different layers; use sync_bn off")  # fmt: skip
        object.__setattr__(self, "wrap_options", dict(self.wrap_options))
        plan = make_strategy(
            self.strategy, ddp=self.ddp, fsdp=self.fsdp, wrap_options=self.wrap_options, tp=self.tp, pp=self.pp, where=where
        )
        object.__setattr__(self, "_plan", plan)

    @property
    def plan(self) -> Strategy:
        """The strategy object, holding its own settings: its set-up order, gradient sync, checkpoint
        layout, the mesh its ranks form."""
        return self._plan  # type: ignore[attr-defined]

    def dims(self, env: DistEnv) -> ParallelDims:
        """The mesh the strategy's ranks form on ``env`` (sizes checked; the mesh itself made on first use)."""
        return self.plan.mesh_of(env)

    def synchronise_batchnorm(self, model: nn.Module, device: torch.device) -> nn.Module:
        """``model`` with its BatchNorms synchronised as ``sync_bn`` says (itself when ``off``)."""
        return model if self.sync_bn == "off" else convert_sync_batchnorm(model, self.sync_bn, device=device)

    @property
    def shards_params(self) -> bool:
        """Whether the strategy shards the params (FSDP2): the precision set-up then maps onto it."""
        return self.plan.shards_params

    def build(self, model: ModelSource) -> ModelBuild:
        """A module as it is; a function making one built as the strategy wants (FSDP2: on the meta device)."""
        if isinstance(model, ModelBuild):
            return model
        if isinstance(model, nn.Module):
            return ModelBuild(model)
        if not callable(model):
            raise ConfigError(f"model={type(model).__name__} is not valid; give a torch.nn.Module or a function that builds one")
        return self.plan.build(model)

    def set_up(self, model: nn.Module, make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
               init: InitProgram | None = None) -> SetUp:  # fmt: skip
        """The placed ``model`` under the strategy with ``engine``: (the model the loop calls, the bare
        module, its optimizer); ``init``: a meta build's initialisation, run once the strategy placed it."""
        return self.plan.set_up(model, make_optimizer, env, engine, init)
