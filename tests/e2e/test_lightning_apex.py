"""PyTorch Lightning 1.x's apex backend (``ApexMixedPrecisionPlugin``), unedited, under ``python -m
ampddp.apex`` (``tests/lightning_apex_job.py``). Lightning 2 removed it; 1.9.5, the last 1.x, imports
on today's torch with setuptools < 81 (it reads ``pkg_resources``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

lightning = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning 1.x is installed by CI (.ci/run), not by the test extra")
if not lightning.__version__.startswith("1."):
    pytest.skip(f"pytorch_lightning {lightning.__version__} has no apex backend (1.x has it)", allow_module_level=True)

JOB = Path(__file__).resolve().parents[1] / "lightning_apex_job.py"
REPO = Path(__file__).resolve().parents[2]


def run(tmp_path, *args):
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "ampddp.apex", str(JOB), *args, "--out", str(tmp_path)]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_lightning_trains_through_its_apex_plugin(tmp_path, opt_level):
    done = run(tmp_path, opt_level)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "rank0.json").read_text())
    losses = report["losses"]
    assert len(losses) == 12 and all(loss == loss for loss in losses) and min(losses[-4:]) < losses[0]
    assert report["dtypes"] == (["torch.float16"] if opt_level == "O2" else ["torch.float32"])
    assert report["masters"] == ["torch.float32"]


def test_lightning_refuses_its_apex_flags_on_cpu_itself_after_finding_apex_installed(tmp_path):
    done = run(tmp_path, "O2", "--flags")
    assert done.returncode != 0
    assert "apex AMP not supported on CPU" in done.stderr and "apex` is not installed" not in done.stderr
