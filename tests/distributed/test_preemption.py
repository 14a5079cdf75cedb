"""Preemption: SIGTERM and Ctrl-C at random moments, SIGKILL under torchrun --max-restarts, failing saves."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resume_helpers import NoisyDigits, make_trainer

from ampddp import Parallel
from ampddp.checkpoint.inspect import summarize
from ampddp.distributed import free_port
from ampddp.errors import CheckpointError
from ampddp.observe import read_metrics
from ampddp.preemption import EXIT_INTERRUPTED, EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SMALL = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "data.augment=true",
         "trainer.log_every_steps=1", "trainer.progress=lines", "checkpoint.every_steps=null", "optimizer.scheduler=cosine"]  # fmt: skip


def train_command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SMALL, *extra]


@pytest.mark.timeout(400)
def test_sigterm_sighup_and_ctrl_c_at_random_moments_checkpoint_exit_75_or_130_and_resume_bit_exactly(tmp_path):
    steps = ["trainer.max_steps=600", "trainer.max_epochs=100", "precision.mode=O2"]
    straight = subprocess.run(train_command(tmp_path / "straight", *steps), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]
    rng = random.Random(1)
    run_dir = tmp_path / "interrupted"
    preemptions = 0
    for attempt in range(4):  # SIGTERM twice, SIGINT, SIGHUP (a closed terminal), SIGINT then SIGTERM
        process = subprocess.Popen(train_command(run_dir, *steps), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = process.stdout.readline()
        while line and not line.startswith("step "):
            line = process.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.3))
        sig = signal.SIGINT if attempt % 2 else (signal.SIGHUP if attempt == 2 else signal.SIGTERM)  # each checkpoints as SIGTERM does
        process.send_signal(sig)
        if attempt % 3 == 0:
            time.sleep(0.01)
            process.send_signal(signal.SIGTERM)  # a second signal during the save must not corrupt it
        process.stdout.read()
        code = process.wait(timeout=120)
        assert code == (EXIT_INTERRUPTED if sig == signal.SIGINT else EXIT_PREEMPTED), f"attempt {attempt}: exit status {code}"
        preemptions += 1
        assert summarize(run_dir)["step"] < 600
    assert preemptions == 4
    finished = subprocess.run(train_command(run_dir, *steps), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert summarize(run_dir)["model_sha256"] == summarize(tmp_path / "straight")["model_sha256"]


def worker_pids(launcher_pid: int) -> list[int]:
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    return [int(pid) for pid in children]


TORCHRUN_STEPS = ["trainer.max_steps=120", "trainer.max_epochs=100", "precision.mode=native-bf16", "checkpoint.every_steps=1",
                  "checkpoint.keep_last=2", "distributed.timeout_s=30"]  # fmt: skip


def torchrun(run_dir: Path, *launcher_flags: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *launcher_flags, "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "ampddp", "train"]  # fmt: skip
    return [*launcher, RECIPE, f"trainer.run_dir={run_dir}", *SMALL, *TORCHRUN_STEPS]


@pytest.fixture(scope="module")
def uninterrupted_torchrun(tmp_path_factory) -> str:
    """model_sha256 of the 2-process run that nothing interrupts."""
    run_dir = tmp_path_factory.mktemp("straight")
    reference = subprocess.run(torchrun(run_dir), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    return summarize(run_dir)["model_sha256"]


def kill_one_worker_mid_epoch(job: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while not any(r["step"] >= 40 for r in read_metrics(run_dir) if r["kind"] == "train"):
        assert time.monotonic() < deadline and job.poll() is None, "the job never reached step 40"
        time.sleep(0.05)
    victims = worker_pids(job.pid)
    assert len(victims) == 2
    os.kill(victims[1], signal.SIGKILL)


def assert_every_step_applied_once(run_dir: Path, resumes: int) -> None:
    """The kill came after step 40 was logged, so the run resumed from step 39 (its checkpoint) or later."""
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 121)), "no optimizer step lost or applied twice"
    resumed_at = [r["step"] for r in records if r["kind"] == "start" and r["step"] > 0]
    assert len(resumed_at) == resumes and all(39 <= step < 120 for step in resumed_at), resumed_at


@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
def test_torchrun_max_restarts_survives_a_killed_worker_without_losing_a_step(tmp_path, uninterrupted_torchrun):
    run_dir = tmp_path / "killed"
    job = subprocess.Popen(torchrun(run_dir, "--max-restarts", "1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_one_worker_mid_epoch(job, run_dir)
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output[-3000:]
    assert_every_step_applied_once(run_dir, resumes=1)
    assert summarize(run_dir)["model_sha256"] == uninterrupted_torchrun


@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
def test_a_job_launched_again_after_a_killed_worker_loses_no_step(tmp_path, uninterrupted_torchrun):
    """Without --max-restarts the job fails; the same command again (a SLURM requeue) finishes it."""
    run_dir = tmp_path / "killed"
    job = subprocess.Popen(torchrun(run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_one_worker_mid_epoch(job, run_dir)
    job.communicate(timeout=300)
    assert job.returncode != 0
    assert 39 <= summarize(run_dir)["step"] < 120  # step 40 logged: its checkpoint may be unfinished
    again = subprocess.run(torchrun(run_dir), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_every_step_applied_once(run_dir, resumes=1)
    assert summarize(run_dir)["model_sha256"] == uninterrupted_torchrun


def test_a_failing_checkpoint_write_stops_training_instead_of_continuing_silently(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "O0", max_steps=6, checkpoint_every=2)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ampddp.checkpoint.files.os.replace", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        trainer.fit()
    assert trainer.progress.global_step == 2


def test_stop_signals_are_validated():
    from ampddp import ConfigError

    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal name"):
        make_trainer(Path("/tmp/unused-run"), "O0", max_steps=1, stop_signals=("SIGNOPE",))
    assert json.dumps(EXIT_PREEMPTED) == "75"


def test_metrics_history_drops_steps_a_resume_went_back_over(tmp_path):
    lines = [{"kind": "start", "step": 0}] + [{"kind": "train", "step": s} for s in (1, 2, 3)] + [{"kind": "start", "step": 0}]
    lines += [{"kind": "train", "step": s} for s in (1, 2, 3, 4)] + [{"kind": "eval", "step": 4}, {"kind": "start", "step": 2}]
    lines += [{"kind": "train", "step": s} for s in (3, 4, 5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    history = read_metrics(tmp_path)
    expected = [("start", 0), ("start", 0), ("train", 1), ("train", 2), ("start", 2), ("train", 3), ("train", 4), ("train", 5)]
    assert [(r["kind"], r["step"]) for r in history] == expected


def eval_signal_worker(env, run_dir: str, strategy: str) -> dict:
    """Rank 0 alone receives SIGTERM at the first batch of the first evaluation; both ranks count the
    evaluation batches they went through."""
    batches = []

    def metrics(outputs, batch):
        batches.append(1)
        if env.rank == 0 and len(batches) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"accuracy": (outputs.argmax(1) == batch[1]).sum()}

    trainer = make_trainer(Path(run_dir), "O0", max_steps=6, env=env, eval_set=NoisyDigits(80), metrics=metrics, eval_every=2,
                           stop_signals=("SIGTERM",), parallel=Parallel(strategy=strategy))  # fmt: skip
    result = trainer.fit()
    return {"preempted": result["summary"]["preempted"], "step": result["progress"]["global_step"], "batches": len(batches)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_signal_on_one_rank_during_an_evaluation_stops_every_rank_at_the_same_batch(tmp_path, strategy):
    from ampddp.distributed import launch_local

    results = launch_local(eval_signal_worker, 2, (str(tmp_path / "run"), strategy), device="cpu", timeout_s=60, job_timeout_s=240)
    assert [r["preempted"] for r in results] == ["SIGTERM", "a stop signal on another rank"]
    assert [r["step"] for r in results] == [2, 2] and summarize(tmp_path / "run")["step"] == 2
    assert [r["batches"] for r in results] == [1, 1], "the ranks left the evaluation at different batches"
