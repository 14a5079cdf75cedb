"""Logs survive a torn write: metrics.jsonl skips a torn last record on read (one warning) and cuts
it away before the next record; a run whose files cannot be written (disk full) stops with one line
and its own, retryable exit code, and the same command then finishes the run."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
from pathlib import Path

from ampddp.cli import EXIT_IO, main
from ampddp.observe import read_metrics
from ampddp.rundir.files import METRICS_FILE, drop_torn_tail

REPO = Path(__file__).resolve().parents[2]
SHORT = ["data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=lines", "optimizer.scheduler=none"]


def train(run_dir: Path, steps: int) -> int:
    return main(["train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}", *SHORT])


def test_a_torn_last_record_is_skipped_on_read_and_cut_before_the_next(tmp_path, caplog):
    path = tmp_path / METRICS_FILE
    whole = [{"kind": "train", "step": 1, "epoch": 0, "loss": 2.0}, {"kind": "train", "step": 2, "epoch": 0, "loss": 1.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"kind": "train", "step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        assert read_metrics(tmp_path) == whole
    assert "line 3 is not a whole record" in caplog.text
    drop_torn_tail(path)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in whole)
    drop_torn_tail(path)  # a whole log is left as it is
    assert read_metrics(tmp_path) == whole


def test_a_resumed_run_appends_after_the_torn_record_is_cut(tmp_path):
    run_dir = tmp_path / "run"
    assert train(run_dir, 2) == 0
    with open(run_dir / METRICS_FILE, "a") as handle:
        handle.write('{"kind": "train", "step": 3, "epo')  # what a full disk left
    assert train(run_dir, 3) == 0
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # every line whole again
    assert max(r["step"] for r in read_metrics(run_dir)) == 3


def test_a_disk_full_while_writing_is_one_line_with_the_retryable_code_and_the_same_command_finishes(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    real_replace = os.replace

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", disk_full)
    assert train(run_dir, 2) == EXIT_IO
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ampddp train: error:")]
    assert len(error) == 1 and "No space left on device" in error[0] and "the same command resumes" in error[0]
    monkeypatch.setattr(os, "replace", real_replace)
    assert train(run_dir, 2) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_a_finished_run_whose_summary_was_lost_gets_it_rebuilt_by_the_same_command(tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    assert train(run_dir, 2) == 0
    written = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()  # what a full disk after the final checkpoint left
    for plot in run_dir.glob("*.png"):
        plot.unlink()
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        assert train(run_dir, 2) == 0
    assert "rebuilt from metrics.jsonl" in caplog.text
    rebuilt = json.loads((run_dir / "summary.json").read_text())
    same = ("final_eval_accuracy", "best_eval_accuracy", "final_eval_loss", "steps", "epochs", "samples_seen", "world_size")
    assert {key: rebuilt[key] for key in same} == {key: written[key] for key in same}
    assert rebuilt["wall_time_s"] is None  # not measured by the process that rebuilt it
    printed = json.loads(capsys.readouterr().out)
    assert printed["already_complete"] is True and printed["steps"] == 2
    if importlib.util.find_spec("matplotlib") is not None:
        assert list(run_dir.glob("*.png"))  # the plots are drawn again
