"""The run's plots: written from metrics.jsonl without changing the process's matplotlib backend,
and skipped with one message (the run still completes) when the optional matplotlib is missing."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import matplotlib

from ampddp.cli import main
from ampddp.observe.plots import PLOTS_SKIPPED, RunHistory, plot_metrics
from ampddp.rundir.files import METRICS_FILE, PLOT_FILES, SUMMARY_FILE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
FAST = ["trainer.max_steps=2", "trainer.log_every_steps=1", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=lines"]


def test_plots_are_written_and_the_matplotlib_backend_is_left_alone(tmp_path):
    lines = [{"kind": "train", "step": step, "loss": 1 / step, "loss_scale": 2.0**step, "skipped": step == 3} for step in range(1, 6)]
    lines.append({"kind": "eval", "step": 5, "accuracy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    previous = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's choice, which a training run must not override
    try:
        paths = plot_metrics(tmp_path)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)
    assert [path.name for path in paths] == ["loss.png", "eval_accuracy.png", "loss_scale.png", "report.png"]
    assert all(path.read_bytes().startswith(PNG_MAGIC) for path in paths)


def test_without_matplotlib_a_run_skips_the_plots_with_one_message_and_still_writes_its_results(tmp_path, monkeypatch, caplog):
    # None in sys.modules makes the import raise ImportError, as on an install without the plots extra.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with caplog.at_level(logging.WARNING):
        code = main(["train", str(QUICKSTART), f"trainer.run_dir={tmp_path}", *FAST])
    assert code == 0
    skipped = [record for record in caplog.records if record.getMessage() == PLOTS_SKIPPED]
    assert len(skipped) == 1 and "pip install 'ampddp[plots]'" in PLOTS_SKIPPED
    assert not any((tmp_path / name).exists() for name in PLOT_FILES)
    assert json.loads((tmp_path / SUMMARY_FILE).read_text())["steps"] == 2
    kinds = {json.loads(line)["kind"] for line in (tmp_path / METRICS_FILE).read_text().splitlines()}
    assert {"start", "train", "eval"} <= kinds


def test_a_loss_scale_that_never_changed_gets_no_plot(tmp_path):
    lines = [{"kind": "train", "step": step, "loss": 1 / step, "loss_scale": 1.0, "skipped": False} for step in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [path.name for path in plot_metrics(tmp_path)] == ["loss.png", "report.png"]
    assert not (tmp_path / "loss_scale.png").exists()


def test_the_panels_label_their_axes_and_draw_the_window_means_beside_the_evaluation_loss(tmp_path):
    lines = [{"kind": "start", "step": 0, "epoch": 0, "precision": "O2"}]
    lines += [
        {"kind": "train", "step": s, "loss": 9.0, "loss_mean": 1 / s, "lr": 0.1, "loss_scale": 1.0, "skipped": False} for s in (1, 5, 10)
    ]
    lines += [{"kind": "eval", "step": 10, "loss": 0.3, "accuracy": 0.9, "samples": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    history = RunHistory.of(tmp_path)
    assert history.label == f"{tmp_path.name} (O2)"
    loss, accuracy, lr = history.panels(own_labels=True)
    assert (loss.file, loss.ylabel, [curve.values for curve in loss.curves]) == ("loss.png", "loss", [[1.0, 0.2, 0.1], [0.3]])
    assert (accuracy.file, accuracy.ylabel, accuracy.curves[0].values) == ("eval_accuracy.png", "accuracy", [0.9])
    assert (lr.file, lr.ylabel) == ("lr.png", "learning rate")


def test_ampddp_plot_overlays_runs_on_one_page_and_keeps_an_existing_file(tmp_path, capsys):
    for name, loss in (("o2", 1.0), ("bf16", 2.0)):
        (tmp_path / name).mkdir()
        records = [{"kind": "train", "step": s, "loss": loss / s, "lr": 0.1} for s in (1, 2)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "both.png"
    assert main(["plot", str(tmp_path / "o2"), str(tmp_path / "bf16"), "--to", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC) and f"wrote {out}" in capsys.readouterr().out
    out.write_bytes(b"mine")
    assert main(["plot", str(tmp_path / "o2"), str(tmp_path / "bf16"), "--to", str(out)]) == 2
    assert "exists; choose another name or pass --force" in capsys.readouterr().err and out.read_bytes() == b"mine"
    assert main(["plot", str(tmp_path / "o2"), str(tmp_path)]) == 2
    assert f"{tmp_path}: no metrics.jsonl here" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "o2")]) == 0
    assert (tmp_path / "o2" / "report.png").read_bytes().startswith(PNG_MAGIC)


def test_a_colour_means_one_run_on_a_page_and_red_only_skipped_steps(tmp_path):
    from ampddp.observe.plots import _draw_panel

    class Axes:
        def __init__(self) -> None:
            self.drawn: list[tuple[str, str, str]] = []

        def plot(self, steps, values, **style):
            self.drawn.append((style["label"], style["color"], style["linestyle"]))

        def scatter(self, steps, values, **style):
            self.drawn.append((style["label"], style["color"], "x"))

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    drawn = []
    for run, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        records = [{"kind": "train", "step": s, "loss": 1.0 / s, "lr": 0.1, "loss_scale": 2.0**s, "skipped": s == 2} for s in (1, 2, 3)]
        records += [{"kind": "eval", "step": 3, "loss": 0.5, "accuracy": 0.9, "samples": 4}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        for panel in RunHistory.of(tmp_path / name).panels(run=run):
            axes = Axes()
            _draw_panel(axes, panel)
            drawn += [(run, *line) for line in axes.drawn]
    colours = {run: {colour for r, label, colour, _ in drawn if r == run and not label.endswith("skipped step")} for run in (0, 1)}
    assert len(colours[0]) == len(colours[1]) == 1 and colours[0] != colours[1] and "red" not in colours[0] | colours[1]
    assert {colour for _, label, colour, _ in drawn if label.endswith("skipped step")} == {"red"}
    assert {style for _, label, _, style in drawn if label.endswith("evaluation")} == {"--"}
