"""Time to the first line of output: ``ampddp --help`` / ``--version`` and ``ampddp train`` of a
run that has already finished, vs ``python -c "import torch"``.

Users type these first (and schedulers re-run finished jobs); with torch imported up front each took
6-15 s on a busy 2-core machine. Each repeat runs both commands back to back in fresh interpreters
(warm file cache), so a slow moment of the machine hits both.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Budget, Row, paired_ratio, spread

COMMANDS = {
    "help": [sys.executable, "-m", "ampddp", "--help"],
    "version": [sys.executable, "-m", "ampddp", "--version"],
}
IMPORT_TORCH = [sys.executable, "-c", "import torch"]
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml")
SHORT_RUN = ["trainer.max_steps=2", "data.batch_size=8", "trainer.progress=lines"]


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def run(device: str, budget: Budget) -> list[Row]:
    repeats = budget.pick(1, 5, 11)
    _seconds(IMPORT_TORCH)  # warm the file cache for both sides
    with tempfile.TemporaryDirectory() as scratch:
        train = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={scratch}/run", *SHORT_RUN]
        subprocess.run(train, check=True, capture_output=True)  # the finished run the last command re-runs
        return _rows({**COMMANDS, "train of a finished run": train}, repeats)


def _rows(commands: dict[str, list[str]], repeats: int) -> list[Row]:
    rows = []
    for name, command in commands.items():
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(_seconds(command))
            theirs.append(_seconds(IMPORT_TORCH))
        rows.append(
            Row(
                name=f"startup/ampddp {name if ' ' in name else '--' + name} vs import torch",
                ampddp=statistics.median(ours),
                baseline=statistics.median(theirs),
                unit="s",
                ratio=paired_ratio(ours, theirs),
                repeats=repeats,
                spread=spread(ours),
                note="time to the first line; target < 1.5 s on an idle machine",
            )
        )
    return rows
