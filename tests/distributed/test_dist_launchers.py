"""The distributed example under real launchers: torchrun on one node, and two torchrun "nodes"."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "train_digits.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Each job trains for seconds alone; a loaded machine is several times slower, and the subprocess limits
# (180 s) must fire before pytest's so that a stuck job reports what it printed.
pytestmark = pytest.mark.timeout(300)


def final_accuracy(output: str) -> tuple[float, int]:
    match = re.search(r"held-out accuracy ([0-9.]+) over (\d+) digits", output)
    assert match is not None, output
    return float(match.group(1)), int(match.group(2))


def test_torchrun_two_processes_with_sync_bn():
    launcher = [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]
    job = [SCRIPT, "--epochs", "3", "--mode", "O1", "--sync-bn", "auto", "--device", "cpu"]
    result = subprocess.run([*launcher, *job], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0/2 (local 0, node 0/1) via torchrun, backend gloo" in result.stdout
    accuracy, seen = final_accuracy(result.stdout)
    assert accuracy >= 0.9 and seen == 450


def test_two_nodes_on_localhost():
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    job = [SCRIPT, "--epochs", "2", "--mode", "native-bf16", "--device", "cpu"]
    nodes = [
        subprocess.Popen(
            [*TORCHRUN, *common, "--node-rank", str(rank), *job], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=180)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        pytest.fail("two-node job still running after 180 s:\n" + "\n---\n".join(node.communicate()[0] for node in nodes))
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "rank 0/2 (local 0, node 0/2) via torchrun" in outputs[0]
    accuracy, seen = final_accuracy(outputs[0])
    assert accuracy >= 0.85 and seen == 450


def test_spawn_launcher_from_the_example():
    result = subprocess.run(
        [sys.executable, SCRIPT, "--epochs", "2", "--nproc-per-node", "2", "--mode", "O2", "--device", "cpu"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0/2 (local 0, node 0/1) via tcp" in result.stdout
    assert final_accuracy(result.stdout)[1] == 450
