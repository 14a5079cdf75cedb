"""A rank ends with its launcher: the kernel's parent-death signal, the polling fallback, and a rank
under torchrun's agent (ampddp.distributed.lifeline)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
CHILDREN = {
    "kernel": "from ampddp.distributed.lifeline import end_with_parent; end_with_parent(os.getppid())",
    "polling": "import ampddp.distributed.lifeline as line; line._kernel_watches = lambda: False; line.end_with_parent(os.getppid())",
    "torchrun agent": "from ampddp.distributed.env import detect_env, init_distributed; "
    "init_distributed(detect_env({'RANK': '0', 'WORLD_SIZE': '1', 'TORCHELASTIC_RUN_ID': 'job'}, device='cpu'))",
}
LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time; " + sys.argv[1] + "; print('ready', flush=True); time.sleep(120)"],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="watches the child through /proc")
@pytest.mark.parametrize("how", list(CHILDREN))
def test_a_child_ends_within_seconds_of_its_killed_launcher(how):
    env = {**os.environ, "PYTHONPATH": SRC}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILDREN[how]], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child}/cmdline").exists() and Path(f"/proc/{child}/cmdline").read_bytes():
            assert time.monotonic() < deadline, f"the child ({how}) outlived its killed launcher by 5 s"
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.wait()
