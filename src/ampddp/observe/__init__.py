"""What a run shows: progress on rank 0 (``observer``), metrics.jsonl read back (``metrics_file``),
PNG plots (``plots``), the console's rank filter (``console``), the step counters (``progress``) and
the loggers beside metrics.jsonl (``loggers``: TensorBoard, CSV, Weights & Biases, MLflow).

The public names load on first use, so that the torch-free parts (``progress``, ``loggers``' names)
import without the observer's distributed imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Reporting": "ampddp.observe.observer",
    "RunObserver": "ampddp.observe.observer",
    "TrackedRuns": "ampddp.observe.observer",
    "read_metrics": "ampddp.observe.metrics_file",
    "plot_metrics": "ampddp.observe.plots",
}

__all__ = ["Reporting", "RunObserver", "TrackedRuns", "plot_metrics", "read_metrics"]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'ampddp.observe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
