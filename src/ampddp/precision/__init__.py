"""The precision engine: opt-level policies, loss scaling, master weights and op casting.

This ``__init__`` is the door the apex-compatible facade (``ampddp.amp``, ``ampddp.apex``) comes in
by, with ``ampddp.precision.casting`` for the op-casting mechanism and the registered functions: the
modules behind it can change without the facade (``tests/unit/test_import_layers.py`` holds that).
It names what the facade needs and nothing more: the rest of the package imports a name from its
module, and users take the public ones from ``ampddp`` (``ampddp.build_engine``, ``ampddp.Precision``).
"""

import ampddp.torch_compat  # noqa: F401  (first: it refuses a torch older than ampddp supports)
from ampddp.precision.apex_backend import ApexEngine
from ampddp.precision.compile_support import run_eagerly_as_own_frame
from ampddp.precision.engine import PrecisionEngine, check_loss, check_models_and_optimizers
from ampddp.precision.host_heap import settle_host_heap
from ampddp.precision.master import GradPhase, OptimizerGrads
from ampddp.precision.modes import MODES, build_engine, check_opt_level, resolve_policy
from ampddp.precision.opt_level import OptLevelEngine
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.scaler import LossScaler
from ampddp.precision.speed_warning import warn_if_slower_than_fp32
from ampddp.precision.state import PrecisionState
from ampddp.precision.verdict import group_for_sharded

__all__ = [
    "MODES",
    "ApexEngine",
    "GradPhase",
    "LossScaler",
    "OptLevelEngine",
    "OptimizerGrads",
    "PrecisionEngine",
    "PrecisionPolicy",
    "PrecisionState",
    "build_engine",
    "check_loss",
    "check_models_and_optimizers",
    "check_opt_level",
    "group_for_sharded",
    "resolve_policy",
    "run_eagerly_as_own_frame",
    "settle_host_heap",
    "warn_if_slower_than_fp32",
]
