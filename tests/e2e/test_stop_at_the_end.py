"""A stop that lands on a run's last step (or a crash in its final evaluation) ends like an uninterrupted run.

NoisyDigits has 44 samples; batch 4 with 2 accumulation steps makes 6 optimizer steps an epoch, so
step 9 ends a run inside an epoch and step 12 at an epoch's end.
"""

from __future__ import annotations

import json
import signal

import pytest
from resume_helpers import assert_identical, final_state, make_trainer

from ampddp.checkpoint.inspect import summarize
from ampddp.distributed.env import detect_env
from ampddp.observe import Reporting, read_metrics
from ampddp.rundir.files import METRICS_FILE, SUMMARY_FILE
from ampddp.training.callbacks import Callback

TIMING = ("wall_time_s", "data_wait_s")


class StopBefore(Callback):
    """Sends this process a stop signal once step ``step - 1`` has ended: step ``step`` is the one that stops."""

    def __init__(self, step: int, signum: signal.Signals = signal.SIGUSR1) -> None:
        self.step, self.signum = step, signum

    def on_step(self, progress, record) -> None:
        if progress.global_step == self.step - 1:
            signal.raise_signal(self.signum)


class CrashInEvaluation(Callback):
    """Dies (as a SIGKILL would) once the evaluation at ``step`` has been reported."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_evaluation(self, progress, metrics) -> None:
        if progress.global_step == self.step:
            raise KeyboardInterrupt(f"killed in the evaluation at step {self.step}")


def fit(run_dir, max_steps: int, *callbacks: Callback, **overrides) -> dict:
    env = detect_env({}, device="cpu")
    return make_trainer(run_dir, "O0", max_steps, env=env, report=Reporting(progress="lines"), callbacks=callbacks, **overrides).fit()


def eval_records(run_dir) -> list[dict]:
    return [record for record in read_metrics(run_dir) if record["kind"] == "eval"]


def raw_eval_steps(run_dir) -> list[int]:
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [record["step"] for record in map(json.loads, lines) if record["kind"] == "eval"]


def summary_of(run_dir) -> dict:
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    return {key: value for key, value in summary.items() if key not in TIMING}


def assert_ends_alike(straight, other, last_step: int) -> None:
    """Same final model and checkpoint, the same evaluations (the final one once), the same summary."""
    assert summarize(other)["step"] == last_step
    assert summarize(other)["model_sha256"] == summarize(straight)["model_sha256"]
    assert_identical(final_state(straight), final_state(other))
    assert eval_records(other) == eval_records(straight)
    assert eval_records(other)[-1]["step"] == last_step
    assert summary_of(other) == summary_of(straight)
    assert summary_of(other)["final_eval_accuracy"] == eval_records(straight)[-1]["accuracy"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted runs, by their last step."""
    runs = {}
    for last_step in (9, 12):
        run_dir = tmp_path_factory.mktemp(f"straight-{last_step}")
        result = fit(run_dir, last_step, checkpoint_every=3)
        assert result["summary"]["preempted"] is None and eval_records(run_dir)[-1]["step"] == last_step
        runs[last_step] = run_dir
    return runs


@pytest.mark.parametrize("last_step", [9, 12], ids=["inside-an-epoch", "at-an-epoch-end"])
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["usr1", "term"])
def test_a_stop_on_the_last_step_ends_like_an_uninterrupted_run(straight, tmp_path, last_step, signum):
    run_dir = tmp_path / "stopped"
    result = fit(run_dir, last_step, StopBefore(last_step, signum), checkpoint_every=3)
    assert result["progress"]["global_step"] == last_step
    assert result["summary"]["preempted"] is None, "the run is complete: there is nothing to resume"
    assert result["eval"]["samples"] == 10 and raw_eval_steps(run_dir).count(last_step) == 1
    assert_ends_alike(straight[last_step], run_dir, last_step)
    again = fit(run_dir, last_step)  # what a scheduler's requeue does
    assert again["summary"]["already_complete"] is True
    assert raw_eval_steps(run_dir).count(last_step) == 1
    assert_ends_alike(straight[last_step], run_dir, last_step)


def test_a_stop_on_the_step_before_the_last_resumes_to_the_same_end(straight, tmp_path):
    run_dir = tmp_path / "stopped"
    result = fit(run_dir, 9, StopBefore(8), checkpoint_every=3)
    assert result["summary"]["preempted"] == "SIGUSR1" and result["progress"]["global_step"] == 8
    assert 8 not in raw_eval_steps(run_dir) and 9 not in raw_eval_steps(run_dir)
    fit(run_dir, 9, checkpoint_every=3)
    assert raw_eval_steps(run_dir).count(9) == 1
    assert_ends_alike(straight[9], run_dir, 9)


@pytest.mark.parametrize("last_step", [9, 12], ids=["inside-an-epoch", "at-an-epoch-end"])
def test_a_crash_in_the_final_evaluation_leaves_no_final_checkpoint_to_find_complete(straight, tmp_path, last_step):
    """The final evaluation comes before any checkpoint of the last step: a run killed during it
    resumes from the checkpoint before and evaluates, instead of being found complete without it."""
    run_dir = tmp_path / "crashed"
    with pytest.raises(KeyboardInterrupt):
        fit(run_dir, last_step, CrashInEvaluation(last_step), checkpoint_every=3)
    assert summarize(run_dir)["step"] < last_step
    again = fit(run_dir, last_step, checkpoint_every=3)
    assert "already_complete" not in again["summary"] and again["eval"]["samples"] == 10
    assert_ends_alike(straight[last_step], run_dir, last_step)
