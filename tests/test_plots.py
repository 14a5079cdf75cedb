"""The run's plots: written from metrics.jsonl without changing the process's matplotlib backend."""

from __future__ import annotations

import json

import matplotlib

from ampddp.observe import plot_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
