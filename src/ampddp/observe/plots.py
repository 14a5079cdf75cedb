"""The run's plots from metrics.jsonl: loss (the training loss's window means beside the evaluation
loss), each evaluation metric, the learning rate, the loss scale, and report.png with all of them on
one page; and the same curves of several runs overlaid (``ampddp plot``), the comparison users make
most (two modes, two learning rates).

Figures are made with matplotlib's object API, not pyplot: no backend is chosen for the whole
process (a user's interactive backend stays) and no figure is left registered anywhere. matplotlib
is an optional extra (``ampddp[plots]``) that keeps the core install lean: without it one warning
says how to install it and no plot is written, so a run still ends with its metrics and summary.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampddp.observe.metrics_file import read_metrics
from ampddp.rundir.files import replace_file, run_file_errors
from ampddp.rundir.paths import refuse_long_names

PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'ampddp[plots]')"
REPORT_FILE = "report.png"
logger = logging.getLogger("ampddp.observe")

EVAL_FIELDS = ("kind", "step", "epoch", "loss", "samples")
"""Fields of an eval record that are not a metric of its own panel (the eval loss is drawn with the training loss)."""


RUN_COLOURS = ("C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9")
"""One colour per run on a page, in every panel alike (matplotlib's cycle without its red, C3: red marks
skipped steps only). Within a run, evaluation curves are dashed."""


@dataclass(frozen=True)
class Curve:
    """One line of a panel: its label, the (step, value) points, the run it belongs to on the page
    (its colour) and whether it is an evaluation (dashed)."""

    label: str
    steps: list[int]
    values: list[float]
    run: int = 0
    evaluation: bool = False


@dataclass(frozen=True)
class Panel:
    """One plot: the file it is saved as alone, its title, y label and curves, and a log2 y axis."""

    file: str
    title: str
    ylabel: str
    curves: list[Curve]
    log2: bool = False


@dataclass(frozen=True)
class RunHistory:
    """A run's records as plotted: its name (the run dir's) and precision mode (its latest start record's)."""

    name: str
    mode: str | None
    records: list[dict[str, Any]]

    @classmethod
    def of(cls, run_dir: str | Path) -> RunHistory:
        refuse_long_names(run_dir, "run dir")
        records = read_metrics(run_dir)
        modes = [r["precision"] for r in records if r.get("kind") == "start" and isinstance(r.get("precision"), str)]
        return cls(Path(run_dir).resolve().name, modes[-1] if modes else None, records)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.mode})" if self.mode else self.name

    def panels(self, own_labels: bool = False, run: int = 0) -> list[Panel]:
        """loss, eval_<metric> for each evaluation metric, lr and (when the scale moved) loss_scale;
        ``own_labels``: curves named by their kind alone (one run), else by the run (overlays); ``run``:
        this run's place on the page (its colour)."""
        train = [r for r in self.records if r.get("kind") == "train"]
        evals = [r for r in self.records if r.get("kind") == "eval"]
        name = (lambda kind: kind) if own_labels else (lambda kind: f"{self.label} {kind}")
        windows = _curve(name("training (mean over each logging window)"), train, "loss_mean", run, fallback="loss")
        panels = [Panel("loss.png", "loss", "loss", [windows, _curve(name("evaluation"), evals, "loss", run, evaluation=True)])]
        for key in _eval_metrics(evals):
            panels.append(Panel(f"eval_{key}.png", f"held-out {key}", key, [_curve(name("evaluation"), evals, key, run, evaluation=True)]))
        panels.append(Panel("lr.png", "learning rate", "learning rate", [_curve(name("lr"), train, "lr", run)]))
        if len({r.get("loss_scale") for r in train}) > 1 or any(r.get("skipped") for r in train):
            panels.append(_loss_scale_panel(train, name, run))
        return [panel for panel in panels if any(curve.steps for curve in panel.curves)]


def _loss_scale_panel(train: list[dict[str, Any]], name: Callable[[str], str], run: int) -> Panel:
    """The loss scale on a log2 axis (where it stayed positive), its skipped steps marked."""
    scale = _curve(name("loss scale"), train, "loss_scale", run)
    skipped = [r for r in train if r.get("skipped") and isinstance(r.get("loss_scale"), (int, float))]
    marks = Curve(name("skipped step"), [r["step"] for r in skipped], [r["loss_scale"] for r in skipped], run)
    return Panel("loss_scale.png", "loss scale", "loss scale (log2)", [scale, marks], log2=_all_positive(scale))


def _curve(label: str, records: list[dict[str, Any]], key: str, run: int, fallback: str | None = None, evaluation: bool = False) -> Curve:
    """``key`` (or ``fallback`` where a record lacks it: a run written before it existed) against the step."""
    points = [(r["step"], r.get(key, r.get(fallback) if fallback else None)) for r in records]
    kept = [(step, float(value)) for step, value in points if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return Curve(label, [step for step, _ in kept], [value for _, value in kept], run, evaluation)


def _all_positive(curve: Curve) -> bool:
    return bool(curve.values) and all(value > 0 for value in curve.values)


def _eval_metrics(evals: list[dict[str, Any]]) -> list[str]:
    """The numeric fields of the eval records that are metrics, in the order they first appear."""
    numeric = (key for record in evals for key, value in record.items() if isinstance(value, (int, float)))
    return list(dict.fromkeys(key for key in numeric if key not in EVAL_FIELDS))


def plot_metrics(run_dir: str | Path) -> list[Path]:
    """The run's plots in its run dir (each panel alone, then report.png with every panel on one
    page); the paths written, none without matplotlib."""
    figure_class = _figure_class()
    if figure_class is None:
        return []
    history = RunHistory.of(run_dir)
    panels = history.panels(own_labels=True)
    outputs = [_save(Path(run_dir) / panel.file, _drawn(figure_class, [panel], history.label), Path(run_dir)) for panel in panels]
    if panels:
        outputs.append(_save(Path(run_dir) / REPORT_FILE, _drawn(figure_class, panels, history.label), Path(run_dir)))
    return outputs


def plot_comparison(run_dirs: Sequence[str | Path], out: str | Path) -> Path | None:
    """Every panel of the runs in ``run_dirs`` with their curves overlaid, on one page at ``out``
    (None without matplotlib)."""
    refuse_long_names(out, "--to")
    figure_class = _figure_class()
    if figure_class is None:
        return None
    histories = [RunHistory.of(run_dir) for run_dir in run_dirs]
    by_file: dict[str, Panel] = {}
    for run, history in enumerate(histories):
        for panel in history.panels(run=run):
            kept = by_file.get(panel.file)
            by_file[panel.file] = panel if kept is None else Panel(kept.file, kept.title, kept.ylabel, kept.curves + panel.curves,
                                                                   kept.log2 and panel.log2)  # fmt: skip
    title = " vs ".join(history.label for history in histories)
    return _save(Path(out), _drawn(figure_class, list(by_file.values()), title), Path(out).parent)


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning(PLOTS_SKIPPED)
        return None
    return Figure


def _save(path: Path, data: bytes, root: Path) -> Path:
    with run_file_errors(path):
        replace_file(path, data, root)
    return path


def _drawn(figure_class: Any, panels: list[Panel], title: str) -> bytes:
    """``panels`` in a grid of up to 2 columns (one alone: 6x3.5 inches), titled, as PNG bytes."""
    columns = 1 if len(panels) == 1 else 2
    rows = -(-len(panels) // columns)
    figure = figure_class(figsize=(6 * columns, 3.5 * rows + 0.4), layout="constrained")
    figure.suptitle(title, fontsize="medium")
    grid = figure.subplots(rows, columns, squeeze=False)
    for axes, panel in zip(grid.flat, panels):
        _draw_panel(axes, panel)
    for axes in list(grid.flat)[len(panels) :]:
        axes.set_visible(False)
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    return image.getvalue()


def _draw_panel(axes: Any, panel: Panel) -> None:
    for curve in panel.curves:
        if curve.label.endswith("skipped step"):
            axes.scatter(curve.steps, curve.values, color="red", marker="x", label=curve.label, zorder=3)
        else:
            axes.plot(curve.steps, curve.values, marker="." if len(curve.steps) < 50 else None, label=curve.label,
                      color=RUN_COLOURS[curve.run % len(RUN_COLOURS)], linestyle="--" if curve.evaluation else "-")  # fmt: skip
    if panel.log2:
        axes.set_yscale("log", base=2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(panel.ylabel)
    axes.set_title(panel.title)
    axes.grid(True, alpha=0.3)
    if len([curve for curve in panel.curves if curve.steps]) > 1:
        axes.legend(fontsize="small")
