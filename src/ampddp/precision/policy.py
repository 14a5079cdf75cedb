"""An opt level as data: the frozen PrecisionPolicy, and each of its settings' checks.

The levels' rows (apex's O0-O3, the ROCm fork's bfloat16 O4/O5, ampddp's O6) are the mode table's
(``ampddp.precision.modes``), which also refuses what a level does not take; here each setting given
as an ``amp.initialize``-style keyword is parsed on its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampddp.choices import FP8_RECIPES
from ampddp.errors import ConfigError, closest
from ampddp.precision.dtypes import dtype_name, parse_float_dtype

DYNAMIC = "dynamic"


@dataclass(frozen=True)
class PrecisionPolicy:
    """Everything an opt level decides. Field names and meanings follow ``apex.amp.initialize``."""

    opt_level: str
    cast_model_type: torch.dtype | None
    """dtype the model's params/buffers are cast to (None: left as they are)."""
    patch_torch_functions: bool
    """Whether ops are cast per the O1/O4 op lists inside the forward context."""
    keep_batchnorm_fp32: bool | None
    """Keep affine BatchNorm modules in fp32 when the model is cast."""
    master_weights: bool | None
    """Keep fp32 master copies of low-precision params; the optimizer steps those."""
    loss_scale: float | str
    """A fixed scale, or "dynamic"."""
    op_cast_dtype: torch.dtype | None = None
    """Low-precision dtype of the op lists (float16 for O1, bfloat16 for O4)."""
    cast_model_outputs: torch.dtype | None = None
    num_losses: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    init_loss_scale: float | None = None
    """First dynamic scale; None means min(2**16, max_loss_scale) as in apex."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    """Overflows tolerated before the scale backs off (1: every overflow, as in apex)."""
    verbosity: int = 1
    enabled: bool = True
    sharded_param_dtype: torch.dtype | None = None
    """Under FSDP2 (O2/O5, see :meth:`for_sharded_params`): the dtype FSDP2 gives the params for
    compute; the fp32 shards the optimizer steps are the master weights."""
    fp8_recipe: str | None = None
    """O6: torchao's fp8 scaling recipe for the eligible linear layers (None: no fp8)."""
    fp8_filter: tuple[str, ...] | None = None
    """O6: name patterns of linear layers kept out of fp8; None: the first and the last one."""
    fp8_min_size: int | None = None
    """O6: the smallest dim a linear layer runs in fp8 with; None: where fp8 paid off on an H100."""
    fp8_all_gather: bool = False
    """O6 under FSDP2 with tensorwise scaling (see :meth:`for_sharded_params`): the fp8 layers'
    weights are cast to fp8 before FSDP2 all-gathers them (a quarter of fp32's traffic)."""

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == DYNAMIC

    @property
    def uses_master_weights(self) -> bool:
        return bool(self.master_weights)

    @property
    def first_loss_scale(self) -> float:
        """The scale a fresh scaler starts at."""
        if not self.dynamic_loss_scale:
            return float(self.loss_scale)
        if self.init_loss_scale is not None:
            return self.init_loss_scale
        return min(2.0**16, self.max_loss_scale)

    def for_sharded_params(self, fp32_islands: bool = True) -> PrecisionPolicy:
        """This level when FSDP2 holds the params (other levels are returned as they are).

        O2/O5 cast the model and step fp32 masters; under FSDP2 the sharded params stay fp32 (they
        are the masters) and FSDP2 hands them to the forward in the level's dtype. ``fp32_islands``:
        the ops on apex's fp32 lists (softmax, norms, losses, ...) still run in fp32, as in O1/O4 --
        what plain FSDP2 loses; False keeps apex's pure O2/O5 (every op in the low dtype). O6 with
        tensorwise scaling all-gathers its fp8 layers' weights in fp8.
        """
        # One scale per tensor is the same whether taken before or after the gather: the same math, less traffic.
        sharded = dataclasses.replace(self, fp8_all_gather=self.enabled and self.fp8_recipe == "tensorwise")
        if not (self.enabled and self.uses_master_weights and self.cast_model_type not in (None, torch.float32)):
            return sharded
        low = self.cast_model_type
        return dataclasses.replace(
            sharded, cast_model_type=None, keep_batchnorm_fp32=None, master_weights=None, sharded_param_dtype=low,
            patch_torch_functions=fp32_islands, op_cast_dtype=low if fp32_islands else None,
        )  # fmt: skip

    def summary(self) -> str:
        """One line saying what the level does (the log of a set-up; ``describe`` has every field)."""
        if not self.enabled:
            return f"{self.opt_level} disabled: fp32 throughout"
        parts = self._compute_parts()
        if not parts:
            parts.append("fp32 throughout")
        elif self.uses_master_weights:
            parts.append("fp32 master weights")
        elif self.sharded_param_dtype is None:  # sharded: the params are the masters, said above
            parts.append("fp32 weights" if self.cast_model_type in (None, torch.float32) else "no master weights")
        if self.dynamic_loss_scale:
            parts.append(f"dynamic loss scale from {self.first_loss_scale:g}")
        elif float(self.loss_scale) != 1.0:
            parts.append(f"static loss scale {float(self.loss_scale):g}")
        return f"{self.opt_level}: {', '.join(parts)}"

    def _compute_parts(self) -> list[str]:
        """What computes in low precision, in words: FSDP2's params, the model cast, apex's op lists, fp8."""
        parts = []
        if self.sharded_param_dtype is not None:
            islands = ", apex's fp32 ops in fp32" if self.patch_torch_functions else ", every op in it (no fp32 islands)"
            parts.append(f"FSDP2 {dtype_name(self.sharded_param_dtype)} params in compute{islands}, fp32 sharded masters")
        if self.cast_model_type not in (None, torch.float32):
            kept = " (BatchNorm fp32)" if self.keep_batchnorm_fp32 else ""
            parts.append(f"{dtype_name(self.cast_model_type)} model{kept}")
        if self.patch_torch_functions and self.op_cast_dtype is not None and self.sharded_param_dtype is None:
            parts.append(f"{dtype_name(self.op_cast_dtype)} ops per apex's lists")
        if self.fp8_recipe is not None:
            gathered = ", all-gathered in fp8" if self.fp8_all_gather else ""
            parts.append(f"fp8 matmuls ({self.fp8_recipe} scaling{gathered}) in the eligible linear layers")
        return parts

    def describe(self) -> dict[str, Any]:
        """Plain-data view (dtypes as strings) for logs, checkpoints and `inspect`."""
        out = dataclasses.asdict(self)
        for key in ("cast_model_type", "op_cast_dtype", "cast_model_outputs", "sharded_param_dtype"):
            out[key] = dtype_name(out[key])
        return out


FP8_SETTINGS = ("fp8_recipe", "fp8_filter", "fp8_min_size")


def _bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise ConfigError(f"{name}={value!r} is not valid; valid: True, False, 'True' or 'False'")


def _positive(name: str, value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number > 0:
            return number
    raise ConfigError(f"{name}={value!r} is not valid; it must be a finite number > 0")


def _growth(name: str, value: object) -> float:
    number = _positive(name, value)
    if number <= 1.0:
        raise ConfigError(f"{name}={value!r} is not valid; it must be > 1")
    return number


def _backoff(name: str, value: object) -> float:
    number = _positive(name, value)
    if number >= 1.0:
        raise ConfigError(f"{name}={value!r} is not valid; it must lie in (0, 1)")
    return number


def _count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    raise ConfigError(f"{name}={value!r} is not valid; it must be an integer >= {minimum}")


def _loss_scale(name: str, value: object) -> float | str:
    if value == DYNAMIC:
        return DYNAMIC
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(
                f"loss_scale={value!r} is not valid; valid: 'dynamic', or a number > 0 (as a float or a numeric string)"
            ) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ConfigError(f"loss_scale={value!r} is not valid; valid: 'dynamic', or a number > 0 (as a float or a numeric string)")


def _fp8_recipe(name: str, value: object) -> str:
    if isinstance(value, str) and value in FP8_RECIPES:
        return value
    raise ConfigError(f"{name}={value!r} is not valid{closest(str(value), FP8_RECIPES)}; valid: {', '.join(FP8_RECIPES)}")


def _patterns(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) and item for item in value):
        return tuple(value)
    raise ConfigError(f"{name}={value!r} is not valid; give a list of layer name patterns, e.g. ['head', 'blocks.*.mlp.*'], or [] for none")


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "cast_model_type": parse_float_dtype,
    "patch_torch_functions": _bool,
    "keep_batchnorm_fp32": _bool,
    "master_weights": _bool,
    "loss_scale": _loss_scale,
    "cast_model_outputs": parse_float_dtype,
    "num_losses": _count,
    "min_loss_scale": _positive,
    "max_loss_scale": _positive,
    "init_loss_scale": _positive,
    "growth_factor": _growth,
    "backoff_factor": _backoff,
    "growth_interval": _count,
    "hysteresis": _count,
    "verbosity": lambda name, value: _count(name, value, minimum=0),
    "enabled": _bool,
    "fp8_recipe": _fp8_recipe,
    "fp8_filter": _patterns,
    "fp8_min_size": _count,
}
OVERRIDE_KEYS = tuple(_PARSERS)


def parse_setting(key: str, value: Any) -> Any:
    """Validate one precision setting on its own (for engines that take a subset of them)."""
    return _PARSERS[key](key, value)


def parse_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The settings given (None: keep the level's default, as in ``apex.amp.initialize``), each
    checked on its own; what a level refuses is the mode table's to say (``ampddp.precision.modes``)."""
    unknown = [key for key in overrides if key not in _PARSERS]
    if unknown:
        key = unknown[0]
        raise ConfigError(f"unknown precision setting {key!r}{closest(key, OVERRIDE_KEYS)}; valid settings: {', '.join(OVERRIDE_KEYS)}")
    return {key: _PARSERS[key](key, value) for key, value in overrides.items() if value is not None}


def check_scale_bounds(policy: PrecisionPolicy) -> None:
    low, high = policy.min_loss_scale or 0.0, policy.max_loss_scale
    if low > high:
        raise ConfigError(f"min_loss_scale={policy.min_loss_scale} is larger than max_loss_scale={high}; min must be <= max")
    if policy.init_loss_scale is not None and not low <= policy.init_loss_scale <= high:
        raise ConfigError(f"init_loss_scale={policy.init_loss_scale} must lie between min_loss_scale={low} and max_loss_scale={high}")
