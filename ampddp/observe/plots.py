"""The run's PNG plots from metrics.jsonl: training loss, each evaluation metric, the loss scale."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from ampddp.observe.metrics_file import read_metrics
from ampddp.rundir.files import replace_file, run_file_errors

PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'ampddp[plots]')"
logger = logging.getLogger("ampddp.observe")


EVAL_FIELDS = ("kind", "step", "epoch", "loss", "samples")
"""Fields of an eval record that are not a metric to plot (the eval loss is in the summary)."""


def plot_metrics(run_dir: str | Path) -> list[Path]:
    """loss.png, eval_<metric>.png per evaluation metric (eval_accuracy.png by default) and
    loss_scale.png (skipped steps marked) from metrics.jsonl; loss_scale.png only when the scale
    changed or a step was skipped (a bf16 or O0 run's would be a flat line at 1).

    Figures are made with matplotlib's object API, not pyplot: no backend is chosen for the whole
    process (a user's interactive backend stays) and no figure is left registered anywhere.
    matplotlib is an optional extra (``ampddp[plots]``) that keeps the core install lean: without
    it this logs one warning saying how to install it and returns no paths, so a run still ends
    with its metrics and summary written.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning(PLOTS_SKIPPED)
        return []
    outputs = []
    for name, rows, key, title in _figures(read_metrics(run_dir)):
        path = Path(run_dir) / name
        with run_file_errors(path):
            replace_file(path, _drawn(Figure(figsize=(6, 3.5)), rows, key, title))
        outputs.append(path)
    return outputs


def _figures(records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]], str, str]]:
    """(file name, the records it plots, the field on the y axis, its title) for each plot of a run."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    scale_varies = len({r.get("loss_scale") for r in train}) > 1 or any(r.get("skipped") for r in train)
    return [
        ("loss.png", train, "loss", "training loss"),
        *((f"eval_{key}.png", [r for r in evals if key in r], key, f"held-out {key}") for key in _eval_metrics(evals)),
        *([("loss_scale.png", train, "loss_scale", "loss scale")] if scale_varies else []),
    ]


def _eval_metrics(evals: list[dict[str, Any]]) -> list[str]:
    """The numeric fields of the eval records that are metrics, in the order they first appear."""
    numeric = (key for record in evals for key, value in record.items() if isinstance(value, (int, float)))
    return list(dict.fromkeys(key for key in numeric if key not in EVAL_FIELDS))


def _drawn(figure: Any, rows: list[dict[str, Any]], key: str, title: str) -> bytes:
    """``rows``' ``key`` against the optimizer step as PNG bytes (the loss scale on a log2 axis, skipped steps marked)."""
    axes = figure.subplots()
    axes.plot([r["step"] for r in rows], [r[key] for r in rows], marker="." if len(rows) < 50 else None)
    if key == "loss_scale":
        _mark_skipped_steps(axes, rows)
    axes.set_xlabel("optimizer step")
    axes.set_title(title)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    return image.getvalue()


def _mark_skipped_steps(axes: Any, rows: list[dict[str, Any]]) -> None:
    skipped = [r for r in rows if r.get("skipped")]
    axes.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], color="red", marker="x", label="skipped step", zorder=3)
    if skipped:
        axes.legend()
    if rows and all(r["loss_scale"] > 0 for r in rows):
        axes.set_yscale("log", base=2)
