"""Pipeline parallelism around a strategy: each rank one stage of the model, the stage set up by the strategy inside
(``none``: as it is; ``fsdp2``: sharded over the stage's data-parallel ranks; either with tensor parallelism)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from ampddp.distributed.env import DistEnv
from ampddp.distributed.mesh import ParallelDims
from ampddp.distributed.meta_init import InitProgram, ModelBuild
from ampddp.distributed.pipeline import PipelineSchedule, PPOptions, refuse_ties_across_stages, split_stage, tied_names
from ampddp.distributed.pipeline_stages import PipelineModel, PipelineParts, StageHooks
from ampddp.distributed.schedule import StepSchedule
from ampddp.distributed.strategies.base import MakeOptimizer, SetUp, Strategy
from ampddp.distributed.wrap import GradSync
from ampddp.errors import ConfigError
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine
from ampddp.torch_compat import compiled_split_backward_problem


class Pipelined(Strategy):
    """``inner``'s parallelism within each stage of a pipeline of ``pp.size`` stages (the mesh's outermost dimension):
    the model built as ``inner`` builds it (FSDP2: on the meta device, each stage then materialising only its layers'
    shards), cut to the rank's stage (``split_stage``: the whole model's parameter names kept; weights tied across stages
    refused), set up by ``inner`` (its optimizer, its precision engine: O2/O5's fp32 masters per stage), then run by
    torch's pipeline schedules (``PipelineSchedule``). The loss-scale verdict is agreed over every rank, the gradient
    norm combines the stages'. Checkpoints are sharded and read as the whole model's."""

    checkpoint_layout = "sharded"
    collective_forward = True
    forwards_through_model = True

    def __init__(self, inner: Strategy, pp: PPOptions) -> None:
        self.inner, self.pp = inner, pp
        inner.stages = pp.size
        self._parts: PipelineParts | None = None
        self._model: PipelineModel | None = None
        self._optimizer_stages: list[int] | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def shards_params(self) -> bool:  # type: ignore[override]
        return self.inner.shards_params

    @property
    def needs_process_group(self) -> bool:  # type: ignore[override]
        return self.inner.needs_process_group

    def check_settings(self, where: str = "") -> None:
        self.inner.check_settings(where)

    def dims(self, env: DistEnv) -> ParallelDims:
        return self.inner.mesh_of(env)

    def mesh_of(self, env: DistEnv) -> ParallelDims:
        """The inner strategy's mesh, which counts the stages: one mesh for both. A pipeline per data-parallel rank needs a
        strategy that keeps them together (fsdp2); strategy none would leave them training apart."""
        dims = self.inner.mesh_of(env)
        if dims.dp_size > 1 and not self.inner.shards_params:
            raise ConfigError(f"strategy {self.name} with pp_size={self.pp.size} on {env.world_size} processes leaves {dims.dp_size} "
                              "pipelines training apart; use strategy fsdp2 for the data-parallel dimension, or pp_size x "
                              "tp_size processes")  # fmt: skip
        return dims

    def recorded_layout(self, dims: ParallelDims) -> dict[str, Any]:
        """The strategy and mesh, and the pipeline's schedule and its number of stages (several per rank: looped)."""
        return {**self.inner.recorded_layout(dims), "pp_schedule": self.pp.schedule, "pp_stages": self.pp.stages}

    def engine_for(self, precision: Precision) -> PrecisionEngine:
        return self.inner.engine_for(precision)

    def build(self, factory: Callable[[], nn.Module]) -> ModelBuild:
        return self.inner.build(factory)

    def set_up(self, model: nn.Module, make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
               init: InitProgram | None = None) -> SetUp:  # fmt: skip
        dims = self.mesh_of(env)
        indices = self.pp.stages_of(dims.coordinates(env.rank)["pp"])
        tied = tied_names(model)
        copies = [copy.deepcopy(model) for _ in indices[1:]] + [model]  # each stage cut from a model of its own
        held = {index: split_stage(whole, index, self.pp) for index, whole in zip(indices, copies)}
        refuse_ties_across_stages(tied, held, env)
        if len(held) == 1:
            inside = self.inner.set_up(held[indices[0]], make_optimizer, env, engine, init)
            held = {indices[0]: inside.model}
            self._optimizer_stages = [indices[0]] * sum(len(group["params"]) for group in inside.optimizer.param_groups)
        else:
            inside, held, self._optimizer_stages = self.inner.set_up_held(held, make_optimizer, env, engine, init)
        group = dims.submesh("pp").get_group()
        engine.agree_over(dist.group.WORLD)  # the stages hold different gradients: every rank takes the same verdict
        engine.norm_across(group)  # and different parts of the model: the gradient norm is their norms' combination
        owners = tuple(dist.get_global_rank(group, holder) for holder in self.pp.holders())
        hooks = {index: StageHooks(module, engine.forward_context, first=index == 0) for index, module in held.items()}
        self._parts = PipelineParts(hooks, self.pp.stages, group, env.device, owners, env.rank)
        self._model = PipelineModel(self._parts)
        return SetUp(self._model, inside.module, inside.optimizer)

    def grad_sync(self, model: nn.Module) -> GradSync:
        return GradSync(model)

    def compile_units(self, module: nn.Module) -> list[nn.Module]:
        """The stage's blocks compiled one by one (FSDP2's units, or the members of its module lists and dicts): the
        pipeline's own model runs the stages through torch's schedules and cannot be compiled whole."""
        if "ZeroBubble" in self.pp.schedule and compiled_split_backward_problem() is not None:
            raise ConfigError(compiled_split_backward_problem())
        blocks = self.inner.compile_units(module) or [
            block for child in module.modules() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) for block in child.children()
        ]
        if not blocks:
            raise ConfigError(f"compile under pipeline parallelism compiles each stage's blocks (the members of its "
                              f"nn.ModuleList or nn.ModuleDict), and this stage of {type(module).__name__} has none; leave "
                              "compile off")  # fmt: skip
        return blocks

    def optimizer_stages(self) -> list[int] | None:
        if self._optimizer_stages is None:
            raise RuntimeError("the pipeline's stages are known after its set-up")
        return self._optimizer_stages

    def schedule(self, model: nn.Module, grad_sync: GradSync) -> StepSchedule:
        if self._parts is None or self._model is None:
            raise RuntimeError("the pipeline's schedule is made after its set-up")
        return PipelineSchedule(self._parts, self._model, self.pp)
