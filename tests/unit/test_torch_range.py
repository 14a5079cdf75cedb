"""The supported torch range: one floor, stated in setup.py and enforced when ampddp's torch-using
parts are imported, refused in one line that names the version needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.errors import UnsupportedTorchError
from ampddp.torch_compat import MIN_TORCH, require_supported_torch, torch_release

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.10.0", (2, 10)), ("2.10.0a0+b4e4ee81d3", (2, 10)), ("2.15.0+cu132", (2, 15)), ("2.7.0a0+7c8ec84dab", (2, 7)), ("3.0.1", (3, 0))],
)
def test_a_version_counts_as_its_release_whatever_its_suffix(version, release):
    assert torch_release(version) == release


def test_an_unreadable_version_is_refused_naming_it():
    with pytest.raises(UnsupportedTorchError, match="cannot read the torch version 'nightly'"):
        torch_release("nightly")


def test_the_floor_and_newer_are_accepted_and_older_refused_naming_both_versions():
    require_supported_torch(f"{MIN_TORCH[0]}.{MIN_TORCH[1]}.0a0+abc")  # a pre-release of the floor (NGC images) is the floor
    require_supported_torch("2.15.0")
    with pytest.raises(UnsupportedTorchError) as refused:
        require_supported_torch("2.7.0a0+7c8ec84dab")
    message = str(refused.value)
    assert f"needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}" in message and "torch 2.7.0a0+7c8ec84dab" in message
    assert "\n" not in message


def test_setup_py_declares_the_floor_that_ampddp_enforces():
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "setup.py").read_text())
    assert floor is not None and (int(floor.group(1)), int(floor.group(2))) == MIN_TORCH


@pytest.mark.timeout(180)
def test_the_command_line_refuses_an_older_torch_in_one_line_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    program = (
        "import sys, torch\n"
        "torch.__version__ = '2.7.0a0+7c8ec84dab'  # as NGC 25.04 reports it\n"
        "from ampddp.cli import main\n"
        f"sys.exit(main(['train', {str(REPO / 'recipes' / 'quickstart.yaml')!r}, 'trainer.run_dir={run_dir}']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    floor = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"
    expected = f"ampddp needs torch >= {floor}, this environment has torch 2.7.0a0+7c8ec84dab: pip install 'torch>={floor}'"
    assert lines == [f"ampddp train: error: {expected}"]
    assert not run_dir.exists()
