"""The benchmark harness runs in a tiny configuration and writes well-formed rows (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"name", "ampddp", "baseline", "unit", "ratio", "repeats", "spread"}


def test_quick_benchmarks_write_valid_json_and_markdown(tmp_path):
    out = tmp_path / "results.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "run.py"),
        "--quick",
        "--only",
        "memory",
        "optimizer-step",
        "checkpoint",
        "ddp",
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {row["name"].split("/")[0] for row in rows} == {"memory", "optimizer-step", "checkpoint", "ddp"}
    for row in rows:
        assert set(row) >= FIELDS
        assert isinstance(row["name"], str) and isinstance(row["unit"], str) and isinstance(row["repeats"], int)
        for key in ("ampddp", "baseline", "ratio", "spread"):
            assert isinstance(row[key], float) and math.isfinite(row[key])
        assert row["ratio"] > 0
    assert "| benchmark |" in out.with_suffix(".md").read_text()


def test_unknown_benchmark_is_rejected():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--only", "speed"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "invalid choice: 'speed'" in result.stderr
