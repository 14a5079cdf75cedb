"""Pipeline parallelism: different layers on different processes, each a *stage*, micro-batches flowing through them.

torch's engine (``torch.distributed.pipelining``: ``PipelineStage`` and its schedules) sends the activations between
the stages and runs each micro-batch's forward and backward in the schedule's order. What a run needs around it is
here: the settings (``PPOptions``), the split of a model into its stage (the model's own ``pipeline_stage(stage,
stages)``, as ampddp's GPT carries, or a function of the user's), and the step's schedule part (``PipelineSchedule``)
that the training loop asks for a window's gradients: the loop's batches are cut into micro-batches here, the first
stage reads their inputs, the last stage scores its outputs with the loop's own loss (weighted by each micro-batch's
share of the global batch, scaled by the precision engine) and every stage's backward is the schedule's. The loss
scale's verdict is agreed over every rank before any stage steps (the strategy sets the engine up so). A stage on a
rank and what the stages send each other outside torch's schedules: ``ampddp.distributed.pipeline_stages``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampddp.choices import PP_SCHEDULES
from ampddp.distributed.pipeline_stages import Feed, ModelInputs, PipelineModel, PipelineParts, StagesInTurn
from ampddp.distributed.schedule import Backward, LossOf, Result
from ampddp.errors import ConfigError, choice_error, closest
from ampddp.torch_compat import graphs_kept_between_backwards, zbv_schedule_problem

logger = logging.getLogger("ampddp.distributed")

StageSplit = Callable[[nn.Module, int, int], nn.Module] | Sequence[Sequence[str]] | None
"""How a model becomes one stage: a function ``(model, stage, stages) -> the stage's module`` (keeping the whole model's
parameter names); the module names each stage holds, one list per stage (torchtitan's ``module_fqns_per_model_part``:
every other stage's modules are removed, for a model written so, its layers in an ``nn.ModuleDict`` and its forward
skipping a module that is None); or None: the model's own ``pipeline_stage(stage, stages)``."""

SCHEDULE_CLASSES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
"""The schedules that run one stage per rank, by their recipe names (torch's classes)."""
LOOPED_CLASSES = {"Interleaved1F1B": "ScheduleInterleaved1F1B", "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
                  "ZBVZeroBubble": "ScheduleZBVZeroBubble"}  # fmt: skip
"""The schedules that run several stages per rank (looped: rank r holds stages r, r + p, ...; ZBV: r and 2p - 1 - r)."""


@dataclass(frozen=True)
class PPOptions:
    """``size``: the stages (one per rank of the mesh's outermost ``pp`` dimension; 1: no pipeline). ``schedule``: the
    order micro-batches go through the stages (``PP_SCHEDULES``). ``microbatches``: how many each batch is cut into
    (None: as many as stages; fewer leaves stages idle). ``split``: see ``StageSplit``."""

    size: int = 1
    schedule: str = "1F1B"
    microbatches: int | None = None
    split: StageSplit = None
    stages_per_rank: int | None = None
    """The stages each rank holds: 1 for GPipe and 1F1B; 2 by default for the looped schedules (ZBVZeroBubble: exactly 2)."""

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"pp_size={self.size!r} is not valid; it must be an integer >= 1 (1: no pipeline parallelism)")
        if self.schedule not in PP_SCHEDULES:
            raise choice_error("pp_schedule", self.schedule, PP_SCHEDULES)
        self._check_stages_per_rank()
        if self.schedule == "ZBVZeroBubble" and zbv_schedule_problem() is not None:
            raise ConfigError(zbv_schedule_problem())
        self._check_microbatches()
        self._check_split()

    def _check_stages_per_rank(self) -> None:
        given, looped = self.stages_per_rank, self.schedule in LOOPED_CLASSES
        if given is None:
            return
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise ConfigError(f"pp_stages_per_rank={given!r} is not valid; it must be an integer >= 1, or null (the schedule's own)")
        if not looped and given != 1:
            raise ConfigError(f"pp_stages_per_rank={given} with pp_schedule={self.schedule}, which runs one stage per rank; use "
                              f"{', '.join(LOOPED_CLASSES)} for several")  # fmt: skip
        if (looped and given < 2) or (self.schedule == "ZBVZeroBubble" and given != 2):
            needs = "exactly 2" if self.schedule == "ZBVZeroBubble" else "at least 2"
            raise ConfigError(f"pp_stages_per_rank={given} with pp_schedule={self.schedule}, which runs {needs} stages per rank; "
                              "give 2 or null, or use GPipe or 1F1B for one")  # fmt: skip

    @property
    def per_rank(self) -> int:
        """The stages each rank holds."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule in LOOPED_CLASSES else 1

    @property
    def stages(self) -> int:
        """The stages the model is cut into: ``size`` ranks holding ``per_rank`` each."""
        return self.size * self.per_rank

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` holds, in the model's order (torch's placement for the schedule)."""
        if self.schedule == "ZBVZeroBubble":
            return (rank, 2 * self.size - 1 - rank)
        return tuple(rank + self.size * loop for loop in range(self.per_rank))

    def holders(self) -> tuple[int, ...]:
        """The pipeline rank holding each stage, in the model's order (``stages_of`` turned around)."""
        return tuple(next(rank for rank in range(self.size) if index in self.stages_of(rank)) for index in range(self.stages))

    def schedule_fits(self, micro_batches: int) -> bool:
        """Whether torch's schedule takes ``micro_batches`` (at least one per rank; the interleaved ones, a whole number of
        rounds of ``size``); otherwise they go through the stages one by one."""
        if micro_batches < self.size:
            return False
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
            return micro_batches % max(1, micro_batches // self.size) == 0
        return True

    def _check_microbatches(self) -> None:
        micro = self.microbatches
        if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
            raise ConfigError(f"pp_microbatches={micro!r} is not valid; it must be an integer >= 1, or null (as many as stages)")
        if micro is not None and micro < self.size:
            logger.warning("pp_microbatches=%d < pp_size=%d: each micro-batch goes through the stages in turn, every stage idle "
                           "while the others work; give at least pp_size", micro, self.size)  # fmt: skip
        elif micro is not None and not self.schedule_fits(micro):
            raise ConfigError(f"pp_microbatches={micro} with pp_schedule={self.schedule} on pp_size={self.size}: torch's interleaved "
                              f"schedules take whole rounds of micro-batches ({micro} // {self.size} rounds must divide {micro}); "
                              f"give a multiple of {self.size}")  # fmt: skip

    def _check_split(self) -> None:
        split = self.split
        if isinstance(split, Sequence) and not isinstance(split, str):
            if len(split) != self.stages or not all(_names(names) for names in split):
                raise ConfigError(f"pp_split={split!r} is not valid; give {self.stages} lists of module names, one per stage "
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
    """``model`` cut down to its stage ``stage`` of ``options.stages``: by ``options.split``, else by the model's own
    ``pipeline_stage``; a model with neither is refused in one line."""
    if isinstance(options.split, tuple):
        return keep_modules(model, options.split, stage)
    if options.split is not None:
        part = options.split(model, stage, options.stages)
        if not isinstance(part, nn.Module):
            raise ConfigError(f"pp_split returned a {type(part).__name__} for stage {stage}; it must return the stage's nn.Module")
        return part
    own = getattr(model, "pipeline_stage", None)
    if not callable(own):
        raise ConfigError(f"{type(model).__name__} has no pipeline split: give distributed.pp_split as a function (model, stage, "
                          "stages) that returns the stage's module (ampddp.zoo.models:gpt splits its blocks by itself)")  # fmt: skip
    return own(stage, options.stages)


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


def united(stages: Sequence[nn.Module]) -> nn.Module:
    """One module holding the modules, parameters and buffers of ``stages`` (cut from copies of one model) under the
    whole model's names: what a rank holding several stages trains, checkpoints and steps (its optimizer, its precision
    engine's masters), sharing their tensors. Its containers are copies (the stages' own are left as they are), so its
    forward is not the stages': each runs its own."""
    whole = _container_copy(stages[0])
    for stage in stages[1:]:
        _graft(whole, stage)
    return whole


def _container_copy(module: nn.Module) -> nn.Module:
    """``module`` copied with tables of its own (its hooks shared), made without its class's constructor: FSDP2's module
    classes run it from ``__new__``."""
    copied = object.__new__(type(module))
    copied.__dict__.update(module.__dict__)
    copied._modules, copied._parameters, copied._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return copied


def _graft(into: nn.Module, part: nn.Module, prefix: str = "") -> None:
    """``part``'s modules, parameters and buffers added to ``into`` where it has none under that name; a parameter both hold
    apart is refused (two stages would train it apart); of a buffer both hold (a constant each stage keeps), the first."""
    for table in ("_parameters", "_buffers"):
        mine = getattr(into, table)
        for name, value in getattr(part, table).items():
            if value is not None and mine.get(name) is None:
                mine[name] = value
            elif value is not None and mine[name] is not value and table == "_parameters":
                raise ConfigError(f"two pipeline stages of one rank both hold {prefix}{name}; a split must give each parameter and "
                                  "buffer to one stage")  # fmt: skip
    for name, child in part._modules.items():
        held = into._modules.get(name)
        if child is None or held is child:
            continue
        if held is None:
            into._modules[name] = child
        else:
            into._modules[name] = _container_copy(held)
            _graft(into._modules[name], child, f"{prefix}{name}.")


def tied_names(model: nn.Module) -> list[set[str]]:
    """The names of each parameter ``model`` holds under several names (tied weights: an embedding shared with a head)."""
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return [found for found in names.values() if len(found) > 1]


def refuse_ties_across_stages(tied: list[set[str]], held: dict[int, nn.Module], env: Any) -> None:
    """Refuse, on every rank at once (the stages' names gathered), weights tied across stages (``held``: this rank's, by
    index): each stage would train its own copy and they would part."""
    from ampddp.distributed.data import gather_objects

    tied_anywhere = set().union(*tied) if tied else set()
    mine = [(index, sorted({name for name, _ in stage.named_parameters(remove_duplicate=False)} & tied_anywhere))
            for index, stage in held.items()]  # fmt: skip
    where = {at: names for every in gather_objects(mine, env) for at, names in every} if tied else {}
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
    last) is cut into as many equal micro-batches as divide it, and a count torch's schedule does not take (fewer than
    the pipeline's ranks, asked for or an odd batch's; for an interleaved schedule, not whole rounds) goes through the
    stages in turn, one by one (``StagesInTurn``)."""

    def __init__(self, parts: PipelineParts, model: PipelineModel, options: PPOptions) -> None:
        self.parts, self.model, self.options = parts, model, options
        self._scores: Callable[[int, Any], torch.Tensor] | None = None
        self._schedules = ShapeCache()

    def loss_copies(self, ranks_per_data_rank: int) -> int:
        """How many ranks of one data coordinate hold its loss: the last stage's."""
        return max(ranks_per_data_rank // self.parts.ranks, 1)

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
            looped = self.options.schedule in LOOPED_CLASSES
            kind = getattr(schedules, LOOPED_CLASSES[self.options.schedule] if looped else SCHEDULE_CLASSES[self.options.schedule])
            stages = self.parts.torch_stages()
            return kind(stages if looped else stages[0], len(micro), loss_fn=self._loss, scale_grads=False)

        return self._schedules.get((len(micro), shapes_of(micro[0])), make)

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        """The window's gradients (compiled blocks met here under a zero-bubble schedule: compiled for its split backward)."""
        split = "ZeroBubble" in self.options.schedule
        with graphs_kept_between_backwards() if split else contextlib.nullcontext():
            return self._forward_backward(window, loss_of, backward)

    def _forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
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
            if not self.options.schedule_fits(len(micro)):  # fewer than ranks (asked for, or an odd batch's): one by one
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
            with parts.feeding(feed):
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
