"""Tensor parallelism: each layer's compute and weights split over the ranks of the mesh's ``tp`` dimension.

torch's DTensor engine does the splitting (``parallelize_module`` with column-, row- and sequence-wise
styles); what a run needs around it is here: the settings (``TPOptions``), and the plan that says which
layer splits how, from one of three places: the model's own (``model.tensor_parallel_plan(tp_size,
sequence_parallel)``, as ampddp's GPT carries), a table ``{module name pattern: colwise | rowwise |
sequence}`` (the pattern as ``parallelize_module`` reads it: dotted module names, ``*`` for one level),
or a function ``(model, tp_mesh) -> model`` that parallelizes it itself (torchtitan's ``apply_tp``,
Lightning's ``parallelize_fn``). A plan naming no module of the model, or leaving every weight whole,
is refused in one line: a run that believes it is split but is not only costs memory.

The ranks of one ``tp`` group read the same batch (``ParallelDims.data_shard``); the strategy applies the
plan before its own data parallelism (FSDP2 over the ``dp`` dimensions), and the precision engine agrees
its loss-scale verdict over every rank.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ampddp.choices import TP_STYLES
from ampddp.errors import ConfigError, choice_error, closest
from ampddp.torch_compat import is_dtensor

TensorPlan = Mapping[str, Any] | Callable[[nn.Module, Any], Any] | None
"""A plan: a table of module name patterns to styles (names or torch ``ParallelStyle`` objects), a function
``(model, tp_mesh)`` that parallelizes the model itself, or None (the model's own ``tensor_parallel_plan``)."""


@dataclass(frozen=True)
class TPOptions:
    """``size``: the ranks each layer is split over (the mesh's innermost dimension; 1: no tensor parallelism).
    ``plan``: see ``TensorPlan``. ``sequence_parallel``: between split layers, the activations are split by
    sequence position and the norms run on their slice (less activation memory; passed to a model's own plan)."""

    size: int = 1
    plan: TensorPlan = None
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"tp_size={self.size!r} is not valid; it must be an integer >= 1 (1: no tensor parallelism)")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"sequence_parallel={self.sequence_parallel!r} is not valid; it must be true or false")
        if self.plan is not None and not isinstance(self.plan, Mapping) and not callable(self.plan):
            raise ConfigError(f"tp_plan={self.plan!r} is not valid; give a table {{module name: {' | '.join(TP_STYLES)}}}, "
                              "a function (model, tp_mesh) that parallelizes the model, or null (the model's own plan)")  # fmt: skip
        if isinstance(self.plan, Mapping):
            object.__setattr__(self, "plan", dict(self.plan))
            for pattern, style in self.plan.items():
                if isinstance(style, str) and style not in TP_STYLES:
                    raise choice_error(f"tp_plan[{pattern!r}]", style, TP_STYLES)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def changed(self, where: str = "") -> list[str]:
        """The settings given other values than their defaults, as ``{where}tp_name=value``."""
        return [f"{where}tp_{f.name}={getattr(self, f.name)!r}".replace("tp_sequence_parallel", "sequence_parallel")
                for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]  # fmt: skip


def style_of(name: str) -> Any:
    """The torch ``ParallelStyle`` a plan's style name stands for (torch's defaults: inputs and outputs replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}[name]()


def check_table(model: nn.Module, table: Mapping[str, Any]) -> dict[str, Any]:
    """``table`` with style names made torch styles; a pattern matching no module of ``model`` is refused,
    naming the closest module name."""
    names = [name for name, _ in model.named_modules() if name]
    resolved = {}
    for pattern, style in table.items():
        if not any(_matches(name, pattern) for name in names):
            raise ConfigError(f"tp_plan names {pattern!r}, which matches no module of {type(model).__name__}{closest(pattern, names)}; "
                              "give dotted module names as model.named_modules() lists them ('*' for one level)")  # fmt: skip
        resolved[pattern] = style_of(style) if isinstance(style, str) else style
    return resolved


def _matches(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted))


def model_plan(model: nn.Module, options: TPOptions) -> dict[str, Any]:
    """The model's own plan (its ``tensor_parallel_plan``), or one line saying how to give one."""
    own = getattr(model, "tensor_parallel_plan", None)
    if not callable(own):
        raise ConfigError(f"{type(model).__name__} has no tensor-parallel plan: give distributed.tp_plan as a table {{module name: "
                          f"{' | '.join(TP_STYLES)}}} or a function (model, tp_mesh) that parallelizes it "
                          "(ampddp.zoo.models:gpt carries its own)")  # fmt: skip
    return own(options.size, options.sequence_parallel)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, options: TPOptions) -> nn.Module:
    """``model`` split over ``tp_mesh`` as ``options.plan`` says; refused when no weight was split."""
    from torch.distributed.tensor.parallel import parallelize_module

    if callable(options.plan) and not isinstance(options.plan, Mapping):
        returned = options.plan(model, tp_mesh)
        model = returned if isinstance(returned, nn.Module) else model
    else:
        table = check_table(model, options.plan) if options.plan is not None else model_plan(model, options)
        model = parallelize_module(model, tp_mesh, table)
    if not any(is_dtensor(param) for param in model.parameters()):
        raise ConfigError(f"the tensor-parallel plan split no weight of {type(model).__name__} over tp_size={options.size}; "
                          "name the layers to split (colwise for the first of a pair, rowwise for the second)")  # fmt: skip
    return model
