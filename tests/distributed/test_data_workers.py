"""Loader workers change nothing but speed: the same model for 0, 1 and 2 workers in 1 process and
for 0 and 2 in 2 processes, and a SIGTERM to the whole process group mid-epoch, workers included, checkpoints and
resumes to the uninterrupted result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.checkpoint.inspect import summarize
from ampddp.observe import read_metrics
from ampddp.preemption import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SMALL = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "data.augment=true", "precision.mode=O4",
         "trainer.log_every_steps=5", "trainer.progress=lines", "checkpoint.every_steps=null", "trainer.max_epochs=100"]  # fmt: skip


def train(run_dir: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SMALL, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("processes", [1, 2])
def test_the_trained_model_is_the_same_for_0_and_2_workers(tmp_path, processes):
    digests = {}
    counts = (0, 2)  # no workers against two (per rank): the loader paths differ; 2 ranks of 2 workers interleave as much as any
    for workers in counts:
        run_dir = tmp_path / f"workers-{workers}"
        done = train(run_dir, f"data.num_workers={workers}", f"distributed.nproc_per_node={processes}", "trainer.max_steps=60")
        assert done.returncode == 0, done.stderr[-3000:]
        digests[workers] = summarize(run_dir)["model_sha256"]
        records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
        assert records and all(r["data_wait_s"] >= 0 for r in records)
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 60
    assert len(set(digests.values())) == 1, digests


@pytest.mark.timeout(900)
def test_sigterm_mid_epoch_with_workers_resumes_to_the_uninterrupted_model(tmp_path):
    steps = ["trainer.max_steps=300"]
    straight = train(tmp_path / "straight", "data.num_workers=0", *steps)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "interrupted"
    command = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SMALL, "data.num_workers=2", *steps]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, start_new_session=True)
    line = process.stdout.readline()
    while line and not line.startswith("step 10 "):  # mid-epoch: 85 steps per epoch
        line = process.stdout.readline()
    os.killpg(process.pid, signal.SIGTERM)  # as a scheduler does: the loader workers receive it too
    process.stdout.read()
    assert process.wait(timeout=120) == EXIT_PREEMPTED
    stopped_at = summarize(run_dir)["step"]
    assert 10 <= stopped_at < 300 and stopped_at % 85 != 0
    resumed = train(run_dir, "data.num_workers=2", *steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summarize(run_dir)["model_sha256"] == summarize(tmp_path / "straight")["model_sha256"]
