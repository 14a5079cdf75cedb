"""A symbolic link or a FIFO planted at any path a run writes, at a file or at a folder above it, never
makes a start of the finished run, a resume, ``inspect`` or ``export`` write outside the run dir, and
never blocks one.

The paths come from a real run with every file logger, not from a list kept by hand: a run is made
once, every path it left (its loggers' own folders as wholes: what TensorBoard and W&B keep inside
them is theirs) becomes a case, and each case gets a fresh copy of that run with the path replaced by
a link to a copy of it outside the run dir, or by a FIFO. The outside copies must come out
byte-for-byte as they went in, every command must end (a FIFO opened for reading would block it
for ever: the test's timeout), and a refusal is one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ampddp.cli import EXIT_USAGE, main

REPO = Path(__file__).resolve().parents[2]
LOGGERS = [name for name in ("csv", "tensorboard", "mlflow") if name == "csv" or importlib.util.find_spec(name) is not None]
RUN = [
    str(REPO / "recipes" / "quickstart.yaml"), "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=off",
    "optimizer.scheduler=none", "trainer.log_every_steps=1", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
    f"observe.loggers=[{','.join(LOGGERS)}]",
]  # fmt: skip
LIBRARY_FOLDERS = ("tensorboard", "wandb")
"""Folders whose insides a tracker library writes by its own rules: planted at as wholes."""
TRACKER_PATHS = ("csv", "tensorboard", "mlflow.db", "wandb")
"""Paths of a logger: whatever is planted there costs that logger (one warning), never the run."""


def train(run_dir: Path, steps: int) -> int:
    return main(["train", *RUN, f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}"])


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A run stopped at step 2 of what a resume extends to 4: every file a run writes, once."""
    run_dir = tmp_path_factory.mktemp("template") / "run"
    assert train(run_dir, 2) == 0
    return run_dir


def written_paths(run_dir: Path) -> list[str]:
    """Every path the run left, relative to it (a tracker library's folder as one path)."""
    found = []
    for path in sorted(run_dir.rglob("*")):
        relative = path.relative_to(run_dir)
        if relative.parts[0] in LIBRARY_FOLDERS and len(relative.parts) > 1:
            continue
        found.append(str(relative))
    return found


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) by its bytes' hash: what must not change."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(file.relative_to(path.parent)): hashlib.sha256(file.read_bytes()).hexdigest() for file in files}


def planted(template: Path, case: Path, relative: str, kind: str) -> tuple[Path, Path]:
    """A copy of ``template`` with ``relative`` replaced by ``kind`` (a link to a copy of it outside
    the run dir, or a FIFO); returns (the run dir, the outside copy)."""
    run_dir = case / "run"
    shutil.copytree(template, run_dir, symlinks=True)
    target = run_dir / relative
    outside = case / "outside" / relative.replace("/", "_")
    outside.parent.mkdir()
    shutil.move(target, outside)
    if kind == "link":
        target.symlink_to(outside, target_is_directory=outside.is_dir())
    else:
        os.mkfifo(target)
    return run_dir, outside


@contextlib.contextmanager
def watchdog(seconds: int, what: str) -> Iterator[None]:
    """TimeoutError naming ``what`` when it takes longer than ``seconds`` (a read blocked on a FIFO)."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what}: still running after {seconds} s (blocked?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def problems_with(template: Path, case: Path, relative: str, kind: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What went wrong with ``relative`` planted as ``kind``: a resume, ``inspect`` and ``export``."""
    run_dir, outside = planted(template, case, relative, kind)
    before = digest(outside)
    what = f"{relative} as a {kind}"
    found = []
    commands = [
        ["train", *RUN, f"trainer.run_dir={run_dir}", "trainer.max_steps=2"],  # the finished run started again: it reads only
        ["train", *RUN, f"trainer.run_dir={run_dir}", "trainer.max_steps=4"],
        ["inspect", str(run_dir)],
        ["export", str(run_dir), "--to", str(case / "model.safetensors"), "--force"],
    ]
    for command in commands:
        try:
            with watchdog(120, f"{what}: {command[0]}"):
                code = main(command)
        except TimeoutError as error:
            found.append(str(error))
            continue
        err = capsys.readouterr().err
        if code not in (0, EXIT_USAGE) or (code and len(err.strip().splitlines()) != 1):
            found.append(f"{what}: {command[0]} exited {code}: {err[-800:]}")
        elif command[0] == "train" and code and relative.split("/")[0] in TRACKER_PATHS:
            found.append(f"{what}: a logger's path stopped training: {err[-800:]}")
    if digest(outside) != before:
        found.append(f"{what}: the file outside the run dir changed")
    if sorted(p.name for p in outside.parent.iterdir()) != [outside.name]:
        found.append(f"{what}: something was written beside the outside copy")
    return found


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_planted_link_or_fifo_anywhere_makes_nothing_write_outside_or_block(template, tmp_path, capsys, kind):
    paths = sorted({re.sub(r"step-\d+", "step-000000002", path) for path in written_paths(template)})
    assert {"checkpoints", "checkpoints/step-000000002/COMPLETE", "metrics.jsonl", "csv"} <= set(paths), paths
    found = []
    for number, relative in enumerate(paths):
        case = tmp_path / str(number)
        case.mkdir()
        found += problems_with(template, case, relative, kind, capsys)
    assert not found, "\n".join(found)
