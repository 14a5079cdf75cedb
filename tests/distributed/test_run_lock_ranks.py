"""The run_dir lock with ranks started as torchrun starts them (env:// rendezvous, without torchrun's
agent, which would kill the others when one exits): a busy run_dir stops every rank at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampddp.distributed import free_port
from ampddp.errors import ConfigError
from ampddp.observe import read_metrics
from ampddp.rundir.lock import LOCK_FILE, RunDirLock

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SETTINGS = ["model.name=mlp", "data.image_size=8", "data.channels=1", "trainer.max_steps=5", "trainer.progress=off",
            "distributed.timeout_s=120"]  # fmt: skip
REFUSED = "is in use by another ampddp run"


def start_ranks(run_dir: Path, *extra: str) -> list[subprocess.Popen]:
    port = str(free_port())
    command = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SETTINGS, *extra]
    ranks = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        ranks.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return ranks


def finish(ranks: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every rank's stderr once all have exited (those still running after ``timeout`` are killed)."""
    try:
        return [rank.communicate(timeout=timeout)[1] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(path.relative_to(run_dir)): (path.stat().st_size, path.stat().st_mtime_ns, path.read_bytes())
            for path in sorted(run_dir.rglob("*"))}  # fmt: skip


@pytest.mark.timeout(300)
def test_every_rank_exits_2_at_once_with_one_line_when_another_run_holds_the_run_dir(tmp_path):
    with RunDirLock(tmp_path):
        before = snapshot(tmp_path)
        assert list(before) == [LOCK_FILE]
        started = time.monotonic()
        errors = finish(start_ranks(tmp_path), timeout=120)
        took = time.monotonic() - started
        after = snapshot(tmp_path)
    assert took < 60, f"the ranks took {took:.0f} s, as if waiting for distributed.timeout_s"
    for err in errors:
        assert "Traceback" not in err, err[-3000:]
        assert len(err.strip().splitlines()) == 1, err[-3000:]
    holder = f"{REFUSED} (pid {os.getpid()} on host {socket.gethostname()}, started "
    rank0, rank1 = (err.strip() for err in errors)
    assert rank0.startswith(f"ampddp train: error: trainer.run_dir={tmp_path} {holder}"), rank0
    stopped = "ampddp train: error: rank 0 could not take the run_dir lock, so rank 1 stops too: "
    assert rank1.startswith(f"{stopped}trainer.run_dir={tmp_path} {holder}"), rank1
    assert after == before, "a refused run wrote to the run_dir"


@pytest.mark.timeout(300)
def test_an_unlocked_run_dir_trains_with_rank_0_holding_the_lock_until_the_end(tmp_path):
    ranks = start_ranks(tmp_path)
    errors = finish(ranks, timeout=240)
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for err in errors]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (5, 2)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == ranks[0].pid
    with RunDirLock(tmp_path):  # released when the run ended
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.timeout(300)
def test_no_second_run_enters_while_any_rank_of_the_first_lives(tmp_path):
    ranks = start_ranks(tmp_path, "trainer.max_steps=100000", "trainer.max_epochs=100000")
    try:
        deadline = time.monotonic() + 120
        while not any(record["kind"] == "train" for record in read_metrics(tmp_path)):
            assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks), "the run never trained"
            time.sleep(0.05)
        ranks[0].kill()  # the rank that admitted the run: rank 1 lives on (until its collective times out)
        ranks[0].wait()
        with pytest.raises(ConfigError, match=REFUSED), RunDirLock(tmp_path):
            pass
        ranks[1].kill()
        ranks[1].wait()
        with RunDirLock(tmp_path):  # the last rank gone: the run dir is free
            pass
    finally:
        finish(ranks, timeout=1)
