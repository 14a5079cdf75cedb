"""What a run prints: one line per set-up (every setting only with --verbose), and a run that raises
releases what its reporting opened (the loggers are told it failed)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from resume_helpers import NoisyDigits, make_model

from ampddp.cli import main
from ampddp.observe import Reporting
from ampddp.observe.loggers import MetricLogger
from ampddp.trainer import Trainer
from ampddp.training import Callback, CheckpointSettings

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
SHORT = ["trainer.max_steps=1", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=off", "model.name=mlp",
         "precision.mode=O1"]  # fmt: skip


@pytest.mark.parametrize("verbose", [False, True])
def test_a_set_up_prints_one_line_and_every_setting_only_when_verbose(tmp_path, caplog, monkeypatch, verbose):
    monkeypatch.setenv("AMPDDP_LOG_LEVEL", "")  # --verbose sets it for the ranks it starts: monkeypatch undoes it after the test
    caplog.set_level(logging.INFO)  # the root's level, as the command sets it
    caplog.handler.setLevel(logging.DEBUG)  # and a handler that would print debug records, were any made
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={tmp_path}", *SHORT, *(["--verbose"] if verbose else [])]) == 0
    printed = "\n".join(record.getMessage() for record in caplog.records)
    assert "precision O1: float16 ops per apex's lists, fp32 weights, dynamic loss scale from 65536" in printed
    assert ("precision O1 settings: {'opt_level': 'O1'" in printed) is verbose
    assert logging.getLogger("ampddp").level == logging.NOTSET, "the run's log level ends with it"


class Recording(MetricLogger):
    name = "recording"

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def log(self, kind, values, step) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


class Fails(Callback):
    def on_step(self, progress, record) -> None:
        raise RuntimeError("a user's callback failed")


def test_a_run_that_raises_tells_its_loggers_and_leaves_no_progress_bar_or_log_redirect_behind(tmp_path):
    handlers = list(logging.getLogger().handlers)
    sink = Recording()
    trainer = Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision="O0", batch_size=8,
                      max_steps=2, checkpoints=CheckpointSettings(tmp_path), callbacks=[Fails()],
                      report=Reporting(progress="bar", loggers=(sink,)))  # fmt: skip
    with pytest.raises(RuntimeError, match="a user's callback failed"):
        trainer.fit()
    assert sink.closed == [True]
    assert logging.getLogger().handlers == handlers


@pytest.mark.timeout(300)
def test_the_first_lines_say_where_the_run_writes_its_precision_device_and_data_and_step_1_shows_at_once_in_a_log(tmp_path):
    import subprocess
    import sys

    command = [sys.executable, "-m", "ampddp", "train", str(QUICKSTART), f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=3",
               "trainer.log_every_steps=20", "data.batch_size=8", "data.eval_fraction=0.05", "model.name=mlp",
               "precision.mode=native-bf16"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)  # piped, as into a log file or CI
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stderr + done.stdout).splitlines()
    first = "\n".join(lines[:6])
    assert f"run dir {tmp_path / 'run'}: checkpoints/, metrics.jsonl, summary.json, plots" in first, first
    assert "precision native-bf16: torch.autocast bfloat16 on cpu (torch's op lists), fp32 weights, no loss scaling" in first, first
    assert "data: 1707 training samples, 90 held out; 8 a step (batch 8), 214 steps an epoch; ends at step 3 (3 steps)" in first, first
    assert any(line.startswith("device cpu: ") and "cudnn" not in line and "tf32" not in line.lower() for line in lines[:6]), first
    assert any(line.startswith("step 1 epoch ") for line in lines), "no progress line at the first step of a piped run"


def test_each_record_carries_the_mean_loss_of_the_steps_since_the_one_before(tmp_path):
    from ampddp.observe import read_metrics

    def losses(run_dir, log_every):
        Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(64), precision="O0", batch_size=8, max_steps=6,
                log_every=log_every, seed=3, run_dir=run_dir, report=Reporting(progress="off", plots=False)).fit()  # fmt: skip
        return {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}

    every = losses(tmp_path / "every", 1)
    assert all(record["loss_mean"] == record["loss"] for record in every.values())
    windows = losses(tmp_path / "windows", 3)
    assert sorted(windows) == [1, 3, 6]  # the first step this run trains, then every 3rd
    for step, previous in ((1, 0), (3, 1), (6, 3)):
        expected = sum(every[s]["loss"] for s in range(previous + 1, step + 1)) / (step - previous)
        assert windows[step]["loss_mean"] == pytest.approx(expected, rel=1e-12) and windows[step]["loss"] == every[step]["loss"]


@pytest.mark.timeout(300)
def test_other_libraries_notes_stay_off_the_console_their_first_error_is_one_line_and_all_go_to_the_runs_log_file(tmp_path):
    import os
    import subprocess
    import sys

    repo = QUICKSTART.parents[1]
    command = [sys.executable, "-m", "ampddp", "train", str(QUICKSTART), f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=2",
               "data.name=user_parts:chatty_blobs", "model.name=user_parts:build", "model.num_classes=3",
               "model.kwargs={in_features: 8, hidden: 8}", "data.batch_size=8", "precision.mode=O0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo / "tests")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in (done.stderr + done.stdout).splitlines() if "somelib" in line]
    assert said == ["somelib reported an error: somelib: could not record the blobs; the run goes on (its full report is in the run's "
                    "log file, ampddp.log in the run dir; further errors of it only there)"], said  # fmt: skip
    assert "Traceback" not in done.stderr
    log = (tmp_path / "run" / "ampddp.log").read_text()
    assert "INFO somelib: somelib: loaded 96 blobs from the cache" in log and "WARNING somelib: somelib: calling load()" in log
    assert "OSError: attempt 1: attempt to write a readonly database" in log and "OSError: attempt 2:" in log
    assert "INFO ampddp.precision: precision O0: fp32 throughout" in log and "ampddp.observe: run dir " in log
    verbose = subprocess.run([*command[:6], f"trainer.run_dir={tmp_path / 'verbose'}", *command[7:], "--verbose"],
                             capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert verbose.returncode == 0 and "somelib: loaded 96 blobs" in verbose.stderr, verbose.stderr[-3000:]


@pytest.mark.timeout(300)
def test_a_closed_stdout_and_a_full_stderr_end_the_console_not_the_run(tmp_path):
    """``ampddp train ... | head -1`` with stderr on a full device: the run trains to its end and exits 0."""
    import os
    import subprocess
    import sys

    repo = QUICKSTART.parents[1]
    command = [sys.executable, "-m", "ampddp", "train", str(QUICKSTART), f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=40",
               "data.name=user_parts:blobs", "model.name=user_parts:build", "model.num_classes=3", "trainer.log_every_steps=1",
               "trainer.progress=lines", "model.kwargs={in_features: 8, hidden: 8}", "data.batch_size=8", "precision.mode=O0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo / "tests")])}
    with open(os.devnull if not Path("/dev/full").exists() else "/dev/full", "w") as full:
        run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=full, text=True, env=env)
        assert run.stdout.readline().startswith("step 1 ")
        run.stdout.close()  # as `| head -1` does
        assert run.wait(timeout=240) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 40
    log = (tmp_path / "run" / "ampddp.log").read_text()
    assert "the console's stdout cannot be written (Broken pipe, errno 32): nothing more is shown there; the run goes on" in log
    if Path("/dev/full").exists():
        assert "the console's stderr cannot be written (No space left on device, errno 28)" in log


LIBRARY_RUN = """
import logging, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from ampddp import Trainer
if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.WARNING)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
for _ in range(2):  # the second start finds the run complete
    Trainer(nn.Linear(8, 3), lambda p: torch.optim.SGD(p, lr=0.1), data, batch_size=16, max_steps=2, precision="O0",
            run_dir=sys.argv[1], report=None if sys.argv[2] == "silent" else Trainer.__init__.__kwdefaults__["report"]).fit()
"""


@pytest.mark.timeout(180)
def test_a_script_using_the_trainer_is_told_what_the_command_line_says_unless_it_configured_logging_or_asked_for_silence(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(QUICKSTART.parents[1] / "src")}
    said = {}
    for how in ("default", "configured", "silent"):
        done = subprocess.run([sys.executable, "-c", LIBRARY_RUN, str(tmp_path / how), how], capture_output=True, text=True, timeout=120,
                              env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        said[how] = done.stderr
    assert "precision O0: fp32 throughout" in said["default"] and f"run dir {tmp_path / 'default'}: " in said["default"]
    assert "already complete at step 2" in said["default"]
    assert "precision O0" not in said["configured"] and "already complete" not in said["configured"]
    assert said["silent"].strip() == ""
