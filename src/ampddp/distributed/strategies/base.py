"""What every strategy is: a way of spreading a model over processes, holding its own settings.

A strategy says how many of the mesh's dimensions it uses (``dims``), the precision engine it runs a
mode with, its set-up order (model -> [stored dtypes -> sharding] -> optimizer -> engine [-> wrapper]),
how gradient sync is skipped inside an accumulation window, what the checkpoint layout ``auto`` means
under it, whether every forward is a collective, and what ``compile`` compiles. Code outside
``ampddp.distributed`` asks the strategy, never which strategy it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NamedTuple

from torch import nn
from torch.optim import Optimizer

from ampddp.distributed.env import DistEnv
from ampddp.distributed.gradient_rider import GradientRider
from ampddp.distributed.mesh import ParallelDims
from ampddp.distributed.meta_init import InitProgram, ModelBuild, model_from
from ampddp.distributed.schedule import MicroBatches, StepSchedule
from ampddp.distributed.wrap import GradSync
from ampddp.errors import ConfigError
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine

MakeOptimizer = Callable[[Iterable[nn.Parameter]], Optimizer]


class SetUp(NamedTuple):
    """A model set up under its strategy: the model the loop calls (wrapped), the bare module, its optimizer."""

    model: nn.Module
    module: nn.Module
    optimizer: Optimizer


class HeldStages(NamedTuple):
    """Several pipeline stages set up on one rank (a looped schedule): the set-up (``module``: one module holding them
    all under the whole model's names), each stage's module as it runs its forward (by index), and the stage of each of
    the optimizer's parameters in param-group order."""

    set_up: SetUp
    modules: dict[int, nn.Module]
    optimizer_stages: list[int]


def bind_stages(held: dict[int, nn.Module], make_optimizer: MakeOptimizer, engine: PrecisionEngine) -> HeldStages:
    """One optimizer over the parameters of every stage in ``held`` (held together by ``united``) and the precision
    engine over each stage's module; which stage each optimizer parameter belongs to is read before the engine puts
    masters in their places."""
    from ampddp.distributed.pipeline import united

    whole = united(list(held.values()))
    optimizer = make_optimizer(whole.parameters())
    stage_of = {id(param): index for index, module in held.items() for param in module.parameters()}
    stages = [stage_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    engine.setup(list(held.values()), [optimizer])
    return HeldStages(SetUp(whole, whole, optimizer), held, stages)


class Strategy:
    """A whole-model strategy: the engine sets up the placed model and its optimizer (cast, masters),
    then the wrapper takes the model. Subclasses give ``name``, ``takes`` and what differs."""

    name: ClassVar[str]
    takes: ClassVar[tuple[str, ...]] = ()
    """The settings its constructor takes, by ``Parallel``'s field names (``ddp``, ``fsdp``, ``wrap_options``)."""
    shards_params: ClassVar[bool] = False
    """Whether the params are sharded over the ranks (the engine then maps its mode onto the sharding)."""
    needs_process_group: ClassVar[bool] = False
    """Whether a process group must exist even on one process (FSDP2's device mesh is built over one):
    ``ampddp train`` then makes a group of its one rank for the run."""
    checkpoint_layout: ClassVar[str] = "whole"
    """What ``checkpoint.layout: auto`` writes under this strategy."""
    collective_forward: ClassVar[bool] = False
    """Whether every forward gathers with every rank (evaluation then runs as many forwards on each)."""
    forwards_through_model: ClassVar[bool] = False
    """Whether a whole-model forward must call the wrapped model rather than the bare module (a pipeline stage's module
    holds part of the model); otherwise the diagnosis of a non-finite step runs the bare module, outside any compile."""

    @classmethod
    def with_tensor_parallel(cls, where: str = "") -> type[Strategy]:
        """The strategy that runs this one's data parallelism with tensor parallelism inside it, or one line naming
        the strategies that compose with it (torch DDP and DataParallel replicate whole modules: no mesh)."""
        raise ConfigError(f"{where}tp_size > 1: tensor parallelism composes with strategy fsdp2, hsdp, or none (tensor "
                          f"parallelism alone); {where}strategy={cls.name} replicates whole models")  # fmt: skip

    pipelines: ClassVar[bool] = False
    """Whether it runs inside each stage of a pipeline (``strategies.pipelined.Pipelined``)."""
    stages: int = 1
    """The pipeline stages its mesh counts (the outermost dimension; set by ``Pipelined``): its own dimensions span the
    ranks of one stage."""

    def check_settings(self, where: str = "") -> None:
        """Refuse settings of its own it cannot use together; ``where``: their prefix in messages
        (``distributed.`` for a recipe). Settings of another strategy never reach it (``make_strategy``)."""

    def dims(self, env: DistEnv) -> ParallelDims:
        """The mesh its ranks form: data parallelism over every rank, each a replica."""
        return ParallelDims.data_parallel(env)

    def recorded_layout(self, dims: ParallelDims) -> dict[str, Any]:
        """What a checkpoint records of the layout that wrote it: the strategy and the mesh's sizes."""
        return {"strategy": self.name, **dims.sizes()}

    def mesh_of(self, env: DistEnv) -> ParallelDims:
        """``dims(env)``, made once for ``env``: whoever asks (``prepare`` for the data coordinates, the set-up
        for the dimensions it splits and shards over) gets the one device mesh, whose process groups are built
        once (each a communicator, device memory on a GPU)."""
        made = getattr(self, "_made_for", None)
        if made is None or made[0] != env:
            made = self._made_for = (env, self._staged_dims(env))
        return made[1]

    def _staged_dims(self, env: DistEnv) -> ParallelDims:
        """``dims`` over one stage's ranks, the stages made the mesh's outermost dimension."""
        if self.stages == 1:
            return self.dims(env)
        if env.world_size % self.stages:
            raise ConfigError(f"pp_size={self.stages} does not divide the world of {env.world_size} rank(s); choose a pp_size that "
                              "divides the number of processes")  # fmt: skip
        per_stage = env.world_size // self.stages
        inner = self.dims(dataclasses.replace(env, world_size=per_stage, rank=env.rank % per_stage,
                                              local_world_size=max(env.local_world_size // self.stages, 1)))  # fmt: skip
        return dataclasses.replace(inner, world_size=env.world_size, pp=self.stages)

    def engine_for(self, precision: Precision) -> PrecisionEngine:
        """A fresh engine running ``precision`` (resolved) under this strategy."""
        return precision.build_engine()

    def build(self, factory: Callable[[], nn.Module]) -> ModelBuild:
        """The model ``factory`` makes, built as this strategy wants it (whole models: eagerly)."""
        return ModelBuild(model_from(factory))

    def set_up(self, model: nn.Module, make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
               init: InitProgram | None = None) -> SetUp:  # fmt: skip
        """The placed ``model`` trained under this strategy. ``init``: a meta-built model's
        initialisation (materialised whole here)."""
        if init is not None:
            init.materialise(model, env.device)
        optimizer = make_optimizer(model.parameters())
        engine.setup([model], [optimizer])
        return SetUp(self.wrap(model, env), model, optimizer)

    def set_up_held(self, held: dict[int, nn.Module], make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
                    init: InitProgram | None = None) -> HeldStages:  # fmt: skip
        """Several pipeline stages of the model on this rank, each cut from a copy of it (by index), set up as this
        strategy sets up a model (here: materialised), then bound to one optimizer and the engine (``bind_stages``)."""
        for module in held.values() if init is not None else ():
            init.materialise(module, env.device)  # a meta build's values, named as the whole model's in each stage
        return bind_stages(held, make_optimizer, engine)

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        """``model`` (placed, cast and bound to its optimizer) in this strategy's wrapper."""
        return model

    def optimizer_stages(self) -> list[int] | None:
        """Once set up, the pipeline stage of each of the optimizer's parameters, in param-group order (None: the model is
        not cut into stages); a checkpoint then reads this rank's part as the whole model's (``ampddp.checkpoint.stage_view``)."""
        return None

    def grad_sync(self, model: nn.Module) -> GradSync:
        """Gradient sync skipped on an accumulation window's micro-steps but the last."""
        return GradSync(model)

    def gradient_rider(self, model: nn.Module) -> GradientRider | None:
        """Where a step's few agreed numbers can travel with ``model``'s gradients, for a loop that agrees some every step
        (``ampddp.distributed.gradient_rider``), and which sums the gradients of the backwards it is ``summing`` (the loop
        weights each rank's loss by its share of the global batch); None: in an all-reduce of their own."""
        return None

    def schedule(self, model: nn.Module, grad_sync: GradSync) -> StepSchedule:
        """Who runs a window's forwards and backwards of ``model`` (``ampddp.distributed.schedule``): each
        micro-batch in turn on this rank, the gradients synced on the last (``grad_sync``)."""
        return MicroBatches(grad_sync)

    def compile_units(self, module: nn.Module) -> list[nn.Module]:
        """The parts ``compile`` compiles one by one (empty: the whole model as one)."""
        return []
