"""One writer per run_dir: the lock itself, and a second ``ampddp train`` on a busy run_dir."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.checkpoint.inspect import summarize
from ampddp.errors import ConfigError
from ampddp.observe import read_metrics
from ampddp.rundir import lock as run_lock
from ampddp.rundir.lock import LOCK_FILE, RunDirLock

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SMALL = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "trainer.log_every_steps=1",
         "trainer.progress=lines", "checkpoint.every_steps=10", "optimizer.scheduler=cosine"]  # fmt: skip
REFUSED = "is in use by another ampddp run"
TRY_LOCK = """
import sys
from ampddp.errors import ConfigError
from ampddp.rundir.lock import RunDirLock
try:
    with RunDirLock(sys.argv[1]):
        print("acquired", flush=True)
        if len(sys.argv) > 2:
            sys.stdin.readline()  # hold until the test kills us
except ConfigError as error:
    print(error, flush=True)
    sys.exit(2)
"""


def try_lock(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY_LOCK, str(run_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_a_held_lock_refuses_another_process_naming_the_holder_and_is_free_after_release(tmp_path):
    with RunDirLock(tmp_path):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        refused = try_lock(tmp_path)
        assert refused.returncode == 2, refused.stderr
        message = refused.stdout.strip()
        assert len(message.splitlines()) == 1
        assert message.startswith(f"trainer.run_dir={tmp_path} {REFUSED} (pid {os.getpid()} on host {socket.gethostname()}, started ")
        assert message.endswith("wait for it to finish, stop it, or use another run_dir")
    assert (tmp_path / LOCK_FILE).is_file()
    later = try_lock(tmp_path)
    assert later.returncode == 0 and later.stdout == "acquired\n", later.stderr
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_second_acquisition_in_the_same_process_is_refused_too(tmp_path):
    with RunDirLock(tmp_path), pytest.raises(ConfigError, match=f"{REFUSED} \\(pid {os.getpid()} "):
        RunDirLock(tmp_path).__enter__()


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", TRY_LOCK, str(tmp_path), "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)  # fmt: skip
    try:
        assert holder.stdout.readline() == "acquired\n"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on host"):
            RunDirLock(tmp_path).__enter__()
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    with RunDirLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def train_command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SMALL, *extra]


def snapshot(run_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(path.relative_to(run_dir)): (path.stat().st_size, path.stat().st_mtime_ns, path.read_bytes())
            for path in sorted(run_dir.rglob("*")) if path.is_file()}  # fmt: skip


def start_and_freeze(command: list[str]) -> subprocess.Popen:
    """Start a run in its own process group, wait for its first step line, then SIGSTOP the group:
    it keeps holding the lock while nothing of it can touch the run_dir."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, start_new_session=True)
    line = process.stdout.readline()
    while line and not line.startswith("step "):
        line = process.stdout.readline()
    assert line, f"the first run ended before its first step (exit status {process.wait(timeout=60)})"
    os.killpg(process.pid, signal.SIGSTOP)
    return process


def assert_refused(command: list[str], run_dir: Path, holder_pid: int) -> None:
    """A second run on ``run_dir`` exits 2 quickly with one stderr line and changes no file there."""
    before = snapshot(run_dir)
    second = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ampddp train: error: trainer.run_dir={run_dir} {REFUSED} (pid {holder_pid} on host "), lines
    assert snapshot(run_dir) == before


@pytest.mark.timeout(300)
def test_a_second_train_on_a_busy_run_dir_exits_2_and_the_first_finishes_as_if_alone(tmp_path):
    steps = ["trainer.max_steps=40"]
    straight = subprocess.run(train_command(tmp_path / "straight", *steps), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert straight.returncode == 0, straight.stderr[-2000:]
    run_dir = tmp_path / "shared"
    first = start_and_freeze(train_command(run_dir, *steps))
    try:
        assert_refused(train_command(run_dir, *steps), run_dir, first.pid)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    first.stdout.read()
    assert first.wait(timeout=240) == 0
    assert summarize(run_dir)["model_sha256"] == summarize(tmp_path / "straight")["model_sha256"]
    assert sum(record.get("kind") == "start" for record in read_metrics(run_dir)) == 1


@pytest.mark.timeout(300)
def test_spawned_workers_run_under_the_parents_lock(tmp_path):
    command = train_command(tmp_path, "distributed.nproc_per_node=2", "trainer.max_steps=100000", "trainer.max_epochs=1000")
    first = start_and_freeze(command)
    try:
        assert_refused(command, tmp_path, first.pid)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.stdout.read()
        first.wait(timeout=60)
    with RunDirLock(tmp_path):  # neither the killed parent nor its killed workers keep it
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_filesystem_that_cannot_lock_logs_a_warning_and_runs_unlocked(tmp_path, monkeypatch, caplog):
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    with RunDirLock(tmp_path):
        assert "its filesystem cannot lock files" in caplog.text
