"""A run dir moved or removed during a run stops the run with one line (exit 5) instead of being
recreated empty, which split the run in two folders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ampddp.cli import EXIT_IO, main
from ampddp.errors import RunIOError
from ampddp.observe import RunObserver
from ampddp.rundir.files import RunDirIdentity

REPO = Path(__file__).resolve().parents[2]


def test_the_first_check_makes_the_dir_and_later_ones_notice_a_move_or_removal(tmp_path):
    run_dir = tmp_path / "run"
    identity = RunDirIdentity(run_dir)
    identity.check()
    identity.check()
    run_dir.rename(tmp_path / "moved")
    with pytest.raises(RunIOError, match="was removed during the run"):
        identity.check()
    assert not run_dir.exists()  # not recreated
    run_dir.mkdir()  # another folder at the same path
    with pytest.raises(RunIOError, match="was moved or replaced during the run"):
        identity.check()


def test_a_run_whose_dir_is_moved_mid_run_stops_with_one_line_and_nothing_recreated(tmp_path, monkeypatch, capsys):
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    real_log_step = RunObserver.log_step

    def move_after_step_2(self, record, samples_seen, *shown):
        real_log_step(self, record, samples_seen, *shown)
        if record.get("step") == 2 and run_dir.exists():
            shutil.move(run_dir, moved)

    monkeypatch.setattr(RunObserver, "log_step", move_after_step_2)
    overrides = [f"trainer.run_dir={run_dir}", "trainer.max_steps=6", "data.batch_size=8", "trainer.log_every_steps=1",
                 "checkpoint.every_steps=4", "trainer.progress=lines"]  # fmt: skip
    assert main(["train", str(REPO / "recipes" / "quickstart.yaml"), *overrides]) == EXIT_IO
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ampddp train: error:")]
    assert len(errors) == 1 and "the run dir was removed during the run" in errors[0]
    assert not run_dir.exists() and (moved / "metrics.jsonl").is_file()


def test_one_run_dir_value_is_shared_by_the_store_and_the_observer(tmp_path):
    """The Trainer makes the run dir once: the checkpoint store and the observer hold the same
    ``RunDir``, so a move noticed by either is noticed by both (one record of the starting folder)."""
    import torch
    from helpers import make_mlp

    from ampddp import CheckpointSettings, Trainer
    from ampddp.rundir.run_dir import RunDir
    from ampddp.training.callbacks import ObserverCallback

    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    trainer = Trainer(make_mlp(), lambda p: torch.optim.SGD(p, lr=0.1), data, precision="O0", batch_size=4, max_steps=1,
                      checkpoints=CheckpointSettings(tmp_path / "run"))  # fmt: skip
    observer = next(part.observer for part in trainer.callbacks.callbacks if isinstance(part, ObserverCallback))
    place = trainer.checkpointer.store.run_dir
    assert isinstance(place, RunDir) and observer.place is place
    assert (place.checkpoints, place.metrics, place.summary) == (tmp_path / "run" / "checkpoints", tmp_path / "run" / "metrics.jsonl",
                                                                 tmp_path / "run" / "summary.json")  # fmt: skip
    assert not (tmp_path / "run").exists()  # made, not written: nothing exists before the first write
    trainer.fit()
    (tmp_path / "run").rename(tmp_path / "moved")
    with pytest.raises(RunIOError, match="was removed during the run"):
        trainer.checkpointer.store.run_dir.check()
