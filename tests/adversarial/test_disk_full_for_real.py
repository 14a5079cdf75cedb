"""A real full disk (a small tmpfs mounted for the test, so root only): the save that does not fit
stops the run with one line and exit 5, nothing torn is left to trust, and once space is freed the
same command finishes the run with every log record whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.cli import EXIT_IO, main
from ampddp.observe import read_metrics
from ampddp.rundir.files import METRICS_FILE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_a_full_disk_stops_with_the_io_code_and_the_same_command_finishes_after_space_is_freed(small_disk, capsys):
    filler = small_disk / "filler"
    filler.write_bytes(bytes(1024 * 1024 - 96 * 1024))  # ~96 KiB left: the run starts, its first checkpoint cannot fit
    run_dir = small_disk / "run"
    command = ["train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}", "trainer.max_steps=3",
               "checkpoint.every_steps=1", "data.batch_size=8", "trainer.log_every_steps=1", "trainer.progress=lines",
               "optimizer.scheduler=none"]  # fmt: skip
    assert main(command) == EXIT_IO
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ampddp train: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0]
    assert not list((run_dir / "checkpoints").glob("step-*/COMPLETE"))  # nothing half-written counts as a checkpoint
    filler.unlink()
    assert main(command) == 0
    assert all(json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines())
    assert max(record["step"] for record in read_metrics(run_dir)) == 3


def fill(folder: Path) -> Path:
    """Every free byte of ``folder``'s file system taken by one file (returned, to free them again)."""
    filler = folder / "filler-late"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


@pytest.mark.timeout(600)
def test_a_disk_that_fills_while_metrics_are_appended_stops_with_the_io_code_and_a_readable_log(small_disk):
    run_dir = small_disk / "run"
    command = [sys.executable, "-m", "ampddp", "train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}",
               "trainer.max_steps=300", "trainer.max_epochs=100", "checkpoint.every_steps=null", "model.name=mlp", "data.image_size=8",
               "data.batch_size=8", "trainer.log_every_steps=1", "trainer.progress=lines", "optimizer.scheduler=none"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    while line and not line.startswith("step "):
        line = process.stdout.readline()
    filler = fill(small_disk)
    _, errors = process.communicate(timeout=240)
    assert process.returncode == EXIT_IO, errors[-3000:]
    said = [line for line in errors.splitlines() if line.startswith("ampddp train: error:")]
    assert "Traceback" not in errors and len(said) == 1 and "No space left on device" in said[0], errors[-3000:]
    filler.unlink()
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert all(json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines())
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, 301))
