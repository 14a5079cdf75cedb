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

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampddp.choices import PP_SCHEDULES
from ampddp.distributed.schedule import Backward, LossOf, Result
from ampddp.errors import ConfigError, choice_error, closest

logger = logging.getLogger("ampddp.distributed")

StageSplit = Callable[[nn.Module, int, int], nn.Module] | Sequence[Sequence[str]] | None
"""How a model becomes one stage: a function ``(model, stage, stages) -> the stage's module`` (keeping the whole model's
parameter names); the module names each stage holds, one list per stage (torchtitan's ``module_fqns_per_model_part``:
every other stage's modules are removed, for a model written so, its layers in an ``nn.ModuleDict`` and its forward
skipping a module that is None); or None: the model's own ``pipeline_stage(stage, stages)``."""

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
        self._check_microbatches()
        self._check_split()

    def _check_microbatches(self) -> None:
        micro = self.microbatches
        if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
            raise ConfigError(f"pp_microbatches={micro!r} is not valid; it must be an integer >= 1, or null (as many as stages)")
        if micro is not None and micro < self.size:
            logger.warning("pp_microbatches=%d < pp_size=%d: each micro-batch goes through the stages in turn, every stage idle "
                           "while the others work; give at least pp_size", micro, self.size)  # fmt: skip

    def _check_split(self) -> None:
        split = self.split
        if isinstance(split, Sequence) and not isinstance(split, str):
            if len(split) != self.size or not all(_names(names) for names in split):
                raise ConfigError(f"pp_split={split!r} is not valid; give {self.size} lists of module names, one per stage "
                                  "(each naming at least one module)")  # fmt: skip
            object.__setattr__(self, "split", tuple(tuple(names) for names in split))
        elif split is not None and not callable(split):
            raise ConfigError(f"pp_split={split!r} is not valid; give a function (model, stage, stages) -> the stage's "
                              "module, the module names of each stage (a list per stage), or null (the model's own "
                              "pipeline_stage)")  # fmt: skip

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


def _names(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of module names."""
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(isinstance(name, str) for name in value)


def split_stage(model: nn.Module, stage: int, options: PPOptions) -> nn.Module:
    """``model`` cut down to its stage ``stage`` of ``options.size``: by ``options.split``, else by the model's own
    ``pipeline_stage``; a model with neither is refused in one line."""
    if isinstance(options.split, tuple):
        return keep_modules(model, options.split, stage)
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


def keep_modules(model: nn.Module, stages: Sequence[Sequence[str]], stage: int) -> nn.Module:
    """``model`` with the modules other stages name removed (set to None, or deleted from their ``nn.ModuleDict``):
    stage ``stage`` keeps the ones ``stages[stage]`` names. Every parameter must fall under exactly one stage's names, and
    every name must be a module of ``model``; a module of an ``nn.ModuleList`` cannot go (the list would renumber)."""
    _check_names(model, stages)
    for name in (name for at, names in enumerate(stages) if at != stage for name in names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(parent, nn.ModuleList):
            raise ConfigError(f"pp_split removes {name} from an nn.ModuleList, which would renumber the rest; hold the layers in "
                              "an nn.ModuleDict (torchtitan's way), or give pp_split as a function")  # fmt: skip
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        else:
            setattr(parent, child, None)
    return model


def _check_names(model: nn.Module, stages: Sequence[Sequence[str]]) -> None:
    """Every name a module of ``model``; every parameter under exactly one stage's names."""
    modules = [name for name, _ in model.named_modules() if name]
    for name in (name for names in stages for name in names):
        if name not in modules:
            raise ConfigError(f"pp_split names {name!r}, which is no module of {type(model).__name__}{closest(name, modules)}")
    for param_name, _ in model.named_parameters():
        owners = [at for at, names in enumerate(stages) if any(param_name == name or param_name.startswith(name + ".") for name in names)]
        if len(owners) != 1:
            where = "no stage's modules" if not owners else f"the modules of stages {owners}"
            raise ConfigError(f"pp_split puts parameter {param_name} under {where}; every parameter must fall under exactly one "
                              "stage's module names")  # fmt: skip


def tied_names(model: nn.Module) -> list[set[str]]:
    """The names of each parameter ``model`` holds under several names (tied weights: an embedding shared with a head)."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return [found for found in names.values() if len(found) > 1]


def refuse_ties_across_stages(tied: list[set[str]], stage: nn.Module, index: int, env: Any) -> None:
    """Refuse, on every rank at once (the stages' names gathered), weights tied across stages: each stage would train its
    own copy and they would part."""
    from ampddp.distributed.data import gather_objects

    kept = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
    where = {at: names for at, names in gather_objects((index, sorted(kept & set().union(*tied))), env)} if tied else {}
    for names in tied:
        stages = sorted(at for at, held in where.items() if names & set(held))
        if len(stages) > 1:
            raise ConfigError(f"weights tied across pipeline stages {stages}: {', '.join(sorted(names))} are one parameter, which "
                              "each stage would train apart; untie them, or split so that one stage holds them all")  # fmt: skip


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` (tensors, or dicts, lists and tuples of them) cut along its first dimension into ``parts`` equal
    micro-batches, or, where ``parts`` does not divide its samples (an epoch's last batch), into as many equal ones as
    the largest divisor of its samples up to ``parts`` (a pipeline's stages take one shape per step)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()]
    if not tensors:
        raise ConfigError(f"a {type(batch).__name__} batch holds no tensor with a sample dimension to cut into micro-batches")
    samples = tensors[0].shape[0]
    parts = max(count for count in range(1, min(parts, samples) + 1) if samples % count == 0)
    cut = [leaf.tensor_split(parts) if isinstance(leaf, torch.Tensor) and leaf.dim() else [leaf] * parts for leaf in leaves]
    return [tree_unflatten([pieces[index] for pieces in cut], spec) for index in range(parts)]


def shapes_of(value: Any) -> tuple[Any, ...]:
    """The shapes and dtypes of the tensors in ``value`` (a micro-batch, a forward's inputs), in order."""
    from torch.utils._pytree import tree_leaves

    return tuple((tuple(leaf.shape), leaf.dtype) for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


Feed = Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]
"""Micro-batch index -> the positional and keyword inputs the first stage's module is called with."""


class StageHooks:
    """What makes a set-up stage (bare, FSDP2's or DDP's module: torch's ``PipelineStage`` drives their gradient sync
    itself when it holds them) a pipeline stage: its forward runs in the precision engine's context, and on the first
    stage the micro-batch index torch feeds it becomes that micro-batch's inputs (``feed``: the loop's own way of
    feeding a model, a dict batch as keywords, ``(inputs, targets)`` as inputs). Hooks on the module, so it stays the
    module torch's stage and the strategy see."""

    def __init__(self, module: nn.Module, forward_context: Callable[[], AbstractContextManager[Any]], first: bool) -> None:
        self.module, self.forward_context, self.first = module, forward_context, first
        self.feed: Feed | None = None
        self._entered: list[AbstractContextManager[Any]] = []
        module.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True)
        module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        context = self.forward_context()
        context.__enter__()
        self._entered.append(context)
        if not self.first:
            return None
        if self.feed is None:
            raise RuntimeError("the pipeline's first stage ran without its inputs")
        return self.feed(int(args[0].reshape(-1)[0]))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._entered:
            self._entered.pop().__exit__(None, None, None)

    @contextlib.contextmanager
    def feeding(self, feed: Feed) -> Iterator[None]:
        self.feed = feed
        try:
            yield
        finally:
            self.feed = None


class ModelInputs:
    """Stands for a model where the loop feeds it a micro-batch: returns what it was called with."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs


@dataclass
class PipelineParts:
    """A rank's place in the pipeline, made by the strategy's set-up: its stage (in ``module``), the pipeline's process
    group and this rank's device, and the global ranks of the stages (``ranks[i]``: stage ``i``'s)."""

    stage_index: int
    stages: int
    stage: StageHooks
    group: Any
    device: torch.device
    ranks: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1

    def torch_stage(self) -> Any:
        """A new torch ``PipelineStage`` over this rank's stage (it fixes its inputs' shapes at its first step)."""
        from torch.distributed.pipelining import PipelineStage

        return PipelineStage(self.stage.module, self.stage_index, self.stages, self.device, group=self.group)


class StagesInTurn:
    """One micro-batch through the stages in turn, the activations (and their gradients) sent point to point: a forward
    of the whole model (its outputs sent to every stage), or a forward and backward for a batch the micro-batches cannot
    cut into equal parts, at least one per stage (torch's schedules take neither on every release ampddp supports)."""

    def __init__(self, parts: PipelineParts) -> None:
        self.parts = parts

    def _inputs(self, feed: Feed, keep_grad: bool) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """This stage's output and the inputs it received (made leaves needing gradients where ``keep_grad``)."""
        parts = self.parts
        if parts.is_first:
            with parts.stage.feeding(feed):
                return parts.stage.module(torch.zeros(1, dtype=torch.int64)), ()
        received = tuple(tensor.requires_grad_(keep_grad and tensor.is_floating_point())
                         for tensor in _receive(parts.ranks[parts.stage_index - 1], parts.group, parts.device))  # fmt: skip
        return parts.stage.module(*received), received

    def forward(self, feed: Feed) -> Any:
        """The whole model's outputs of ``feed`` (the first stage's inputs), on every stage."""
        import torch.distributed as dist

        parts = self.parts
        output, _ = self._inputs(feed, keep_grad=False)
        if not parts.is_last:
            _send(output, parts.ranks[parts.stage_index + 1], parts.group)
        sent = [output if parts.is_last else None]
        dist.broadcast_object_list(sent, src=parts.ranks[-1], group=parts.group)
        return sent[0]

    def forward_backward(self, feed: Feed, score: Callable[[Any], torch.Tensor]) -> None:
        """The gradients of one micro-batch: ``score(outputs)`` on the last stage is the (scaled) loss it runs the backward
        of; each stage's backward starts from the gradients the next one sends."""
        parts = self.parts
        output, received = self._inputs(feed, keep_grad=True)
        if parts.is_last:
            score(output).backward()
        else:
            _send(output, parts.ranks[parts.stage_index + 1], parts.group)
            outputs = _tensors(output)
            grads = _receive(parts.ranks[parts.stage_index + 1], parts.group, parts.device)
            torch.autograd.backward(outputs, grads)
        if not parts.is_first:
            _send(tuple(tensor.grad if tensor.grad is not None else torch.zeros_like(tensor) for tensor in received),
                  parts.ranks[parts.stage_index - 1], parts.group)  # fmt: skip


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _send(value: Any, to: int, group: Any) -> None:
    """A stage's tensor (or tuple of tensors) to global rank ``to``: their shapes and dtypes first, then the data."""
    import torch.distributed as dist

    tensors = _tensors(value)
    dist.send_object_list([[(tuple(tensor.shape), tensor.dtype) for tensor in tensors]], dst=to, group=group)
    for tensor in tensors:
        dist.send(tensor.detach().contiguous(), dst=to, group=group)


def _receive(source: int, group: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    import torch.distributed as dist

    described: list[Any] = [None]
    dist.recv_object_list(described, src=source, group=group)
    received = []
    for shape, dtype in described[0]:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=source, group=group)
        received.append(tensor)
    return tuple(received)


class PipelineModel(nn.Module):
    """What the training loop calls as its model under pipeline parallelism. Inside a training step, on the last stage:
    the outputs the pipeline computed for the micro-batch being scored (so the loop's own loss reads them as a whole
    model's). Outside one (evaluation, the last-batch check, the diagnosis of a non-finite step), called on every rank of
    the pipeline with the same batch: a forward of the whole model through the stages in turn (the first reads the
    inputs, the last computes the outputs), the outputs sent to every stage, so every rank scores them as one model
    would."""

    def __init__(self, parts: PipelineParts) -> None:
        super().__init__()
        self.parts = parts
        self.current: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.current is not None:
            return self.current
        return StagesInTurn(self.parts).forward(lambda index: (args, kwargs))


class PipelineSchedule:
    """A window's gradients through torch's pipeline schedule: each batch of the window cut into
    ``options.micro_batches`` micro-batches, one ``step`` of the schedule per batch (gradients accumulate across the
    window's batches as across the micro-batches). The first stage runs the loop's forward of each micro-batch
    (``loss_of.forward``); the last scores its outputs with the loop's own loss (``loss_of``, through ``PipelineModel``)
    and hands the schedule the weighted, scaled loss (``backward.scaled``); every stage then says its backward ran
    (``backward.done``). Returns the window's sum of per-sample losses on the last stage, 0 elsewhere: ``loss_copies``
    counts one holder per data coordinate.

    torch's stages fix the shapes of their micro-batches at their first step, so each shape gets its own (made when
    first met, on every stage at once: they read the same batch); a batch the micro-batches do not divide (an epoch's
    last) is cut into as many equal micro-batches as divide it, and fewer micro-batches than stages (asked for, or an
    odd batch's) go through the stages in turn, one by one (``StagesInTurn``)."""

    def __init__(self, parts: PipelineParts, model: PipelineModel, options: PPOptions) -> None:
        self.parts, self.model, self.options = parts, model, options
        self._scores: Callable[[int, Any], torch.Tensor] | None = None
        self._schedules = ShapeCache()

    def loss_copies(self, ranks_per_data_rank: int) -> int:
        """How many ranks of one data coordinate hold its loss: the last stage's."""
        return max(ranks_per_data_rank // self.parts.stages, 1)

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        if self._scores is None:
            raise RuntimeError("the pipeline scored a micro-batch outside a training step")
        return self._scores(int(index.reshape(-1)[0]), output)

    def _schedule_for(self, micro: Sequence[Any]) -> Any:
        """The schedule (and its stage) of micro-batches shaped as ``micro``. The loop weights each micro-batch's loss by
        its share of the global batch: torch's division by the number of micro-batches (``scale_grads``) would count it
        twice."""
        from torch.distributed.pipelining import schedules

        def make() -> Any:
            kind = getattr(schedules, SCHEDULE_CLASSES[self.options.schedule])
            return kind(self.parts.torch_stage(), len(micro), loss_fn=self._loss, scale_grads=False)

        return self._schedules.get((len(micro), shapes_of(micro[0])), make)

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        parts, total = self.parts, torch.zeros((), dtype=torch.float64)
        for batch in window:
            micro = split_batch(batch, self.options.micro_batches)
            seen: dict[int, torch.Tensor] = {}

            def score(index: int, output: Any, micro: list[Any] = micro, seen: dict[int, torch.Tensor] = seen) -> torch.Tensor:
                self.model.current = output
                try:
                    loss, count = loss_of(index, micro[index])
                finally:
                    self.model.current = None
                seen[index] = loss.detach().double() * count  # torch may score a micro-batch twice at warm-up: kept once
                return backward.scaled(loss, count)

            feed = lambda index, micro=micro: loss_of.forward(ModelInputs(), micro[index])  # noqa: E731 - the first stage's
            if len(micro) < parts.stages:  # fewer micro-batches than stages (asked for, or an odd batch's): one by one
                for index in range(len(micro)):
                    StagesInTurn(parts).forward_backward(lambda _, index=index, feed=feed: feed(index),
                                                         lambda output, index=index: score(index, output))  # fmt: skip
            else:
                self._step(self._schedule_for(micro), len(micro), feed, score)
            backward.done()
            total = total + sum(seen.values(), torch.zeros((), dtype=torch.float64))
        return total

    def _step(self, schedule: Any, count: int, feed: Feed, score: Callable[[int, Any], torch.Tensor]) -> None:
        """One step of torch's ``schedule`` over ``count`` micro-batches: it cuts the indices, each standing for the loop's
        micro-batch of that index (the first stage's input, the last stage's target)."""
        parts = self.parts
        indices = torch.arange(count)
        self._scores = score
        try:
            with parts.stage.feeding(feed):
                if parts.is_first:
                    schedule.step(indices, target=indices if parts.is_last else None)
                else:
                    schedule.step(target=indices if parts.is_last else None)
        finally:
            self._scores = None

    def forward(self, run: Callable[[], Result]) -> Result:
        """``run`` as is: the loop's model (``PipelineModel``) runs a forward through the pipeline when called."""
        return run()


class ShapeCache:
    """Schedules by the shapes they were made for, the least recently used dropped past ``size`` (variable-length data
    would otherwise keep one per length)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._held: dict[Any, Any] = {}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        found = self._held.pop(key, None)
        if found is None:
            found = make()
            if len(self._held) >= self.size:
                self._held.pop(next(iter(self._held)))
        self._held[key] = found
        return found
