"""The benchmark harness runs in a tiny configuration and writes well-formed rows (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampddp.precision.hardware import cpu_description

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"name", "ampddp", "baseline", "unit", "ratio", "repeats", "spread", "cpu"}


@pytest.mark.timeout(1200)  # a subprocess running every benchmark: 2-3 min idle, 3-5x that on a loaded machine
def test_every_benchmark_runs_in_a_tiny_configuration_and_writes_valid_json_and_markdown(tmp_path):
    out = tmp_path / "results.json"
    names = ["overhead", "modes", "memory", "optimizer-step", "checkpoint", "ddp", "sharding", "fused-optimizers", "compile", "op-cost",
             "input", "peers", "tensor-parallel", "pipeline", "cuda-suite"]  # fmt: skip
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--only", *names, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1140)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {row["name"].split("/")[0] for row in rows} == set(names)
    modes = {row["name"].split("/")[2] for row in rows if row["name"].startswith("modes/")}
    assert modes == {"O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16"}
    for row in rows:
        assert set(row) >= FIELDS
        assert isinstance(row["name"], str) and isinstance(row["unit"], str) and isinstance(row["repeats"], int)
        for key in ("ampddp", "baseline", "ratio", "spread"):
            assert isinstance(row[key], float) and math.isfinite(row[key])
        assert row["ratio"] > 0
    peers = [row for row in rows if row["name"].startswith("peers/")]  # each group timed its hand loop; every timed contender agreed
    groups = {row["name"].rsplit("/", 1)[0] for row in peers}
    assert groups == {row["name"].rsplit("/", 1)[0] for row in peers if row["contender"] == "hand"}
    assert all(row["final_loss"] == row["reference_loss"] for row in peers)  # on the CPU: to the bit
    assert "ampddp-trainer" in {row["contender"] for row in peers}
    assert "| benchmark |" in out.with_suffix(".md").read_text() and "| group | contender |" in out.with_suffix(".md").read_text()
    assert {row["cpu"] for row in rows} == {cpu_description()}  # bf16 rows mean nothing without it
    assert cpu_description() in out.with_suffix(".md").read_text()


def test_bad_command_lines_are_refused():
    run = [sys.executable, str(ROOT / "benchmarks" / "run.py")]
    both = subprocess.run([*run, "--quick", "--smoke"], capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    if not torch.cuda.is_available():
        cuda = subprocess.run([*run, "--device", "cuda"], capture_output=True, text=True, timeout=60)
        assert cuda.returncode == 2 and "no CUDA device is available" in cuda.stderr


def test_unknown_benchmark_is_rejected():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--only", "speed"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "invalid choice: 'speed'" in result.stderr
