"""A stop signal in each phase of a run ends it within seconds: during an evaluation (cut short;
training stops after the step with its checkpoint, or, in the final evaluation, at once keeping the
newest checkpoint, from which a resume evaluates), and a second Ctrl-C during a slow save (at once,
one line, exit 130, the newest complete checkpoint kept)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resume_helpers import NoisyDigits, make_trainer

from ampddp import Reporting
from ampddp.checkpoint.inspect import summarize
from ampddp.observe import read_metrics
from ampddp.preemption import EXIT_INTERRUPTED, StopRequested

REPO = Path(__file__).resolve().parents[2]


class SignalledEvaluation:
    """Metrics that send SIGTERM to this process at the first batch of evaluation number ``at`` (from
    1), counting the batches each evaluation got through."""

    def __init__(self, at: int) -> None:
        self.at, self.batches = at, []

    def begin(self) -> None:
        self.batches.append(0)

    def __call__(self, outputs, batch):
        self.batches[-1] += 1
        if len(self.batches) == self.at and self.batches[-1] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"accuracy": (outputs.argmax(1) == batch[1]).sum()}


def trainer_with(run_dir: Path, metrics: SignalledEvaluation, max_steps: int, **overrides):
    trainer = make_trainer(run_dir, "O0", max_steps=max_steps, eval_set=NoisyDigits(40), metrics=metrics,
                           stop_signals=("SIGTERM",), report=Reporting(progress="off", plots=False), **overrides)  # fmt: skip
    evaluate = trainer.evaluator.evaluate

    def counted(*args, **kwargs):
        metrics.begin()
        return evaluate(*args, **kwargs)

    trainer.evaluator.evaluate = counted
    return trainer


@pytest.mark.timeout(300)
def test_a_signal_during_an_evaluation_cuts_it_short_and_checkpoints_the_step(tmp_path, caplog):
    metrics = SignalledEvaluation(at=1)
    result = trainer_with(tmp_path / "run", metrics, max_steps=6, eval_every=2).fit()
    assert result["summary"]["preempted"] == "SIGTERM"
    assert metrics.batches[0] == 1, f"the evaluation went on for {metrics.batches[0]} of its 10 batches"
    assert summarize(tmp_path / "run")["step"] == 2
    assert "evaluation at step 2 stopped by SIGTERM (not recorded)" in caplog.text
    metrics = SignalledEvaluation(at=0)
    resumed = trainer_with(tmp_path / "run", metrics, max_steps=6, eval_every=2).fit()
    assert resumed["summary"]["preempted"] is None and resumed["progress"]["global_step"] == 6
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"] == [4, 6]


@pytest.mark.timeout(300)
def test_a_signal_during_the_final_evaluation_stops_at_once_and_a_resume_evaluates(tmp_path):
    metrics = SignalledEvaluation(at=2)
    trainer = trainer_with(tmp_path / "run", metrics, max_steps=4, eval_every=2, checkpoint_every=2)
    with pytest.raises(StopRequested, match=r"SIGTERM during the final evaluation \(step 4\): the newest checkpoint \(step 2\) is kept"):
        trainer.fit()
    assert metrics.batches[1] == 1
    assert summarize(tmp_path / "run")["step"] == 2  # no checkpoint of the finished run without its final evaluation
    finished = trainer_with(tmp_path / "run", SignalledEvaluation(at=0), max_steps=4, eval_every=2, checkpoint_every=2).fit()
    assert finished["summary"]["preempted"] is None and finished["eval"]["samples"] == 40
    assert summarize(tmp_path / "run")["step"] == 4


SLOW_SAVE = """
import sys, time
import ampddp.training.checkpointer as checkpointer
save = checkpointer.Checkpointer.save
def slow_save(self, *args, **kwargs):
    print("saving", flush=True)
    time.sleep(60)  # a large model's checkpoint on a slow file system
    return save(self, *args, **kwargs)
checkpointer.Checkpointer.save = slow_save
from ampddp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_second_ctrl_c_during_a_slow_save_ends_at_once_in_one_line(tmp_path):
    command = [sys.executable, "-c", SLOW_SAVE, "train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={tmp_path}",
               "model.name=mlp", "data.image_size=8", "trainer.max_steps=500", "trainer.log_every_steps=1", "trainer.progress=lines",
               "checkpoint.every_steps=null"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    while line and not line.startswith("step "):
        line = process.stdout.readline()
    process.send_signal(signal.SIGINT)
    while line and line.strip() != "saving":
        line = process.stdout.readline()
    time.sleep(1.5)  # a second press, not the first one arriving twice
    pressed = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, errors = process.communicate(timeout=120)
    assert time.monotonic() - pressed < 20, "the second Ctrl-C waited for the save"
    assert process.returncode == EXIT_INTERRUPTED, errors[-2000:]
    assert "Traceback" not in errors, errors[-3000:]
    assert errors.strip().splitlines()[-1] == (
        "ampddp train: stopped by SIGINT again: stopped at once; the newest complete checkpoint is kept, the same command resumes from it"
    )
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").glob("*/COMPLETE"))
