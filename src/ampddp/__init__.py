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
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

__version__ = "0.1.0"

_REGISTRY_NAMES = ("OpRegistry", "bfloat16_function", "float_function", "half_function", "promote_function")
_HOMES = {
    "amp": "ampddp.amp", "AmpUsageError": "ampddp.errors", "ConfigError": "ampddp.errors",
    "Precision": "ampddp.precision.choice", "Parallel": "ampddp.distributed.parallel",
    "Trainer": "ampddp.trainer", "prepare": "ampddp.prepare", "Prepared": "ampddp.prepare",
    "CheckpointSettings": "ampddp.training.checkpoint_settings", "LoopSettings": "ampddp.training.settings",
    "Reporting": "ampddp.observe.observer", "RunDir": "ampddp.rundir.run_dir",
    "NATIVE_MODES": "ampddp.precision.modes", "OPT_LEVELS": "ampddp.precision.modes", "PRECISION_MODES": "ampddp.choices",
    "build_engine": "ampddp.precision.modes", "resolve_policy": "ampddp.precision.modes", "LossScaler": "ampddp.precision.scaler",
    "PrecisionEngine": "ampddp.precision.engine", "PrecisionPolicy": "ampddp.precision.policy",
    "PrecisionState": "ampddp.precision.state",
} | dict.fromkeys(_REGISTRY_NAMES, "ampddp.precision.casting")  # fmt: skip

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


def lazy_names(
    package: str, homes: Mapping[str, str], modules: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) that import a public name's module when the
    name is first used, so that importing the package imports no torch: ``homes`` maps each name to its
    module; a name in ``modules`` is that module itself. For ampddp's packages (not a public name)."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(homes[name])
        value = module if name in modules else getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_names(__name__, _HOMES, _MODULES)
