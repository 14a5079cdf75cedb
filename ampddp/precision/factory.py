"""Pick the engine for a precision mode: the one place that maps a mode name to a class."""

from __future__ import annotations

from typing import Any

from ampddp.choices import IMPLS, PRECISION_MODES
from ampddp.errors import ConfigError, choice_error
from ampddp.precision.apex_backend import ApexEngine
from ampddp.precision.engine import NATIVE_MODES, PrecisionEngine
from ampddp.precision.native import NativeAmpEngine
from ampddp.precision.opt_level import OptLevelEngine
from ampddp.precision.policy import resolve_policy
from ampddp.precision.registry import OpRegistry


def build_engine(
    mode: str = "O1", impl: str = "builtin", registry: OpRegistry | None = None, allow_low_precision_models: bool = False, **overrides: Any
) -> PrecisionEngine:
    """Create the engine for ``mode`` (O0-O6, native-fp16, native-bf16).

    ``overrides`` are apex ``initialize`` keywords for O-levels, GradScaler settings for native modes.
    ``allow_low_precision_models``: the builtin O-level engine accepts models with fp16/bf16 params.
    """
    if mode not in PRECISION_MODES:
        raise choice_error("precision mode", mode, PRECISION_MODES)
    if impl not in IMPLS:
        raise choice_error("precision impl", impl, IMPLS)
    if mode in NATIVE_MODES:
        if impl != "builtin":
            raise choice_error(f"precision impl for {mode}", impl, ["builtin"])
        return NativeAmpEngine(NATIVE_MODES[mode], **overrides)
    if impl == "apex":
        if mode == "O6":
            raise ConfigError("opt level O6 is ampddp's own (fp8 matmuls through torchao): NVIDIA apex's amp has no O6; use impl builtin")
        return ApexEngine(mode, registry=registry, **overrides)
    return OptLevelEngine(resolve_policy(mode, **overrides), registry=registry, allow_low_precision_models=allow_low_precision_models)
