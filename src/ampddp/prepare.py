"""The one fixed set-up order for a training run: engine -> SyncBN -> device -> broadcast -> the
strategy's own order (whole models: optimizer -> precision -> wrapper; FSDP2: stored dtypes ->
sharding -> optimizer -> precision; ``ampddp.distributed.strategies``).

Precision conversion and the fp32 master copy are one step (``engine.setup``) so that masters are
taken from the exact fp32 weights; it runs after the optimizer exists and before DDP wraps the
model. SyncBN conversion comes first so the converted BatchNorm layers are the ones the optimizer
holds and O2/O5 keeps fp32. Rank 0's initial weights are broadcast before masters are made, so
masters and model agree on every rank even if ranks were seeded differently.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ampddp.choices import AUTO_PRECISION
from ampddp.distributed.env import DistEnv
from ampddp.distributed.mesh import DataShard, ParallelDims
from ampddp.distributed.meta_init import ModelBuild, ModelSource
from ampddp.distributed.model_agreement import check_models_agree
from ampddp.distributed.parallel import Parallel
from ampddp.distributed.schedule import MicroBatches, StepSchedule
from ampddp.distributed.strategies import Strategy, Unwrapped
from ampddp.distributed.wrap import GradSync
from ampddp.errors import ConfigError, wrong_type
from ampddp.precision.auto import auto_choice
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.hardware import cuda_build_bytes, cuda_build_note, nvidia_gpu_present
from ampddp.precision.host_heap import settle_host_heap
from ampddp.precision.speed_warning import warn_if_slower_than_fp32

logger = logging.getLogger("ampddp.precision")


@dataclass
class Prepared:
    """What a training loop needs: the (wrapped) model, the bare module, optimizer, engine, sync, the
    strategy that set them up (its checkpoint layout, whether forwards are collective, what compiles)
    and the mesh its ranks form (``dims``: where each rank reads data)."""

    model: nn.Module
    module: nn.Module
    optimizer: Optimizer
    engine: PrecisionEngine
    grad_sync: GradSync
    env: DistEnv
    strategy: Strategy = field(default_factory=Unwrapped)
    dims: ParallelDims | None = None
    """The mesh's dimensions; None: data parallelism over every rank of ``env``."""
    schedule: StepSchedule | None = None
    """Who runs a window's forwards and backwards; None: each micro-batch in turn (``MicroBatches``)."""

    def __post_init__(self) -> None:
        if self.schedule is None:
            self.schedule = MicroBatches(self.grad_sync)

    @functools.cached_property
    def data_shard(self) -> DataShard:
        """Where this rank reads data: its data-parallel coordinates (with data parallelism alone, its
        rank and the world size); found once (its process group is made then), asked every step."""
        return DataShard.of(self.env) if self.dims is None else self.dims.data_shard(self.env.rank)


@torch.no_grad()
def broadcast_from_main(module: nn.Module, env: DistEnv) -> None:
    """Give every rank rank 0's parameters and buffers (once the ranks agree on what those are; the
    wrapper compares them again after the precision set-up cast them, which catches ranks given
    different precision settings: one more all-gather of a digest per set-up)."""
    if not env.distributed:
        return
    check_models_agree(module, env)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


MOVED_ARGUMENTS = {
    "impl": "precision=Precision(mode, impl=...)",
    "precision_overrides": "precision=Precision(mode, overrides={...})",
    "registry": "precision=Precision(mode, registry=...)",
    "sync_bn": "parallel=Parallel(sync_bn=...)",
    "strategy": "parallel=Parallel(strategy=...)",
    "ddp": "parallel=Parallel(ddp=DDPOptions(...))",
    "wrap_options": "parallel=Parallel(wrap_options={...})",
}
"""Arguments of ``prepare`` and the Trainer that became parts of the ``precision`` / ``parallel``
objects, and where each went."""


def refuse_moved_arguments(caller: str, arguments: Iterable[str], table: Mapping[str, str] = MOVED_ARGUMENTS) -> None:
    """A ConfigError naming where each moved argument among ``arguments`` went (none: nothing happens)."""
    moved = [name for name in arguments if name in table]
    if moved:
        where = "; ".join(f"{name} -> {table[name]}" for name in moved)
        raise ConfigError(f"{caller} no longer takes {', '.join(moved)}: each is now part of an object ({where})")


@dataclass(frozen=True)
class Takes:
    """What one argument of a door (``prepare``, the Trainer) takes: ``test`` passes its values, ``words`` say what they are."""

    words: str
    test: Callable[[Any], bool]

    @classmethod
    def instance(cls, words: str, *kinds: type, optional: bool = False) -> Takes:
        """An instance of one of ``kinds`` (or None where ``optional``)."""
        return cls(words + (" or None" if optional else ""), lambda value: isinstance(value, kinds) or (optional and value is None))

    @classmethod
    def function(cls, words: str, optional: bool = False) -> Takes:
        """Anything callable (or None where ``optional``)."""
        return cls(words + (" or None" if optional else ""), lambda value: callable(value) or (optional and value is None))


def check_arguments(door: str, given: Mapping[str, Any], takes: Mapping[str, Takes]) -> None:
    """Each argument ``takes`` names, as ``given``, of a type it takes: the first that is not is an
    ``ArgumentTypeError`` in one line naming it, what it got and what it takes, before any work (it
    failed deep inside otherwise)."""
    for name, rule in takes.items():
        if not rule.test(given[name]):
            raise wrong_type(f"{door}: {name}", given[name], rule.words)


def _is_model(value: Any) -> bool:
    return isinstance(value, ModelBuild) or callable(value)  # a module is callable, as is a function that builds one


PREPARE_TAKES = {
    "model": Takes("a torch.nn.Module, a function that builds one, or a ModelBuild", _is_model),
    "make_optimizer": Takes.function("a function of the parameters that builds the optimizer (lambda p: torch.optim.SGD(p, lr=0.1))"),
    "env": Takes.instance("a DistEnv (ampddp.distributed.detect_env() or setup_distributed())", DistEnv),
    "precision": Takes.instance("a mode's name (auto, O0-O6, native-fp16, native-bf16), a Precision or a PrecisionEngine", str, Precision,
                                PrecisionEngine),
    "parallel": Takes.instance("a Parallel (strategy, sync-BN, DDP's and FSDP2's settings)", Parallel, optional=True),
}  # fmt: skip
"""What each of ``prepare``'s arguments takes (the Trainer's table starts from it)."""


def engine_for(precision: Precision, parallel: Parallel) -> PrecisionEngine:
    """The precision engine for this strategy (FSDP2 maps O2/O5 onto its own mixed precision)."""
    return parallel.plan.engine_for(precision)


def prepare(
    model: ModelSource,
    make_optimizer: Callable[[Iterable[nn.Parameter]], Optimizer],
    env: DistEnv,
    *,
    precision: str | Precision | PrecisionEngine = "auto",
    parallel: Parallel | None = None,
    **moved: Any,
) -> Prepared:
    """Set up ``model`` for training on ``env``; ``make_optimizer(params)`` builds the optimizer.

    ``model``: a module, or a function that builds one (under FSDP2 it then runs on the meta device
    and each rank materialises only its shards: ``FSDPOptions.build_on_meta``), or a ``ModelBuild``.

    ``precision``: a mode's name (its defaults), a :class:`Precision` (mode, impl, the mode's
    settings, registered functions), or a fresh :class:`PrecisionEngine` of the caller's own (used as
    it is: it is built for the strategy by its maker); ``auto`` (the default) picks the fastest
    numerically safe mode of ``env.device`` and says which. ``parallel``: a :class:`Parallel`
    (strategy, sync-BN, torch DDP's and FSDP2's settings, the wrapper's options); None is torch DDP
    without sync-BN. The strategy sets the model up in its own order (see
    ``ampddp.distributed.strategies``).
    """
    refuse_moved_arguments("prepare", moved)
    if moved:
        raise TypeError(f"prepare() got unexpected keyword argument(s) {', '.join(sorted(moved))}")
    check_arguments("prepare", {"model": model, "make_optimizer": make_optimizer, "env": env, "precision": precision, "parallel": parallel},
                    PREPARE_TAKES)  # fmt: skip
    parallel = parallel if parallel is not None else Parallel()
    engine = _engine(precision, parallel, env)
    settle_host_heap(env.device)
    built = parallel.build(model)
    model = parallel.synchronise_batchnorm(built.module, env.device)
    if built.init is None:
        model = model.to(env.device)
        broadcast_from_main(model, env)
    else:
        built.init.place_and_agree(model, env)
    dims = parallel.dims(env)  # checked before anything is placed; the mesh itself is made when a strategy asks for it
    wrapped, module, optimizer = parallel.set_up(model, make_optimizer, env, engine, built.init)
    warn_if_slower_than_fp32(engine.mode, engine.compute_dtype, env.device, [module])
    if env.device.type == "cpu" and env.is_main:
        note = cuda_build_note(torch.version.cuda, nvidia_gpu_present(), cuda_build_bytes() if torch.version.cuda else 0)
        if note is not None:  # a note among the run's first lines, not a warning: the run itself is fine
            logger.info(note)
    plan = parallel.plan
    sync = plan.grad_sync(wrapped)
    return Prepared(wrapped, module, optimizer, engine, sync, env, plan, dims, plan.schedule(wrapped, sync))


def _engine(precision: str | Precision | PrecisionEngine, parallel: Parallel, env: DistEnv) -> PrecisionEngine:
    """The caller's engine, or a fresh one for ``precision`` on ``env.device`` (``auto`` says what it picked)."""
    if isinstance(precision, PrecisionEngine):
        return precision
    requested = Precision.of(precision)
    resolved = requested.resolved(env.device)
    if requested.mode == AUTO_PRECISION:
        logger.info(auto_choice(env.device, requested.resumed_mode)[1])
    return engine_for(resolved, parallel)


class _CallablePrepareModule(types.ModuleType):
    """``from ampddp import prepare`` finds this module (importing a submodule binds its name in the
    package, over the package's own ``prepare``); calling the module calls :func:`prepare`, so
    ``ampddp.prepare(...)`` and ``ampddp.prepare.prepare(...)`` are one door."""

    def __call__(self, *args: Any, **kwargs: Any) -> Prepared:
        return prepare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePrepareModule
