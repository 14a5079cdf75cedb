"""O6's fp8 matmuls: the eligible ``nn.Linear`` layers become torchao's ``Float8Linear``.

Everything else about O6 is O4 (fp32 weights, bf16 op lists, no loss scale); the converted layers
keep their ``weight`` and ``bias`` parameters (the same objects: an optimizer built before still
steps them) and their ``state_dict`` keys, so a checkpoint moves between O4 and O6 unchanged and
loads into a model without torchao. Which layers convert is decided here, with a reason for each
one that does not: the table a user needs to know what fp8 is doing to their model.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampddp.choices import FP8_RECIPES
from ampddp.errors import ConfigError
from ampddp.precision.hardware import emulates_fp8

logger = logging.getLogger("ampddp.precision")

FP8_EXTRA = "pip install 'ampddp[fp8]'"


def torchao_float8() -> Any:
    """torchao's float8 training module, or a one-line error naming the extra that installs it."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ConfigError(f"opt level O6 runs its matmuls in fp8 through torchao, which is not installed ({error}): {FP8_EXTRA}") from None
    return float8


@dataclass(frozen=True)
class LinearVerdict:
    """One linear layer of the model: whether it runs in fp8 and, when not, why."""

    name: str
    out_features: int
    in_features: int
    fp8: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": [self.out_features, self.in_features], "fp8": self.fp8, "reason": self.reason}


def _pays_off(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a matmul of this size ran faster in fp8 than in bf16 in torchao's H100 measurements
    (torchao/float8/README.md): smaller ones lose more to the casts than the fp8 matmul gains."""
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    return out_features > 2048 and in_features > 1024 and not (out_features <= 4096 and in_features <= 2048)


def plan_fp8(model: nn.Module, recipe: str, skip: tuple[str, ...] | None, min_size: int | None) -> list[LinearVerdict]:
    """Every ``nn.Linear`` of ``model`` with its verdict, in module order.

    Layers are named inside the wrappers (:func:`unwrapped`). ``skip`` (precision.fp8_filter): name
    patterns (``fnmatch``, e.g. ``head`` or ``blocks.*.mlp.*``) of layers kept in bf16; None keeps
    the first and the last linear layer (the input projection and the output head, whose precision
    matters most). ``min_size``: both dims at least this; None: the sizes where fp8 paid off for
    ``recipe`` on an H100. Dims must be multiples of 16 (fp8 matmul kernels need them).
    """
    float8 = torchao_float8()
    model = unwrapped(model)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    rules = _Fp8Rules(recipe, skip, min_size, {linears[0][0], linears[-1][0]} if skip is None and linears else set())
    verdicts = []
    for index, (name, module) in enumerate(linears):
        out_features, in_features = module.weight.shape
        if isinstance(module, float8.float8_linear.Float8Linear):
            fp8, reason = True, "fp8 (converted before)"
        else:
            reason = _not_convertible(module, model) or rules.kept_in_bf16(name, index, module)
            fp8, reason = not reason, reason or "fp8"
        verdicts.append(LinearVerdict(name or "(the model)", out_features, in_features, fp8, reason))
    return verdicts


def _not_convertible(module: nn.Linear, model: nn.Module) -> str:
    """Why Float8Linear could not stand in for ``module`` without changing what it computes (empty: it can)."""
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__} (a subclass of nn.Linear: its forward may not be Linear's)"
    if module is model:
        return "the model itself (a conversion replaces a layer inside a model: wrap it, e.g. in nn.Sequential)"
    altered = _alterations(module)
    return f"has {altered}, which fp8's Float8Linear would not carry over" if altered else ""


@dataclass(frozen=True)
class _Fp8Rules:
    """The settings that keep convertible layers in bf16: the filter (or the first and last layers),
    the fp8 kernels' dims, and the sizes where fp8 pays off."""

    recipe: str
    skip: tuple[str, ...] | None
    min_size: int | None
    ends: set[str]

    def kept_in_bf16(self, name: str, index: int, module: nn.Linear) -> str:
        out_features, in_features = module.weight.shape
        matched = next((pattern for pattern in self.skip or () if fnmatch.fnmatchcase(name, pattern)), None)
        if matched is not None:
            return f"matches precision.fp8_filter {matched!r}"
        if name in self.ends:
            return f"the {'first' if index == 0 else 'last'} linear layer (kept bf16 unless precision.fp8_filter is set)"
        if in_features % 16 or out_features % 16:
            return "dims not multiples of 16 (fp8 matmuls need them)"
        if self.min_size is not None:
            return f"a dim below precision.fp8_min_size={self.min_size}" if min(in_features, out_features) < self.min_size else ""
        if not _pays_off(self.recipe, out_features, in_features):
            return f"too small for fp8 to pay off with {self.recipe} scaling (precision.fp8_min_size overrides)"
        return ""


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP, DataParallel and ``torch.compile``'s wrappers: its layers named as the
    user wrote them (``blocks.0.mlp``, not ``module._orig_mod.blocks.0.mlp``), so filters match."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _alterations(module: nn.Linear) -> str:
    """What a Linear holds beyond its weight and bias (extra params or buffers, submodules, hooks, a
    parametrized weight), in words; empty when it is a plain one that converts without loss."""
    found = []
    extra = [name for name, _ in module.named_parameters(recurse=False) if name not in ("weight", "bias")]
    extra += [name for name, _ in module.named_buffers(recurse=False)]
    if extra or type(module.weight) is not nn.Parameter:
        found.append(f"own tensors ({', '.join(extra) or 'a parametrized weight'})")
    if any(True for _ in module.children()):
        found.append("submodules")
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
             "_load_state_dict_pre_hooks", "_state_dict_pre_hooks", "_load_state_dict_post_hooks")  # fmt: skip
    if any(getattr(module, name, None) for name in hooks):
        found.append("hooks")
    return " and ".join(found)


def float8_config(recipe: str, device: torch.device, all_gather: bool = False) -> Any:
    """torchao's configuration for ``recipe``; emulated on a GPU without fp8 matmuls and on a CPU without torch's
    fp8 matmul (``hardware.emulates_fp8``; torch's own serves the others). ``all_gather``: FSDP2 will shard the
    layers and gather their weights in fp8 (tensorwise only; under DDP such weights would not train)."""
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"fp8_recipe={recipe!r} is not valid; valid: {', '.join(FP8_RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise ConfigError(f"fp8 all-gather needs one scale per tensor: fp8_recipe tensorwise, not {recipe}")
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = replace(config, enable_fsdp_float8_all_gather=True)
    if device.type == "cuda":  # GPU fp8 matmuls need every inner dim a multiple of 16, the tokens of a batch too
        config = replace(config, pad_inner_dim=True)
    return replace(config, emulate=True) if emulates_fp8(device) else config


def convert_to_fp8(model: nn.Module, verdicts: list[LinearVerdict], config: Any) -> int:
    """Swap the linear layers ``verdicts`` marks fp8 for ``Float8Linear`` in place; returns how many were swapped."""
    float8 = torchao_float8()
    model = unwrapped(model)
    swapped = 0
    for verdict in verdicts:
        if not verdict.fp8:
            continue
        module = model.get_submodule(verdict.name)
        if isinstance(module, float8.float8_linear.Float8Linear):
            continue
        parent_name, _, child = verdict.name.rpartition(".")
        converted = float8.float8_linear.Float8Linear.from_float(module, config=config)
        converted.train(module.training)
        setattr(model.get_submodule(parent_name), child, converted)
        swapped += 1
    return swapped


class EagerFp8Warning:
    """Warns once when an fp8 layer computes on a GPU outside ``torch.compile``: torchao's casts then
    run as separate kernels and the step is slower than bf16. The check sits in the layers' forward,
    so it holds however the model is compiled (the Trainer's ``compile``, ``torch.compile(model)``,
    per-block under FSDP2) or not; traced inside a compiled graph it is nothing. One instance watches
    every model of a set-up; after warning it stays in place (removing hooks would make compiled
    graphs that contain the layers recompile)."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.devices = devices
        self.warned = False

    def install(self, model: nn.Module) -> list[RemovableHandle]:
        """Watch the fp8 layers of ``model``; the handles remove the watch."""
        named = [(name, m) for name, m in unwrapped(model).named_modules() if _is_float8(m)]
        return [layer.register_forward_pre_hook(functools.partial(self._check, name)) for name, layer in named]

    def _check(self, name: str, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self.warned:
            return
        computes_on = next((arg.device.type for arg in args if isinstance(arg, torch.Tensor)), None)
        if computes_on not in self.devices:
            return
        self.warned = True
        logger.warning(
            "O6: fp8 layer %s runs without torch.compile on the GPU: torchao's fp8 casts then run as separate kernels and the step "
            "is slower than bf16; compile the model for fp8's speed (trainer.compile: true, Trainer(compile=True), torch.compile). "
            "Under FSDP2 the Trainer compiles block by block: an fp8 layer outside the blocks stays eager (keep it out of fp8 "
            "with precision.fp8_filter)",
            name,
        )


def _is_float8(module: nn.Module) -> bool:
    """torchao's Float8Linear, told without importing torchao."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao")


def refresh_fp8_scales(model: nn.Module, args: Any = ()) -> None:
    """The scales of the fp8 weights FSDP2 gathers in fp8, taken from the current weights in one
    all-reduce for the whole model (instead of one per layer inside each gather): a forward
    pre-hook of the root, so a scale never outlives the weights it was taken from (an optimizer
    step, a checkpoint load, a user's edit). Where FSDP2 replaces the shards' wrappers before the
    gather (CPU offload copies them to the GPU; the first forward of uneven shards), torchao takes
    each weight's scale in its own gather instead: the same values."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def gathers_fp8(model: nn.Module) -> bool:
    """Whether FSDP2 gathers some of ``model``'s weights in fp8 (tensorwise fp8 layers it shards)."""
    from torch.distributed.tensor import DTensor

    wrapper = torchao_float8().fsdp_utils.WeightWithDynamicFloat8CastTensor
    return any(_is_float8(m) and isinstance(m.weight, DTensor) and isinstance(m.weight._local_tensor, wrapper) for m in model.modules())


def fp8_layer_in(model: nn.Module) -> str | None:
    """The name of a layer an O6 set-up made fp8 in ``model`` (torchao's Float8Linear), or None:
    found without importing torchao."""
    found = (name for name, m in model.named_modules() if _is_float8(m))
    return next(found, None)


def verdict_table(verdicts: list[LinearVerdict]) -> str:
    """The verdicts as aligned lines: name, shape, fp8 or why not."""
    width = max((len(v.name) for v in verdicts), default=0)
    return "\n".join(f"  {v.name:<{width}}  {v.out_features}x{v.in_features}  {v.reason}" for v in verdicts)


def report_plan(verdicts: list[LinearVerdict], recipe: str) -> None:
    """Log which layers run in fp8 (a device without fp8 hardware says so with the set-up's
    slower-than-fp32 line: ``ampddp.precision.hardware``)."""
    count = sum(v.fp8 for v in verdicts)
    logger.info("O6: %d of %d linear layer(s) in fp8 (%s scaling):\n%s", count, len(verdicts), recipe, verdict_table(verdicts))
    if count == 0:
        logger.warning("O6: no linear layer qualifies for fp8, so this run is O4; see the table above for why")
