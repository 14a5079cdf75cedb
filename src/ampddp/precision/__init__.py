"""The precision engine: opt-level policies, loss scaling, master weights and op casting.

This ``__init__`` is the door the apex-compatible facade (``ampddp.amp``, ``ampddp.apex``) comes in
by, with ``ampddp.precision.casting`` for the op-casting mechanism: the modules behind it can change
without the facade (``tests/unit/test_import_layers.py`` holds that).
"""

import ampddp.torch_compat  # noqa: F401  (first: it refuses a torch older than ampddp supports)
from ampddp.choices import PRECISION_MODES
from ampddp.precision.apex_backend import ApexEngine
from ampddp.precision.choice import Precision
from ampddp.precision.compile_support import run_eagerly_as_own_frame
from ampddp.precision.engine import PrecisionEngine, check_loss, check_models_and_optimizers
from ampddp.precision.master import GradPhase, OptimizerGrads
from ampddp.precision.modes import MODES, NATIVE_MODES, OPT_LEVELS, ModeSpec, build_engine, check_opt_level, mode_spec, resolve_policy
from ampddp.precision.opt_level import OptLevelEngine
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.registry import (
    BFLOAT16,
    FP32,
    LOW,
    PROMOTE,
    OpRegistry,
    bfloat16_function,
    float_function,
    half_function,
    promote_function,
)
from ampddp.precision.scaler import LossScaler
from ampddp.precision.speed_warning import warn_if_slower_than_fp32
from ampddp.precision.state import STATE_VERSION, PrecisionState, ScalerState

__all__ = [
    "BFLOAT16",
    "FP32",
    "LOW",
    "MODES",
    "NATIVE_MODES",
    "OPT_LEVELS",
    "PRECISION_MODES",
    "PROMOTE",
    "STATE_VERSION",
    "ApexEngine",
    "GradPhase",
    "LossScaler",
    "ModeSpec",
    "OpRegistry",
    "OptLevelEngine",
    "OptimizerGrads",
    "Precision",
    "PrecisionEngine",
    "PrecisionPolicy",
    "PrecisionState",
    "ScalerState",
    "bfloat16_function",
    "build_engine",
    "check_loss",
    "check_models_and_optimizers",
    "check_opt_level",
    "float_function",
    "half_function",
    "mode_spec",
    "promote_function",
    "resolve_policy",
    "run_eagerly_as_own_frame",
    "warn_if_slower_than_fp32",
]
