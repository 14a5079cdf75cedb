"""The precision engine: opt-level policies, loss scaling, master weights and op casting."""

import ampddp.torch_compat  # noqa: F401  (first: it refuses a torch older than ampddp supports)
from ampddp.choices import PRECISION_MODES
from ampddp.precision.choice import Precision
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.modes import MODES, NATIVE_MODES, OPT_LEVELS, ModeSpec, build_engine, mode_spec, resolve_policy
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.registry import OpRegistry, bfloat16_function, float_function, half_function, promote_function
from ampddp.precision.scaler import LossScaler
from ampddp.precision.state import STATE_VERSION, PrecisionState, ScalerState

__all__ = [
    "MODES",
    "NATIVE_MODES",
    "OPT_LEVELS",
    "PRECISION_MODES",
    "STATE_VERSION",
    "LossScaler",
    "ModeSpec",
    "OpRegistry",
    "Precision",
    "PrecisionEngine",
    "PrecisionPolicy",
    "PrecisionState",
    "ScalerState",
    "bfloat16_function",
    "build_engine",
    "float_function",
    "half_function",
    "mode_spec",
    "promote_function",
    "resolve_policy",
]
