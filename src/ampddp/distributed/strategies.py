"""One object per way of spreading a model over processes, each owning what differs between them.

A strategy says which settings it takes, how many processes it needs, the precision engine it
runs a mode with, its set-up order (model -> [stored dtypes -> sharding] -> optimizer -> engine
[-> wrapper]), how gradient sync is skipped inside an accumulation window, what the checkpoint
layout ``auto`` means under it, whether every forward is a collective, and what ``compile``
compiles. Code outside ``ampddp.distributed`` asks the strategy, never which strategy it is.

A new strategy is one class below and one entry of :data:`STRATEGY_TABLE` (its name in
``ampddp.choices.STRATEGIES``, where the command line lists it without importing torch).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any, ClassVar

from torch import nn
from torch.optim import Optimizer

from ampddp.choices import STRATEGIES
from ampddp.distributed.apex_ddp import DistributedDataParallel as ApexDistributedDataParallel
from ampddp.distributed.env import DistEnv
from ampddp.distributed.fsdp2 import FSDPOptions, gradient_sync_off, shard_model, sharded_blocks
from ampddp.distributed.installed_apex import installed_apex_parallel
from ampddp.distributed.meta_init import InitProgram, ModelBuild, build_on_meta, model_from
from ampddp.distributed.model_agreement import check_models_agree
from ampddp.distributed.wrap import DDPOptions, GradSync
from ampddp.errors import ConfigError, choice_error
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine

MakeOptimizer = Callable[[Iterable[nn.Parameter]], Optimizer]


class Strategy:
    """A whole-model strategy: the engine sets up the placed model and its optimizer (cast, masters),
    then the wrapper takes the model. Subclasses give ``name`` and ``_wrap``."""

    name: ClassVar[str]
    shards_params: ClassVar[bool] = False
    """Whether the params are sharded over the ranks (the engine then maps its mode onto the sharding)."""
    needs_process_group: ClassVar[bool] = False
    """Whether a process group must exist even on one process (FSDP2's device mesh is built over one):
    ``ampddp train`` then makes a group of its one rank for the run."""
    checkpoint_layout: ClassVar[str] = "whole"
    """What ``checkpoint.layout: auto`` writes under this strategy."""
    collective_forward: ClassVar[bool] = False
    """Whether every forward gathers with every rank (evaluation then runs as many forwards on each)."""

    def check_settings(self, ddp: DDPOptions, fsdp: FSDPOptions, wrap_options: Mapping[str, Any], where: str = "") -> None:
        """Refuse the settings this strategy would not use; ``where``: their prefix in messages
        (``distributed.`` for a recipe)."""
        ddp.check_strategy(self.name, where)
        fsdp.check_strategy(self.name, f"{where}fsdp_" if where else "")

    def engine_for(self, precision: Precision) -> PrecisionEngine:
        """A fresh engine running ``precision`` (resolved) under this strategy."""
        return precision.build_engine()

    def build(self, factory: Callable[[], nn.Module], fsdp: FSDPOptions) -> ModelBuild:
        """The model ``factory`` makes, built as this strategy wants it (whole models: eagerly)."""
        return ModelBuild(model_from(factory))

    def set_up(self, model: nn.Module, make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
               ddp: DDPOptions, fsdp: FSDPOptions, wrap_options: Mapping[str, Any],
               init: InitProgram | None = None) -> tuple[nn.Module, nn.Module, Optimizer]:  # fmt: skip
        """The placed ``model`` trained under this strategy: (the model the loop calls, the bare module,
        its optimizer). ``init``: a meta-built model's initialisation (materialised whole here)."""
        if init is not None:
            init.materialise(model, env.device)
        optimizer = make_optimizer(model.parameters())
        engine.setup([model], [optimizer])
        return self.wrap(model, env, ddp, dict(wrap_options)), model, optimizer

    def wrap(self, model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
        """``model`` (placed, cast and bound to its optimizer) in this strategy's wrapper."""
        return model

    def grad_sync(self, model: nn.Module) -> GradSync:
        """Gradient sync skipped on an accumulation window's micro-steps but the last."""
        return GradSync(model)

    def compile_units(self, module: nn.Module) -> list[nn.Module]:
        """The parts ``compile`` compiles one by one (empty: the whole model as one)."""
        return []


class _Replicated(Strategy, ABC):
    """A wrapper that keeps a whole copy per process and syncs gradients; a single process's model
    stays bare (nobody to sync with), and the ranks' models are compared before wrapping."""

    def wrap(self, model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
        if not env.distributed:
            return model
        check_models_agree(model, env)
        return self._replicate(model, env, ddp, options)

    @abstractmethod
    def _replicate(self, model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
        """``model`` in the wrapper (several processes, the same model on each)."""


class TorchDDP(_Replicated):
    """torch DDP (device_ids bound on CUDA)."""

    name = "ddp"

    def _replicate(self, model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
        return ddp.wrap(model, [env.device.index] if env.device.type == "cuda" else None, **options)


class ApexDDP(_Replicated):
    """apex's DDP: NVIDIA's from an old apex build, else ampddp's apex-style one, with apex's options."""

    name = "apex-ddp"

    def _replicate(self, model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
        wrapper = installed_apex_parallel("DistributedDataParallel") or ApexDistributedDataParallel
        return wrapper(model, **options)


class DataParallel(Strategy):
    """nn.DataParallel over every visible GPU, in one process."""

    name = "dp"

    def wrap(self, model: nn.Module, env: DistEnv, ddp: DDPOptions, options: dict[str, Any]) -> nn.Module:
        if env.distributed:
            raise ConfigError("strategy 'dp' (nn.DataParallel) is single-process; with several processes use 'ddp'")
        return nn.DataParallel(model, **options)


class Unwrapped(Strategy):
    """The model as it is (one process, or the user's own wrapper)."""

    name = "none"


class FSDP2(Strategy):
    """FSDP2 (``fully_shard``): the stored dtypes first (O3: fp16, what FSDP2 shards), then the
    sharding, whose new (DTensor) params the optimizer is built over, then the engine over those; the
    engine maps O2/O5 onto FSDP2's own mixed precision (fp32 shards as masters)."""

    name = "fsdp2"
    shards_params = True
    needs_process_group = True
    checkpoint_layout = "sharded"
    collective_forward = True

    def check_settings(self, ddp: DDPOptions, fsdp: FSDPOptions, wrap_options: Mapping[str, Any], where: str = "") -> None:
        super().check_settings(ddp, fsdp, wrap_options, where)
        if wrap_options:
            raise ConfigError(
                f"wrap_options {sorted(wrap_options)} do not apply to strategy {self.name}; "
                "its settings are Parallel(fsdp=FSDPOptions(...))"
            )

    def engine_for(self, precision: Precision) -> PrecisionEngine:
        return precision.build_sharded_engine()

    def build(self, factory: Callable[[], nn.Module], fsdp: FSDPOptions) -> ModelBuild:
        """On the meta device (``fsdp.build_on_meta``): each rank materialises only its shards."""
        return build_on_meta(factory) if fsdp.build_on_meta else super().build(factory, fsdp)

    def set_up(self, model: nn.Module, make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
               ddp: DDPOptions, fsdp: FSDPOptions, wrap_options: Mapping[str, Any],
               init: InitProgram | None = None) -> tuple[nn.Module, nn.Module, Optimizer]:  # fmt: skip
        engine.convert_storage(model)
        model = shard_model(model, env, fsdp, engine.sharded_param_dtype, replicas=self.replicas(fsdp, env))
        if init is not None:
            init.materialise(model, env.device)
        optimizer = make_optimizer(model.parameters())
        engine.setup([model], [optimizer])
        return model, model, optimizer

    def replicas(self, fsdp: FSDPOptions, env: DistEnv) -> int:
        """How many sharded replicas of the model the ranks hold: one (every rank holds a shard of it)."""
        return 1

    def grad_sync(self, model: nn.Module) -> GradSync:
        return ShardedGradSync(model)

    def compile_units(self, module: nn.Module) -> list[nn.Module]:
        return sharded_blocks(module)


class HSDP(FSDP2):
    """FSDP2 on a 2-D mesh (hybrid sharding): each group of ``shard_size`` ranks (a node's by default)
    holds one sharded replica, the params all-gathered inside the group only; gradients are
    reduce-scattered in the group and all-reduced across the replicas. The same precision semantics,
    loss-scale agreement and checkpoints as FSDP2 (a checkpoint resumes across fsdp2, hsdp and ddp)."""

    name = "hsdp"

    def replicas(self, fsdp: FSDPOptions, env: DistEnv) -> int:
        return fsdp.replicas(env)


class ShardedGradSync(GradSync):
    """FSDP2's gradient sync off inside a window: gradients accumulate unsharded until the last micro-step."""

    def micro_step(self, is_last: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if is_last else gradient_sync_off(self._model)


STRATEGY_TABLE: Mapping[str, Strategy] = MappingProxyType(
    {strategy.name: strategy for strategy in (TorchDDP(), ApexDDP(), FSDP2(), HSDP(), DataParallel(), Unwrapped())}
)
"""Each strategy by the name a recipe gives (``choices.STRATEGIES`` lists the same names without torch)."""


def strategy_named(name: str) -> Strategy:
    """The strategy called ``name``, or one line naming the valid ones."""
    if name not in STRATEGY_TABLE:
        raise choice_error("distributed strategy", name, STRATEGIES)
    return STRATEGY_TABLE[name]


def wrap_model(model: nn.Module, strategy: str, env: DistEnv, ddp: DDPOptions | None = None, **options: Any) -> nn.Module:
    """Wrap an already converted, placed and optimizer-bound model for data parallelism.

    ``ddp``: torch DDP (device_ids bound on CUDA); ``apex-ddp``: apex's DDP (NVIDIA's from an old
    apex build, else ampddp's apex-style one, with apex's options); ``dp``: nn.DataParallel
    over all visible GPUs (single process); ``none``: the model itself. A single-process run gets
    the bare model for ``ddp``/``apex-ddp`` since there is nobody to synchronise with. The ``ddp``
    argument holds torch DDP's settings (refused with another strategy); ``options`` are the
    wrapper's other keyword arguments (apex-ddp's own, nn.DataParallel's, torch DDP's others).
    """
    chosen = strategy_named(strategy)
    if chosen.shards_params:
        raise ConfigError(
            f"strategy {strategy} shards through prepare(..., parallel=Parallel(strategy='{strategy}')), which maps the precision "
            "mode onto its sharding; wrap_model wraps whole models (ddp, apex-ddp, dp, none)"
        )
    ddp = ddp if ddp is not None else DDPOptions()
    ddp.check_strategy(strategy)
    return chosen.wrap(model, env, ddp, options)
