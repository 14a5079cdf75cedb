"""Tensor parallelism: each layer's compute and weights split over the ranks of the mesh's ``tp`` dimension.

torch's DTensor engine does the splitting (``parallelize_module`` with column-, row- and sequence-wise
styles); what a run needs around it is here: the settings (``TPOptions``), and the plan that says which
layer splits how, from one of three places: the model's own (``model.tensor_parallel_plan(tp_size,
sequence_parallel)``, as ampddp's GPT carries), a table ``{module name pattern: colwise | rowwise |
sequence | vocab | replicate}`` (the pattern as ``parallelize_module`` reads it: dotted module names, ``*`` for one
level), or a function ``(model, tp_mesh) -> model`` that parallelizes it itself (torchtitan's ``apply_tp``,
Lightning's ``parallelize_fn``). A plan naming no module of the model, or leaving every weight whole,
is refused in one line: a run that believes it is split but is not only costs memory.

The ranks of one ``tp`` group read the same batch (``ParallelDims.data_shard``); the strategy applies the
plan before its own data parallelism (FSDP2 over the ``dp`` dimensions), and the precision engine agrees
its loss-scale verdict over every rank. With ``loss_parallel`` the output head's logits stay split by
vocabulary and the step's schedule runs the forwards and backwards inside torch's ``loss_parallel()``
(``LossParallel``): the cross-entropy is computed on each rank's vocabulary slice, so no rank gathers the
logits (batch x sequence x vocabulary, the largest activation of a language model).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampddp.choices import TP_STYLES
from ampddp.distributed.schedule import Backward, LossOf, Result, StepSchedule
from ampddp.errors import ConfigError, choice_error, closest
from ampddp.torch_compat import is_dtensor

TensorPlan = Mapping[str, Any] | Callable[[nn.Module, Any], Any] | None
"""A plan: a table of module name patterns to styles (names or torch ``ParallelStyle`` objects), a function
``(model, tp_mesh)`` that parallelizes the model itself, or None (the model's own ``tensor_parallel_plan``)."""


@dataclass(frozen=True)
class TPOptions:
    """``size``: the ranks each layer is split over (the mesh's innermost dimension; 1: no tensor parallelism).
    ``plan``: see ``TensorPlan``. ``sequence_parallel``: between split layers, the activations are split by
    sequence position and the norms run on their slice (less activation memory; passed to a model's own plan).
    ``loss_parallel``: the head's logits stay split by vocabulary and the cross-entropy is computed on each rank's
    slice (``LossParallel``); the plan must leave them split (the model's own plan is asked to; a table marks the
    head ``vocab``)."""

    size: int = 1
    plan: TensorPlan = None
    sequence_parallel: bool = True
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"tp_size={self.size!r} is not valid; it must be an integer >= 1 (1: no tensor parallelism)")
        for name in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid; it must be true or false")
        if self.plan is not None and not isinstance(self.plan, Mapping) and not callable(self.plan):
            raise ConfigError(f"tp_plan={self.plan!r} is not valid; give a table {{module name: {' | '.join(TP_STYLES)}}}, "
                              "a function (model, tp_mesh) that parallelizes the model, or null (the model's own plan)")  # fmt: skip
        if isinstance(self.plan, Mapping):
            object.__setattr__(self, "plan", dict(self.plan))
            for pattern, style in self.plan.items():
                if isinstance(style, str) and style not in TP_STYLES:
                    raise choice_error(f"tp_plan[{pattern!r}]", style, TP_STYLES)
            self._check_vocab_head(self.plan)

    def _check_vocab_head(self, table: Mapping[str, Any]) -> None:
        """A table's ``vocab`` head and ``loss_parallel`` go together: split logits need the split loss, and the split
        loss needs split logits."""
        heads = [pattern for pattern, style in table.items() if style == "vocab"]
        if heads and not self.loss_parallel:
            raise ConfigError(f"tp_plan marks {heads[0]!r} vocab, which leaves its logits split for the vocabulary-parallel "
                              "loss; set loss_parallel: true, or mark it colwise (whole logits)")  # fmt: skip
        if self.loss_parallel and not heads and all(isinstance(style, str) for style in table.values()):
            raise ConfigError("loss_parallel: true needs the logits split by vocabulary; mark the output head vocab in "
                              "tp_plan (e.g. {head: vocab}), or set loss_parallel: false")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def changed(self, where: str = "") -> list[str]:
        """The settings given other values than their defaults, as ``{where}tp_name=value``."""
        return [f"{where}{f.name if f.name.endswith('_parallel') else 'tp_' + f.name}={getattr(self, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]  # fmt: skip


def style_of(name: str) -> Any:
    """The torch ``ParallelStyle`` a plan's style name stands for (torch's defaults: inputs and outputs replicated;
    ``vocab``: a column split whose output stays a DTensor split on its last dimension)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "vocab":
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if name == "replicate":
        return replicate_style()
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}[name]()


def replicate_style() -> Any:
    """A module kept whole on every rank of the ``tp`` dimension, its parameters replicated DTensors on that mesh (so the
    model's parameters live on one mesh, as the checkpoint and the gradient norm see them); its inputs and outputs stay
    plain tensors (torch has no style for it)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def inputs(module: nn.Module, args: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(arg, mesh, [Replicate()], run_check=False) if torch.is_tensor(arg) and not is_dtensor(arg)
                     else arg for arg in args)  # fmt: skip

    def outputs(module: nn.Module, output: Any, mesh: Any) -> Any:
        return output.to_local() if is_dtensor(output) else output

    class ReplicateParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            return distribute_module(module, device_mesh, None, input_fn=inputs, output_fn=outputs)

    return ReplicateParallel()


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
    if not options.loss_parallel:
        return own(options.size, options.sequence_parallel)
    if "loss_parallel" not in inspect.signature(own).parameters:
        raise ConfigError(f"{type(model).__name__}.tensor_parallel_plan takes no loss_parallel argument, so its logits are "
                          "not split for the vocabulary-parallel loss; set loss_parallel: false, or give a tp_plan marking "
                          "the head vocab")  # fmt: skip
    return own(options.size, options.sequence_parallel, loss_parallel=True)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, options: TPOptions) -> nn.Module:
    """``model`` split over ``tp_mesh`` as ``options.plan`` says; refused when no weight was split."""
    from torch.distributed.tensor.parallel import parallelize_module

    if callable(options.plan) and not isinstance(options.plan, Mapping):
        returned = options.plan(model, tp_mesh)
        model = returned if isinstance(returned, nn.Module) else model
    else:
        table = check_table(model, options.plan) if options.plan is not None else model_plan(model, options)
        model = parallelize_module(model, tp_mesh, fp8_styles(model, table))
    if not any(is_dtensor(param) for param in model.parameters()):
        raise ConfigError(f"the tensor-parallel plan split no weight of {type(model).__name__} over tp_size={options.size}; "
                          "name the layers to split (colwise for the first of a pair, rowwise for the second)")  # fmt: skip
    return model


def fp8_styles(model: nn.Module, table: Mapping[str, Any]) -> dict[str, Any]:
    """``table`` with each plain column or row split of O6's tensorwise fp8 layers made torchao's fp8 style of it: the
    activations cast to fp8 before they are exchanged (a quarter of fp32's bytes), as torchao documents for tensorwise
    scaling; rowwise-scaled layers keep torch's plain styles (their inputs exchanged in high precision)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ampddp.torch_compat import casts_before_gathers

    styles = dict(table)
    modules = [(name, module) for name, module in model.named_modules() if name]
    for pattern, style in table.items():
        if type(style) not in (ColwiseParallel, RowwiseParallel):
            continue
        matched = [module for name, module in modules if _matches(name, pattern)]
        if matched and all(casts_before_gathers(module) for module in matched):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            fp8_style = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            styles[pattern] = fp8_style(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                        use_local_output=style.use_local_output)  # fmt: skip
    return styles


class LossParallel:
    """A schedule running ``inner``'s forwards and backwards inside torch's ``loss_parallel()``, where the
    cross-entropy of vocabulary-split logits is computed on each rank's slice (and its backward too: the context
    must hold over both). The loop sees plain tensors: each micro-batch's loss (a replicated DTensor) as its
    value, differentiably, and a whole-model forward's outputs whole, so evaluation's metrics and the
    diagnosis of a non-finite step read the logits as without tensor parallelism."""

    def __init__(self, inner: StepSchedule) -> None:
        self.inner = inner

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        def plain_loss_of(index: int, batch: Any) -> tuple[torch.Tensor, int]:
            loss, count = loss_of(index, batch)
            return whole(loss), count

        with loss_parallel():
            return self.inner.forward_backward(window, plain_loss_of, backward)

    def forward(self, run: Callable[[], Result]) -> Result:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return whole(self.inner.forward(run))

    def loss_copies(self, ranks_per_data_rank: int) -> int:
        return self.inner.loss_copies(ranks_per_data_rank)


def whole(value: Any) -> Any:
    """``value`` with every DTensor in it (a tensor, or inside dicts, lists, tuples and model outputs) made the
    whole tensor it stands for, on every rank (``full_tensor``: differentiable, free for a replicated one)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(DTensor, lambda tensor: tensor.full_tensor(), value)
