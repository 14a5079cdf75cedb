"""Ranks started with different settings stop at once, every one of them, with one line naming the
differing keys; agreeing ranks train as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.distributed import free_port
from ampddp.recipe.rank_agreement import flatten_settings

REPO = Path(__file__).resolve().parents[2]
WRAPPER = """
import os, sys
from ampddp.cli import main
rank = int(os.environ["RANK"])
lr = {lrs!r}[rank]
sys.exit(main(["train", {recipe!r}, "trainer.run_dir={run_dir}", f"optimizer.lr={{lr}}", "trainer.max_steps=2",
               "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=lines"]))
"""


def test_flattened_settings_use_the_override_spelling():
    flat = flatten_settings({"optimizer": {"lr": 0.1, "name": "sgd"}, "seed": 3})
    assert flat == {"optimizer.lr": 0.1, "optimizer.name": "sgd", "seed": 3}


def torchrun(tmp_path: Path, lrs: tuple[float, float]) -> subprocess.CompletedProcess:
    script = tmp_path / "per_rank.py"
    run_dir = tmp_path / "run"
    script.write_text(WRAPPER.format(lrs=lrs, recipe=str(REPO / "recipes" / "quickstart.yaml"), run_dir=run_dir))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.timeout(400)
def test_ranks_with_different_settings_all_stop_naming_the_key(tmp_path):
    done = torchrun(tmp_path, (0.05, 0.5))
    assert done.returncode != 0
    # every rank stops with the same one line (the two ranks' lines may interleave in the shared stderr)
    assert done.stderr.count("ampddp train: error: the ranks were started with different settings") == 2, done.stderr[-3000:]
    assert done.stderr.count("rank 1 has optimizer.lr=0.5 (rank 0: 0.05)") == 2
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.timeout(400)
def test_ranks_with_the_same_settings_train(tmp_path):
    done = torchrun(tmp_path, (0.05, 0.05))
    assert done.returncode == 0, done.stderr[-3000:]
