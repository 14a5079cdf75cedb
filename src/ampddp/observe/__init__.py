"""What a run shows: progress on rank 0 (``observer``), metrics.jsonl read back (``metrics_file``),
PNG plots (``plots``), the console's rank filter (``console``) and the loggers beside metrics.jsonl
(``loggers``: TensorBoard, CSV, Weights & Biases, MLflow). The step counters it shows are the loop's
(``ampddp.training.progress``; ``progress`` here is their old path).

The public names load on first use, so that the torch-free parts (``loggers``' names) import without
the observer's distributed imports.
"""

from __future__ import annotations

from ampddp import lazy_names

_HOMES = {
    "Reporting": "ampddp.observe.observer",
    "RunObserver": "ampddp.observe.observer",
    "TrackedRuns": "ampddp.observe.observer",
    "read_metrics": "ampddp.observe.metrics_file",
    "plot_metrics": "ampddp.observe.plots",
}

__all__ = ["Reporting", "RunObserver", "TrackedRuns", "plot_metrics", "read_metrics"]

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
