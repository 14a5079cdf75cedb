"""A rank killed mid-run: ``ampddp train`` says which rank failed in one line and exits with
EXIT_PEER_FAILURE, on which a scheduler can requeue the job (resuming is tested in test_preemption) —
a rank started as torchrun starts it, and a run spawning its own ranks (distributed.nproc_per_node).
A rank alive but stuck in its data set is named with where it is; a killed launcher leaves no rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampddp.cli import EXIT_PEER_FAILURE
from ampddp.distributed import free_port
from ampddp.observe import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SETTINGS = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "trainer.log_every_steps=1",
            "trainer.progress=off", "checkpoint.every_steps=2", "trainer.max_steps=400", "trainer.max_epochs=100",
            "precision.mode=native-bf16", "distributed.timeout_s=10"]  # fmt: skip


def start_rank(rank: int, port: int, run_dir: Path) -> subprocess.Popen:
    """One rank as torchrun starts it (env:// rendezvous), without torchrun's restarts and kills."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    return subprocess.Popen(train_command(run_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def train_command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SETTINGS, *extra]


def wait_for_step(run_dir: Path, step: int, ranks: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 180
    while not any(r["kind"] == "train" and r["step"] >= step for r in read_metrics(run_dir)):
        assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks), "the run never reached its step"
        time.sleep(0.05)


@pytest.mark.timeout(400)
def test_the_survivor_of_a_killed_rank_exits_4_with_one_line_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    ranks = [start_rank(rank, port, run_dir) for rank in (0, 1)]
    try:
        wait_for_step(run_dir, 10, ranks)
        ranks[1].send_signal(signal.SIGKILL)
        _, err = ranks[0].communicate(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
    assert ranks[0].returncode == EXIT_PEER_FAILURE == 4, err[-3000:]
    assert_one_line_naming(err, "rank 1")


def assert_one_line_naming(err: str, who: str) -> None:
    last = err.strip().splitlines()[-1]
    assert last.startswith("ampddp train: error: training stopped: "), err[-3000:]
    assert who in last and last.endswith("the same command resumes the run from its newest complete checkpoint"), last
    assert "Traceback" not in err, err[-3000:]


def spawned_ranks(launcher: int) -> list[int]:
    """The launcher's rank processes (multiprocessing spawn children; not its resource tracker)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the spawned ranks through /proc")
def test_a_run_that_spawns_its_ranks_exits_4_when_one_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(train_command(run_dir, "distributed.nproc_per_node=2"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    try:
        wait_for_step(run_dir, 10, [launcher])
        victims = spawned_ranks(launcher.pid)
        assert len(victims) == 2, victims
        os.kill(victims[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
        launcher.communicate()
    assert launcher.returncode == EXIT_PEER_FAILURE, err[-3000:]
    assert_one_line_naming(err, "was killed by SIGKILL before finishing")


@pytest.mark.timeout(300)
def test_a_rank_stuck_in_its_data_set_is_named_with_where_it_is(tmp_path):
    stuck = ["data.name=user_parts:stuck_blobs", "model.name=user_parts:build", "model.num_classes=3",
             "model.kwargs={in_features: 8, hidden: 8}", "distributed.nproc_per_node=2", "distributed.timeout_s=6"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    done = subprocess.run(train_command(tmp_path / "run", *stuck), capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert done.returncode == EXIT_PEER_FAILURE, done.stderr[-3000:]
    assert_one_line_naming(done.stderr, "rank 1 has been in loading data for step ")
    assert "a peer is alive but not progressing" in done.stderr


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the spawned ranks through /proc")
def test_a_killed_launcher_leaves_no_rank_alive(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(train_command(run_dir, "distributed.nproc_per_node=2", "trainer.max_steps=100000"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
    try:
        wait_for_step(run_dir, 3, [launcher])
        ranks = spawned_ranks(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in ranks):
            assert time.monotonic() < deadline, "a rank outlived its killed launcher by 10 s"
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.wait()
