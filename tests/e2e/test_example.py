"""The quickstart training script runs end to end and learns the embedded digits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["O2", "native-bf16"])
def test_train_digits_reaches_high_held_out_accuracy(mode):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--mode", mode, "--epochs", "4", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    final = re.search(r"held-out accuracy ([0-9.]+)", result.stdout)
    assert final is not None, result.stdout
    assert float(final.group(1)) >= 0.9


def test_train_digits_rejects_an_unknown_mode():
    result = subprocess.run([sys.executable, str(SCRIPT), "--mode", "O7"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "invalid choice: 'O7'" in result.stderr
