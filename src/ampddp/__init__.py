"""ampddp: apex-style AMP opt levels and native torch.amp on PyTorch, for single and multi-GPU training.

Public names: ``Trainer`` and ``prepare`` (the library's two doors) with the parts they take:
``Precision``, ``Parallel``, ``RunDir``, ``CheckpointSettings``, ``LoopSettings``, ``Reporting``; ``amp`` (the
apex-compatible API), ``build_engine`` and the ``PrecisionEngine`` interface,
``resolve_policy``/``OPT_LEVELS``/``PrecisionPolicy``, ``PrecisionState``, ``LossScaler``, ``OpRegistry`` and the cast
decorators, and the error types.

They load on first use: importing ``ampddp`` itself imports no torch, so that ``python -m ampddp``
can catch stop signals before its slow imports (see ``ampddp.preemption.EarlySignals``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PRECISION_NAMES = (
    "NATIVE_MODES", "OPT_LEVELS", "PRECISION_MODES", "LossScaler", "OpRegistry", "PrecisionEngine", "PrecisionPolicy", "PrecisionState",
    "bfloat16_function", "build_engine", "float_function", "half_function", "promote_function", "resolve_policy",
)  # fmt: skip
_HOMES = {
    "amp": "ampddp.amp", "AmpUsageError": "ampddp.errors", "ConfigError": "ampddp.errors",
    "Precision": "ampddp.precision.choice", "Parallel": "ampddp.distributed.parallel",
    "Trainer": "ampddp.trainer", "prepare": "ampddp.prepare", "Prepared": "ampddp.prepare",
    "CheckpointSettings": "ampddp.training.checkpoint_settings", "LoopSettings": "ampddp.training.settings",
    "Reporting": "ampddp.observe.observer", "RunDir": "ampddp.rundir.run_dir",
} | dict.fromkeys(_PRECISION_NAMES, "ampddp.precision")  # fmt: skip

_MODULES = ("amp", "prepare")
"""Names whose value is their module: the facade, and ``prepare`` (a module that calls as the function)."""

__all__ = [
    "NATIVE_MODES",
    "OPT_LEVELS",
    "PRECISION_MODES",
    "AmpUsageError",
    "CheckpointSettings",
    "ConfigError",
    "LoopSettings",
    "LossScaler",
    "OpRegistry",
    "Parallel",
    "Precision",
    "PrecisionEngine",
    "PrecisionPolicy",
    "PrecisionState",
    "Prepared",
    "Reporting",
    "RunDir",
    "Trainer",
    "__version__",
    "amp",
    "bfloat16_function",
    "build_engine",
    "float_function",
    "half_function",
    "prepare",
    "promote_function",
    "resolve_policy",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'ampddp' has no attribute {name!r}")
    module = importlib.import_module(_HOMES[name])
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
