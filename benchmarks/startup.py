"""Time to the first line of output of what users type first, vs ``python -c "import torch"``:
``ampddp --help`` / ``--version`` / ``train --help``, ``ampddp train`` of a run that has already
finished and of a refused recipe (a run dir that is a file), which need no torch; and
``from ampddp import Trainer``, ``ampddp inspect`` and ``ampddp export`` of a small run, which load
torch and should cost little more (target: at most 1.2x ``import torch``, a ratio of 0.83 or more).

With torch imported up front the first ones took 6-15 s on a busy 2-core machine; importing ampddp
pulled ``torch.distributed.tensor`` and sympy in (+50%). Each repeat runs both commands back to back
in fresh interpreters (warm file cache), so a slow moment of the machine hits both.
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
    "--help": [sys.executable, "-m", "ampddp", "--help"],
    "--version": [sys.executable, "-m", "ampddp", "--version"],
    "train --help": [sys.executable, "-m", "ampddp", "train", "--help"],
    "import of Trainer": [sys.executable, "-c", "from ampddp import Trainer"],
}
TORCH_FREE = ("--help", "--version", "train --help", "train of a finished run", "train of a refused recipe")
"""Rows that import no torch (target: under 1.5 s on an idle machine); the others load it."""
IMPORT_TORCH = [sys.executable, "-c", "import torch"]
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml")
SHORT_RUN = ["trainer.max_steps=2", "data.batch_size=8", "trainer.progress=lines"]


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True)  # a refused recipe exits 2 by design
    return time.perf_counter() - start


def run(device: str, budget: Budget) -> list[Row]:
    repeats = budget.pick(1, 5, 11)
    _seconds(IMPORT_TORCH)  # warm the file cache for both sides
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = f"{scratch}/run"
        train = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SHORT_RUN]
        subprocess.run(train, check=True, capture_output=True)  # the finished run the later commands read
        Path(scratch, "file").write_text("")
        refused = [*train[:5], f"trainer.run_dir={scratch}/file", *SHORT_RUN]
        export = [sys.executable, "-m", "ampddp", "export", run_dir, "--to", f"{scratch}/model.safetensors", "--force"]
        return _rows({**COMMANDS, "train of a finished run": train, "train of a refused recipe": refused,
                      "inspect": [sys.executable, "-m", "ampddp", "inspect", run_dir], "export": export}, repeats)  # fmt: skip


def _rows(commands: dict[str, list[str]], repeats: int) -> list[Row]:
    rows = []
    for name, command in commands.items():
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(_seconds(command))
            theirs.append(_seconds(IMPORT_TORCH))
        rows.append(
            Row(
                name=f"startup/ampddp {name} vs import torch",
                ampddp=statistics.median(ours),
                baseline=statistics.median(theirs),
                unit="s",
                ratio=paired_ratio(ours, theirs),
                repeats=repeats,
                spread=spread(ours),
                note="no torch: target < 1.5 s on an idle machine" if name in TORCH_FREE else "loads torch: target ratio >= 0.83 (1.2x)",
            )
        )
    return rows
