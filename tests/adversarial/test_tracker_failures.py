"""A tracker that fails when it starts costs one warning, never the run; tracked-run ids read back
from a checkpoint (untrusted bytes) reach a tracker only in a form it can take."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from resume_helpers import NoisyDigits, make_model

from ampddp import CheckpointSettings, Reporting, Trainer
from ampddp.observe.loggers import CsvLogger, MetricLogger, MlflowLogger, TensorBoardLogger, WandbLogger
from ampddp.observe.observer import TrackedRuns


class BrokenAtStart(MetricLogger):
    """A tracker whose store cannot be opened (a corrupted database, a folder that is a file)."""

    name = "broken"

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def start(self, run_dir, config, run_id, step):
        raise OSError("unable to open database file")

    def log(self, kind, values, step) -> None:
        raise AssertionError("a logger that never started is never logged to")

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


def fit_with(run_dir, *loggers: MetricLogger) -> None:
    Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision="O0", batch_size=8, max_steps=2,
            log_every=1, run_dir=run_dir, checkpoints=CheckpointSettings(keep_last=1),
            report=Reporting(progress="off", loggers=loggers)).fit()  # fmt: skip


def test_a_tracker_that_fails_at_start_is_dropped_with_one_warning_and_the_run_trains(tmp_path, caplog):
    broken = BrokenAtStart()
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        fit_with(tmp_path / "run", broken, CsvLogger())
    said = [record.getMessage() for record in caplog.records if "broken" in record.getMessage()]
    assert said == ["logger broken could not start (OSError: unable to open database file); the run goes on without it"]
    assert broken.closed == [True]  # what it opened before failing is closed, as failed
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "run" / "csv" / "train.csv").read_text().count("\n") == 3  # the other logger: header + 2 steps


def test_a_logger_folder_planted_as_a_file_drops_that_logger_and_leaves_the_file(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "csv").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        fit_with(run_dir, CsvLogger())
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("logger csv ")]
    assert len(said) == 1 and said[0].endswith("; the run goes on without it"), said  # one warning, at start or first write
    assert (run_dir / "csv").read_text() == "mine"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("name", ["wandb", "tensorboard", "mlflow"])
def test_a_tracker_folder_or_store_planted_as_a_link_drops_that_tracker_and_writes_nothing_through_it(tmp_path, caplog, name):
    pytest.importorskip(name)
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = outside / "target"
    if name == "mlflow":
        target.write_bytes(b"mine")
    else:
        target.mkdir()
    (run_dir / ("mlflow.db" if name == "mlflow" else name)).symlink_to(target)
    tracker = {"wandb": lambda: WandbLogger(mode="offline"), "tensorboard": TensorBoardLogger, "mlflow": MlflowLogger}[name]()
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        fit_with(run_dir, tracker)
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith(f"logger {name} ")]
    assert len(said) == 1 and "is a symbolic link" in said[0] and said[0].endswith("; the run goes on without it"), said
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert list(target.iterdir()) == [] if target.is_dir() else target.read_bytes() == b"mine", "written through the link"


@pytest.mark.parametrize(
    "saved",
    [{"wandb": "../../etc"}, {"mlflow": "x" * 500}, {"wandb": "\x1b[2Jid"}, {"wandb": 7}, ["wandb"], {"wandb": ""}],
    ids=["path", "too-long", "escape", "not-a-string", "not-a-dict", "empty"],
)
def test_malformed_tracked_run_ids_are_dropped_with_a_warning(saved, caplog):
    runs = TrackedRuns()
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        runs.load_state_dict(saved)
    assert runs.ids == {} and "tracked-run ids are malformed" in caplog.text
    assert "\x1b" not in caplog.text  # echoed escaped


def test_well_formed_tracked_run_ids_are_kept():
    runs = TrackedRuns()
    ids = {"wandb": "3f9a1b2c", "mlflow": "0123456789abcdef0123456789abcdef"}
    runs.load_state_dict(ids)
    assert runs.ids == ids
