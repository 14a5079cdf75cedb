"""Experiment trackers: a run logs to CSV, TensorBoard, W&B (offline) and MLflow (a local store) from a
recipe and from the library Trainer, and a resumed run continues the same tracked runs."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from resume_helpers import NoisyDigits, make_model
from wandb_records import wandb_history

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import load_safely
from ampddp.checkpoint.inspect import summarize
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import main
from ampddp.errors import ConfigError
from ampddp.observe import Reporting
from ampddp.observe.loggers import CsvLogger, MetricLogger, MlflowLogger, WandbLogger
from ampddp.trainer import Trainer
from ampddp.training import CheckpointSettings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SMALL = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "data.eval_fraction=0.05",
         "trainer.progress=off", "trainer.log_every_steps=1", "checkpoint.every_steps=2", "optimizer.scheduler=none"]  # fmt: skip
needs = {name: pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed (pip install 'ampddp[{name}]')")
         for name in ("wandb", "mlflow", "tensorboard")}  # fmt: skip


@pytest.fixture(autouse=True)
def offline_trackers(tmp_path, monkeypatch):
    """No tracker leaves the test's folder or reaches the network, nor leaves settings behind."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    service_before = os.environ.get("WANDB_SERVICE")
    yield
    if service_before is None:
        os.environ.pop("WANDB_SERVICE", None)  # W&B records its service process here for later runs of this process


def saved_tracked_runs(run_dir: Path) -> dict:
    return load_safely(CheckpointStore(run_dir).latest().shared_file)[keys.TRACKED_RUNS]


def wandb_rows(run_dir: Path, run_id: str) -> list[dict]:
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))  # a folder name taken: "-1" added
    return [row for file in files for row in wandb_history(file)]


def mlflow_history(run_dir: Path, run_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


def csv_rows(run_dir: Path, kind: str) -> list[dict]:
    with (run_dir / "csv" / f"{kind}.csv").open(newline="") as file:
        return list(csv.DictReader(file))


@needs["wandb"]
@needs["mlflow"]
@needs["tensorboard"]
def test_a_recipe_logs_to_every_tracker_and_a_resume_continues_the_same_tracked_runs(tmp_path):
    run_dir = tmp_path / "run"
    loggers = ["observe.loggers=[csv, tensorboard, wandb, mlflow]", "observe.wandb_mode=offline", "precision.mode=O1"]
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={run_dir}", *SMALL, *loggers, "trainer.max_steps=4"]) == 0
    first = saved_tracked_runs(run_dir)
    assert set(first) == {"wandb", "mlflow"}
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={run_dir}", *SMALL, *loggers, "trainer.max_steps=6"]) == 0
    assert saved_tracked_runs(run_dir) == first, "the resumed run logs to the tracked runs it started"
    assert summarize(run_dir)["tracked_runs"] == first

    rows = [row for row in wandb_rows(run_dir, first["wandb"]) if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all("train/loss_scale" in row and "train/lr" in row and "train/samples_per_s" in row for row in rows)
    assert mlflow_history(run_dir, first["mlflow"], "train/loss") == [1, 2, 3, 4, 5, 6]
    assert mlflow_history(run_dir, first["mlflow"], "eval/accuracy"), "the evaluation is logged too"
    assert [int(row["step"]) for row in csv_rows(run_dir, "train")] == [1, 2, 3, 4, 5, 6]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_a_resume_drops_the_csv_rows_a_dead_run_logged_after_its_last_checkpoint(tmp_path):
    sink = CsvLogger()
    sink.start(tmp_path, None, None, 0)
    for step in (1, 2, 3):
        sink.log("train", {"loss": float(step)}, step)
    sink.log("train", {"loss": 4.0, "grad_norm": 0.5}, 4)  # a new column: the file is written again with it
    resumed = CsvLogger()
    resumed.start(tmp_path, None, None, 2)  # the checkpoint it resumes from was taken at step 2
    resumed.log("train", {"loss": 3.5}, 3)
    rows = csv_rows(tmp_path, "train")
    assert [(row["step"], row["loss"], row["grad_norm"]) for row in rows] == [("1", "1.0", ""), ("2", "2.0", ""), ("3", "3.5", "")]


@pytest.mark.parametrize(("mode", "scaled"), [("O1", True), ("native-bf16", False)])
def test_loss_scale_and_skipped_steps_are_logged_only_in_modes_that_scale(tmp_path, mode, scaled):
    trainer = Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision=mode, batch_size=8,
                      max_steps=2, log_every=1, checkpoints=CheckpointSettings(tmp_path),
                      report=Reporting(progress="off", loggers=("csv",)))  # fmt: skip
    trainer.fit()
    columns = set(csv_rows(tmp_path, "train")[0])
    assert {"loss", "lr"} <= columns
    assert ({"loss_scale", "skipped_steps"} <= columns) is scaled


def test_the_library_trainer_reports_by_default_and_is_silent_when_asked(tmp_path, capsys):
    def fit(run_dir: Path, **report) -> None:
        Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), eval_set=NoisyDigits(8), precision="O0",
                batch_size=8, max_steps=2, log_every=1, checkpoints=CheckpointSettings(run_dir), **report).fit()  # fmt: skip

    fit(tmp_path / "default")
    printed = capsys.readouterr().out
    assert "step 1 epoch 0.50 loss" in printed and "step 2 epoch 1.00 loss" in printed, printed
    assert "lr 0.05" in printed and "scale" not in printed, printed
    assert {"metrics.jsonl", "summary.json", "checkpoints"} <= {path.name for path in (tmp_path / "default").iterdir()}
    fit(tmp_path / "silent", report=None)
    assert capsys.readouterr().out == ""
    assert {path.name for path in (tmp_path / "silent").iterdir()} == {"checkpoints"}


@needs["wandb"]
@needs["mlflow"]
def test_the_library_trainer_continues_its_wandb_and_mlflow_runs_after_a_resume(tmp_path):
    def fit(max_steps: int) -> None:
        loggers = (WandbLogger(project="tests", mode="offline"), MlflowLogger(experiment="tests"))
        Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision="native-bf16", batch_size=8,
                max_steps=max_steps, max_epochs=10, log_every=1, checkpoint_every=1, checkpoints=CheckpointSettings(tmp_path),
                report=Reporting(progress="off", loggers=loggers)).fit()  # fmt: skip

    fit(2)
    run_ids = saved_tracked_runs(tmp_path)
    fit(3)
    assert saved_tracked_runs(tmp_path) == run_ids and set(run_ids) == {"wandb", "mlflow"}
    rows = [row for row in wandb_rows(tmp_path, run_ids["wandb"]) if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert not any("train/loss_scale" in row for row in rows), "bf16 does not scale the loss"
    assert mlflow_history(tmp_path, run_ids["mlflow"], "train/loss") == [1, 2, 3]
    assert mlflow_history(tmp_path, run_ids["mlflow"], "train/loss_scale") == []


class NeedsMissingPackage(MetricLogger):
    name = "missing"
    requires = ("ampddp_no_such_package", "nothing")

    def log(self, kind, values, step) -> None:
        raise AssertionError("never started")


def test_bad_reporting_is_refused_naming_what_is_valid(tmp_path):
    with pytest.raises(
        ConfigError, match=r"logger='wandbb' is not valid \(did you mean 'wandb'\?\); valid choices: tensorboard, csv, wandb, mlflow"
    ):
        Reporting(loggers=("wandbb",))
    with pytest.raises(ConfigError, match=r"needs the ampddp_no_such_package package: pip install 'ampddp\[nothing\]'"):
        Reporting(loggers=(NeedsMissingPackage(),))
    with pytest.raises(ConfigError, match="csv given twice"):
        Reporting(loggers=("csv", CsvLogger()))
    with pytest.raises(ConfigError, match="progress='loud' is not valid"):
        Reporting(progress="loud")
    with pytest.raises(ConfigError, match="loggers write into the run dir"):
        Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision="O0", batch_size=8,
                report=Reporting(loggers=("csv",)))  # fmt: skip
    with pytest.raises(ConfigError, match=r"observe.loggers\[1\]='mlfow' is not valid \(did you mean 'mlflow'\?\)"):
        main_error(tmp_path, "observe.loggers=[csv, mlfow]")


def main_error(tmp_path: Path, *overrides: str) -> None:
    from ampddp.recipe.reading import load_config

    load_config(QUICKSTART, [f"trainer.run_dir={tmp_path}", *overrides])


@needs["mlflow"]
def test_a_saved_mlflow_run_missing_from_the_store_gets_a_new_run_with_a_warning(tmp_path, caplog):
    first = MlflowLogger()
    run_id = first.start(tmp_path / "a", {"trainer": {"seed": 0}}, None, 0)
    first.close()
    moved = MlflowLogger()  # the same saved id against another store (a changed tracking URI)
    with caplog.at_level("WARNING"):
        other = moved.start(tmp_path / "b", None, run_id, 3)
    moved.close()
    assert other != run_id and f"MLflow run {run_id} is not in" in caplog.text


@needs["mlflow"]
def test_mlflow_s_own_console_handlers_step_aside_while_it_logs_for_a_run(tmp_path):
    """MLflow prints its errors (a read-only store: a 60-line SQLAlchemy traceback) through a handler of
    its own; while ampddp logs to it they go through the run's: one line on the console, all in the log."""
    import logging

    sink = MlflowLogger()
    sink.start(tmp_path, None, None, 0)
    own = logging.getLogger("mlflow")
    try:
        assert (own.handlers, own.propagate) == ([], True)
    finally:
        sink.close()
    assert own.handlers and own.propagate is False


class Tracker(MetricLogger):
    """A tracker with runs of its own: records what it was asked to continue; fails on ``fail_at``."""

    name = "tracker"

    def __init__(self, fail_at: int | None = None) -> None:
        self.continued: list[str | None] = []
        self.steps: list[int] = []
        self.closed: list[bool] = []
        self.fail_at = fail_at

    def start(self, run_dir, config, run_id, step):
        self.continued.append(run_id)
        return run_id or f"run-of-{run_dir.name}"

    def log(self, kind, values, step) -> None:
        if step == self.fail_at:
            raise ConnectionError("tracking server gone")
        self.steps.append(step)

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


def fit_with(run_dir: Path, *loggers: MetricLogger, max_steps: int = 2, **checkpoints) -> None:
    Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision="O0", batch_size=8, max_steps=max_steps,
            max_epochs=10, log_every=1, checkpoint_every=1, checkpoints=CheckpointSettings(run_dir, **checkpoints),
            report=Reporting(progress="off", loggers=loggers)).fit()  # fmt: skip


def test_a_logger_that_fails_during_the_run_is_dropped_and_training_goes_on(tmp_path, caplog):
    failing = Tracker(fail_at=2)
    with caplog.at_level("WARNING"):
        fit_with(tmp_path, failing, CsvLogger(), max_steps=3)
    assert failing.steps == [1] and failing.closed == [True]
    assert "logger tracker failed (ConnectionError: tracking server gone); the run goes on without it" in caplog.text
    assert [int(row["step"]) for row in csv_rows(tmp_path, "train")] == [1, 2, 3]


def test_only_a_resume_in_the_same_run_dir_continues_the_tracked_runs(tmp_path):
    first = Tracker()
    fit_with(tmp_path / "a", first)
    same = Tracker()
    fit_with(tmp_path / "a", same, max_steps=3)
    other = Tracker()
    fit_with(tmp_path / "b", other, max_steps=4, resume=str(CheckpointStore(tmp_path / "a").latest().path))
    assert first.continued == [None] and same.continued == ["run-of-a"] and other.continued == [None]
    assert saved_tracked_runs(tmp_path / "b") == {"tracker": "run-of-b"}
