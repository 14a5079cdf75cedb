"""Pipeline parallelism alone (strategy ``none`` with ``pp_size`` > 1): each rank one stage of the model."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ampddp.distributed.env import DistEnv
from ampddp.distributed.mesh import ParallelDims
from ampddp.distributed.meta_init import InitProgram
from ampddp.distributed.pipeline import (
    PipelineModel,
    PipelineParts,
    PipelineSchedule,
    PPOptions,
    StageModule,
    refuse_ties_across_stages,
    split_stage,
    tied_names,
)
from ampddp.distributed.schedule import StepSchedule
from ampddp.distributed.strategies.base import MakeOptimizer, SetUp, Strategy
from ampddp.distributed.wrap import GradSync
from ampddp.errors import ConfigError
from ampddp.precision.engine import PrecisionEngine


class PipelineOnly(Strategy):
    """Every rank one stage (``pp`` = the world): the model is built whole on each rank, cut to the rank's stage
    (``split_stage``: the whole model's parameter names kept), the optimizer and the precision engine set up over the
    stage (O2/O5's fp32 masters per stage), the loss-scale verdict agreed over every rank. Checkpoints are sharded:
    each stage writes its own tensors under the whole model's names."""

    name = "none"
    takes = ("pp",)
    checkpoint_layout = "sharded"
    collective_forward = True
    forwards_through_model = True

    def __init__(self, pp: PPOptions | None = None) -> None:
        self.pp = pp if pp is not None else PPOptions()
        self._parts: PipelineParts | None = None

    def dims(self, env: DistEnv) -> ParallelDims:
        if env.world_size != self.pp.size:
            raise ConfigError(f"strategy none with pp_size={self.pp.size} on {env.world_size} processes: pipeline parallelism alone "
                              "takes one process per stage; start pp_size processes")  # fmt: skip
        return ParallelDims(env.world_size, pp=self.pp.size, device_type=env.device.type)

    def set_up(self, model: nn.Module, make_optimizer: MakeOptimizer, env: DistEnv, engine: PrecisionEngine,
               init: InitProgram | None = None) -> SetUp:  # fmt: skip
        dims = self.mesh_of(env)
        index = dims.coordinates(env.rank)["pp"]
        tied = tied_names(model)
        stage = split_stage(model, index, self.pp)
        refuse_ties_across_stages(tied, stage, index, env)
        if init is not None:
            init.materialise(stage, env.device)
        optimizer = make_optimizer(stage.parameters())
        engine.setup([stage], [optimizer])
        group = dims.submesh("pp").get_group()
        engine.agree_over(dist.group.WORLD)  # the stages hold different gradients: every rank takes the same verdict
        engine.norm_across(group)  # and different parts of the model: the gradient norm is their norms' combination
        ranks = tuple(dist.get_global_rank(group, at) for at in range(self.pp.size))
        self._parts = PipelineParts(index, self.pp.size, StageModule(stage, engine.forward_context, first=index == 0), group,
                                    env.device, ranks)  # fmt: skip
        self._model = PipelineModel(self._parts)
        return SetUp(self._model, stage, optimizer)

    def compile_units(self, module: nn.Module) -> list[nn.Module]:
        """The stage's blocks (the members of its module lists and dicts), compiled one by one: the pipeline's own model
        runs the stages through torch's schedules and cannot be compiled whole."""
        blocks = [block for child in module.modules() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) for block in child.children()]
        if not blocks:
            raise ConfigError(f"compile under pipeline parallelism compiles each stage's blocks (the members of its "
                              f"nn.ModuleList or nn.ModuleDict), and this stage of {type(module).__name__} has none; leave "
                              "compile off")  # fmt: skip
        return blocks

    def stage_index(self) -> int | None:
        if self._parts is None:
            raise RuntimeError("the pipeline's stage is known after its set-up")
        return self._parts.stage_index

    def schedule(self, model: nn.Module, grad_sync: GradSync) -> StepSchedule:
        if self._parts is None:
            raise RuntimeError("the pipeline's schedule is made after its set-up")
        return PipelineSchedule(self._parts, self._model, self.pp)
