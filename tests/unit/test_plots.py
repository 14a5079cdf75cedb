"""The run's plots: written from metrics.jsonl without changing the process's matplotlib backend,
and skipped with one message (the run still completes) when the optional matplotlib is missing."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import matplotlib

from ampddp.cli import main
from ampddp.observe.plots import PLOTS_SKIPPED, plot_metrics
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
    assert [path.name for path in paths] == ["loss.png", "eval_accuracy.png", "loss_scale.png"]
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
    assert [path.name for path in plot_metrics(tmp_path)] == ["loss.png"]
    assert not (tmp_path / "loss_scale.png").exists()
