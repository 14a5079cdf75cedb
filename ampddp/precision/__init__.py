"""The precision engine: opt-level policies, loss scaling, master weights and op casting."""

import ampddp.torch_compat  # noqa: F401  (first: it refuses a torch older than ampddp supports)
from ampddp.choices import PRECISION_MODES
from ampddp.precision.choice import Precision
from ampddp.precision.engine import NATIVE_MODES, PrecisionEngine
from ampddp.precision.factory import build_engine
from ampddp.precision.policy import OPT_LEVELS, PrecisionPolicy, resolve_policy
from ampddp.precision.registry import OpRegistry, bfloat16_function, float_function, half_function, promote_function
from ampddp.precision.scaler import LossScaler
from ampddp.precision.state import STATE_VERSION, PrecisionState, ScalerState

__all__ = [
    "NATIVE_MODES",
    "OPT_LEVELS",
    "PRECISION_MODES",
    "STATE_VERSION",
    "LossScaler",
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
    "promote_function",
    "resolve_policy",
]
