"""A rank killed mid-run: the survivor of ``ampddp train`` says which rank failed in one line and
exits with EXIT_PEER_FAILURE, on which a scheduler can requeue the job (resuming is tested in test_preemption)."""

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
    command = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SETTINGS]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


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
    last = err.strip().splitlines()[-1]
    assert last.startswith("ampddp train: error: training stopped: "), err[-3000:]
    assert "rank 1" in last and last.endswith("the same command resumes the run from its newest complete checkpoint")
    assert "Traceback" not in err
