"""Pipeline parallelism: different layers on different processes, each a *stage*, micro-batches flowing through them.

torch's engine (``torch.distributed.pipelining``: ``PipelineStage`` and its schedules) sends the activations between
the stages and runs each micro-batch's forward and backward in the schedule's order. What a run needs around it is
here: the settings (``PPOptions``), the split of a model into its stage (the model's own ``pipeline_stage(stage,
stages)``, as ampddp's GPT carries, or a function of the user's), and the step's schedule part (``PipelineSchedule``)
that the training loop asks for a window's gradients: the loop's batches are cut into micro-batches here, the first
stage reads their inputs, the last stage scores its outputs with the loop's own loss (weighted by each micro-batch's
share of the global batch, scaled by the precision engine) and every stage's backward is the schedule's. The loss
scale's verdict is agreed over every rank before any stage steps (the strategy sets the engine up so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampddp.choices import PP_SCHEDULES
from ampddp.distributed.schedule import Backward, LossOf, NoWholeForward, Result
from ampddp.errors import ConfigError, choice_error

StageSplit = Callable[[nn.Module, int, int], nn.Module] | None
"""How a model becomes one stage: a function ``(model, stage, stages) -> the stage's module`` (keeping the whole model's
parameter names), or None: the model's own ``pipeline_stage(stage, stages)``."""

SCHEDULE_CLASSES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
"""The schedules that run one stage per rank, by their recipe names (torch's classes)."""


@dataclass(frozen=True)
class PPOptions:
    """``size``: the stages (one per rank of the mesh's outermost ``pp`` dimension; 1: no pipeline). ``schedule``: the
    order micro-batches go through the stages (``PP_SCHEDULES``). ``microbatches``: how many each batch is cut into
    (None: as many as stages; fewer leaves stages idle). ``split``: see ``StageSplit``."""

    size: int = 1
    schedule: str = "1F1B"
    microbatches: int | None = None
    split: StageSplit = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"pp_size={self.size!r} is not valid; it must be an integer >= 1 (1: no pipeline parallelism)")
        if self.schedule not in PP_SCHEDULES:
            raise choice_error("pp_schedule", self.schedule, PP_SCHEDULES)
        if self.schedule not in SCHEDULE_CLASSES:
            raise ConfigError(f"pp_schedule={self.schedule!r} places several stages on each rank, which ampddp does not run yet; "
                              f"use {' or '.join(SCHEDULE_CLASSES)} (one stage per rank)")  # fmt: skip
        micro = self.microbatches
        if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
            raise ConfigError(f"pp_microbatches={micro!r} is not valid; it must be an integer >= 1, or null (as many as stages)")
        if self.split is not None and not callable(self.split):
            raise ConfigError(f"pp_split={self.split!r} is not valid; give a function (model, stage, stages) -> the stage's "
                              "module, or null (the model's own pipeline_stage)")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def micro_batches(self) -> int:
        """How many micro-batches each batch is cut into."""
        return self.microbatches if self.microbatches is not None else self.size

    def changed(self, where: str = "") -> list[str]:
        """The settings given other values than their defaults, as ``{where}pp_name=value``."""
        return [f"{where}pp_{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]


def split_stage(model: nn.Module, stage: int, options: PPOptions) -> nn.Module:
    """``model`` cut down to its stage ``stage`` of ``options.size``: by ``options.split``, else by the model's own
    ``pipeline_stage``; a model with neither is refused in one line."""
    if options.split is not None:
        part = options.split(model, stage, options.size)
        if not isinstance(part, nn.Module):
            raise ConfigError(f"pp_split returned a {type(part).__name__} for stage {stage}; it must return the stage's nn.Module")
        return part
    own = getattr(model, "pipeline_stage", None)
    if not callable(own):
        raise ConfigError(f"{type(model).__name__} has no pipeline split: give distributed.pp_split as a function (model, stage, "
                          "stages) that returns the stage's module (ampddp.zoo.models:gpt splits its blocks by itself)")  # fmt: skip
    return own(stage, options.size)


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` (tensors, or dicts, lists and tuples of them) cut along its first dimension into ``parts`` micro-batches
    of sizes as even as they go; a batch of fewer samples than ``parts`` is refused in one line."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    samples = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
    if samples < parts:
        raise ConfigError(f"a batch of {samples} sample(s) does not split into pp_microbatches={parts}; give each data-parallel "
                          f"rank batches of at least {parts} (data.batch_size), fewer micro-batches, or data.drop_last: true")  # fmt: skip
    cut = [leaf.tensor_split(parts) if isinstance(leaf, torch.Tensor) and leaf.dim() else [leaf] * parts for leaf in leaves]
    return [tree_unflatten([pieces[index] for pieces in cut], spec) for index in range(parts)]


class StageModule(nn.Module):
    """The module torch's ``PipelineStage`` runs on a rank: the stage, its forward in the precision engine's context.
    On the first stage it receives a micro-batch's index and runs the loop's own forward of that micro-batch (the batch
    adapter's: a dict batch as keywords, ``(inputs, targets)`` as inputs); later stages receive the activations."""

    def __init__(self, stage: nn.Module, forward_context: Callable[[], AbstractContextManager[Any]], first: bool) -> None:
        super().__init__()
        self.stage, self.forward_context, self.first = stage, forward_context, first
        self.micro_batches: Sequence[Any] = ()
        self.loss_of: LossOf | None = None

    def forward(self, *inputs: Any) -> Any:
        with self.forward_context():
            if self.first:
                if self.loss_of is None:
                    raise RuntimeError("the pipeline's first stage ran outside a training step")
                return self.loss_of.forward(self.stage, self.micro_batches[int(inputs[0])])
            return self.stage(*inputs)


class LastStageOutputs(nn.Module):
    """What the training loop calls as its model under pipeline parallelism: on the last stage, the outputs the
    pipeline computed for the micro-batch being scored (so the loop's loss and metrics read them as a whole model's)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.current: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.current is None:
            raise RuntimeError("under pipeline parallelism the model's outputs exist on the last stage, inside the schedule's step")
        return self.current


@dataclass
class PipelineParts:
    """A rank's place in the pipeline, made by the strategy's set-up: its stage, torch's ``PipelineStage`` over it,
    and the loop-facing model."""

    stage_index: int
    stages: int
    module: StageModule
    torch_stage: Any
    outputs: LastStageOutputs

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1


class PipelineSchedule:
    """A window's gradients through torch's pipeline schedule: each batch of the window cut into
    ``options.micro_batches`` micro-batches, one ``step`` of the schedule per batch (gradients accumulate across the
    window's batches as across the micro-batches). The last stage scores each micro-batch's outputs with the loop's
    ``loss_of`` and hands the schedule the weighted, scaled loss (``backward.scaled``); every stage then says its
    backward ran (``backward.done``). Returns the window's sum of per-sample losses on the last stage, 0 elsewhere:
    ``loss_copies`` counts one holder per data coordinate and tensor-parallel rank."""

    def __init__(self, parts: PipelineParts, options: PPOptions) -> None:
        from torch.distributed.pipelining import schedules

        self.parts, self.options = parts, options
        self._scores: Callable[[int, Any], torch.Tensor] | None = None
        kind = getattr(schedules, SCHEDULE_CLASSES[options.schedule])
        # the loop weights each micro-batch's loss by its share of the global batch: torch's division by the number of
        # micro-batches (scale_grads) would count it twice, and be wrong for uneven micro-batches
        self._schedule = kind(parts.torch_stage, options.micro_batches, loss_fn=self._loss, scale_grads=False)

    def loss_copies(self, ranks_per_data_rank: int) -> int:
        """How many ranks of one data coordinate hold its loss: the last stage's (its tensor-parallel ranks)."""
        return max(ranks_per_data_rank // self.parts.stages, 1)

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        if self._scores is None:
            raise RuntimeError("the pipeline scored a micro-batch outside a training step")
        return self._scores(int(index), output)

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        parts, total = self.parts, torch.zeros((), dtype=torch.float64)
        for batch in window:
            micro = split_batch(batch, self.options.micro_batches)
            parts.module.micro_batches, parts.module.loss_of = micro, loss_of
            seen: dict[int, torch.Tensor] = {}

            def score(index: int, output: Any, micro: list[Any] = micro, seen: dict[int, torch.Tensor] = seen) -> torch.Tensor:
                parts.outputs.current = output
                try:
                    loss, count = loss_of(index, micro[index])
                finally:
                    parts.outputs.current = None
                seen[index] = loss.detach().double() * count  # torch may score a micro-batch twice at warm-up: kept once
                return backward.scaled(loss, count)

            self._scores = score
            indices = [torch.tensor(index) for index in range(len(micro))]
            try:
                self._schedule.step(arg_mbs=[(index,) for index in indices] if parts.is_first else None,
                                    target_mbs=indices if parts.is_last else None, return_outputs=False)  # fmt: skip
            finally:
                self._scores, parts.module.micro_batches, parts.module.loss_of = None, (), None
            backward.done()
            total = total + sum(seen.values(), torch.zeros((), dtype=torch.float64))
        return total

    def forward(self, run: Callable[[], Result]) -> Result:
        raise NoWholeForward("under pipeline parallelism no rank holds the whole model: a forward outside training (evaluation, "
                             "the diagnosis of a non-finite step) runs through the pipeline, which ampddp does not do yet")  # fmt: skip
