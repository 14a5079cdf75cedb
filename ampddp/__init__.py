"""ampddp: apex-style AMP opt levels and native torch.amp on PyTorch, for single and multi-GPU training.

Public names: ``amp`` (apex-compatible API), ``build_engine`` and the ``PrecisionEngine`` interface,
``resolve_policy``/``OPT_LEVELS``/``PrecisionPolicy``, ``LossScaler``, ``OpRegistry`` and the cast
decorators, and the error types.
"""

from ampddp import amp
from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision import (
    NATIVE_MODES,
    OPT_LEVELS,
    PRECISION_MODES,
    LossScaler,
    OpRegistry,
    PrecisionEngine,
    PrecisionPolicy,
    bfloat16_function,
    build_engine,
    float_function,
    half_function,
    promote_function,
    resolve_policy,
)

__version__ = "0.1.0"

__all__ = [
    "NATIVE_MODES",
    "OPT_LEVELS",
    "PRECISION_MODES",
    "AmpUsageError",
    "ConfigError",
    "LossScaler",
    "OpRegistry",
    "PrecisionEngine",
    "PrecisionPolicy",
    "__version__",
    "amp",
    "bfloat16_function",
    "build_engine",
    "float_function",
    "half_function",
    "promote_function",
    "resolve_policy",
]
