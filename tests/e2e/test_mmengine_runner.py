"""mmengine's Runner with ``ApexOptimWrapper``, unchanged, under ``python -m ampddp.apex``.

mmengine still imports ``apex.amp`` at HEAD. Its wrapper calls ``amp.initialize`` inside the first
iteration until ``optimizer._amp_stash`` exists, on ``model.module`` of a DDP wrapper built before it,
and saves/loads ``apex_amp.state_dict()`` with its checkpoints. Each level must train, checkpoint and
resume to exactly the uninterrupted run on 1 process; on 2 processes the levels with fp32 masters and a
cast model (O2, O5) keep the ranks identical and resume exactly too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mmengine", reason="mmengine is not installed (pip install -e '.[test]' installs it)")

JOB = Path(__file__).resolve().parents[1] / "mmengine_job.py"
REPO = Path(__file__).resolve().parents[2]
RESUME_ENV = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
"""mmengine 0.10.7 pickles its own classes into checkpoints and loads them with torch.load's default,
which is weights-only from torch 2.6 on: its resume needs this (or safe globals) with or without ampddp."""


def run_job(tmp_path, name, opt_level, *extra, nproc=1, env=None):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    args = [sys.executable, *launcher, "-m", "ampddp.apex", str(JOB), "--opt-level", opt_level, "--out", str(out), *extra]
    merged = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    merged.pop("WORLD_SIZE", None)
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=400, env=merged)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O4", "O5"])
def test_a_runner_job_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(tmp_path, opt_level):
    (straight,) = run_job(tmp_path, "straight", opt_level, "--work-dir", str(tmp_path / "w1"))
    run_job(tmp_path, "first", opt_level, "--work-dir", str(tmp_path / "w2"), "--iters", "4")
    (resumed,) = run_job(tmp_path, "resumed", opt_level, "--work-dir", str(tmp_path / "w2"), "--resume", env=RESUME_ENV)
    assert straight["iter"] == resumed["iter"] == 8
    assert resumed["losses"] == straight["losses"][4:]
    assert resumed["params"] == straight["params"] and resumed["masters"] == straight["masters"]
    assert resumed["amp_state"] == straight["amp_state"]
    assert straight["has_stash"]
    low = {"O2": "torch.float16", "O5": "torch.bfloat16"}.get(opt_level)
    assert straight["dtypes"] == (sorted([low, "torch.float32"]) if low else ["torch.float32"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("opt_level", ["O2", "O5"])  # the levels with masters and a cast model; every level resumes above
def test_two_processes_wrapped_before_initialize_stay_identical_and_resume_to_the_uninterrupted_run(tmp_path, opt_level):
    straight = run_job(tmp_path, "straight", opt_level, "--work-dir", str(tmp_path / "w1"), nproc=2)
    first, second = straight
    assert first["params"] == second["params"] and first["masters"] == second["masters"]
    assert first["losses"] != second["losses"]  # each rank saw its own shard
    assert first["amp_state"] == second["amp_state"]
    run_job(tmp_path, "first", opt_level, "--work-dir", str(tmp_path / "w2"), "--iters", "4", nproc=2)
    resumed = run_job(tmp_path, "resumed", opt_level, "--work-dir", str(tmp_path / "w2"), "--resume", nproc=2, env=RESUME_ENV)
    for a, b in zip(straight, resumed):
        assert b["params"] == a["params"] and b["masters"] == a["masters"] and b["losses"] == a["losses"][4:]
