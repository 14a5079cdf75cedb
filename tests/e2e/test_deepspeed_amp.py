"""DeepSpeed's ``"amp"`` config section, unchanged, under ``python -m ampddp.apex``.

DeepSpeed calls ``amp.initialize(module, optimizer, **amp)`` itself, backs up with ``scale_loss``
(``delay_unscale`` inside gradient accumulation), all-reduces the model's gradients and clips on
``amp.master_params``. The versions that carry that path and still run it are DeepSpeed <= 0.18.2
(0.18.3-0.19.7 stop on their own assertion, "Apex AMP is not supported with non-scalar backward";
0.19.8 refuses the "amp" key). CI installs 0.18.2; without DeepSpeed these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install --no-build-isolation 'deepspeed==0.18.2')")

JOB = Path(__file__).resolve().parents[1] / "deepspeed_job.py"
REPO = Path(__file__).resolve().parents[2]


def run_job(tmp_path, level, name):
    out = tmp_path / name
    out.mkdir()
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = [sys.executable, *launcher, "-m", "ampddp.apex", str(JOB), level, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=400, env=env), out


@pytest.mark.timeout(600)
def test_the_amp_section_at_o1_keeps_ranks_identical_and_close_to_fp32(tmp_path):
    done, out = run_job(tmp_path, "O1", "o1")
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    assert first["params"] == second["params"]
    done, reference_out = run_job(tmp_path, "off", "fp32")
    assert done.returncode == 0, done.stderr[-4000:]
    reference = json.loads((reference_out / "rank0.json").read_text())
    for got, want in zip(first["params"], reference["params"]):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=5e-3, rtol=5e-3)


@pytest.mark.timeout(600)
def test_the_amp_section_with_master_weights_on_several_ranks_is_refused_in_one_line(tmp_path):
    done, _ = run_job(tmp_path, "O2", "o2")
    assert done.returncode != 0
    assert 'AmpUsageError: DeepSpeed\'s "amp" section with fp32 master weights (O2/O5) on several ranks' in done.stderr
    assert '"opt_level": "O1"' in done.stderr
