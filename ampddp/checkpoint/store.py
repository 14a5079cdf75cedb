"""The checkpoint directory: step folders, completion markers, the latest pointer, retention.

Rank 0 writes the shared file, every rank its own RNG file; after a barrier rank 0 writes
``COMPLETE`` and then moves ``latest``. A process killed at any moment leaves the previous complete
checkpoint in place and ``latest`` pointing at it; half-written folders are never trusted and are
cleaned up by the next successful save.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import fsync_directory, load_safely, save_atomic, write_bytes_atomic
from ampddp.distributed.data import broadcast_from_main, sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint folder and the step it was taken at."""

    path: Path
    step: int

    @property
    def shared_file(self) -> Path:
        return self.path / keys.SHARED_FILE

    def rank_file(self, rank: int) -> Path:
        return self.path / keys.RANK_FILE.format(rank=rank)


def _step_of(folder: Path) -> int | None:
    name = folder.name
    if not name.startswith(keys.STEP_DIR_PREFIX):
        return None
    digits = name[len(keys.STEP_DIR_PREFIX) :]
    return int(digits) if digits.isdigit() else None


class CheckpointStore:
    """Checkpoints of one run under ``<run_dir>/checkpoints``."""

    def __init__(self, run_dir: str | Path, keep_last: int | None = 3) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"checkpoint.keep_last={keep_last!r} is not valid; it must be an integer >= 1 or None (keep all)")
        self.root = Path(run_dir) / keys.CHECKPOINTS_DIR
        self.keep_last = keep_last

    def complete(self) -> list[CheckpointRef]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for folder in self.root.iterdir():
            step = _step_of(folder)
            if step is not None and (folder / keys.COMPLETE_FILE).is_file():
                found.append(CheckpointRef(folder, step))
        return sorted(found, key=lambda ref: ref.step)

    def latest(self) -> CheckpointRef | None:
        """The newest complete checkpoint.

        ``latest`` is moved right after ``COMPLETE`` is written; a crash between the two leaves the
        pointer one step behind, and the completion markers, not the pointer, decide.
        """
        complete = self.complete()
        return complete[-1] if complete else None

    def save(self, step: int, shared: dict[str, Any], rank_state: dict[str, Any], env: DistEnv) -> CheckpointRef:
        """Write one checkpoint collectively (every rank calls this with its own ``rank_state``).

        Rank 0 decides whether the step already has a complete checkpoint, and after each phase all
        ranks agree on whether every write succeeded, so a failure on one rank raises
        ``CheckpointError`` on all of them instead of leaving the others waiting at a barrier.
        """
        folder = self.root / keys.STEP_DIR.format(step=step)
        exists = broadcast_from_main((folder / keys.COMPLETE_FILE).is_file() if env.is_main else None, env)
        if exists:
            # A step is written once: replacing a complete checkpoint in place could lose it to a crash.
            return CheckpointRef(folder, step)
        ref = CheckpointRef(folder, step)
        self._run_everywhere(lambda: self._prepare_folder(folder) if env.is_main else None, folder, env)
        self._run_everywhere(lambda: self._write_parts(ref, shared, rank_state, env), folder, env)
        self._run_everywhere(lambda: self._finish(folder, step, env) if env.is_main else None, folder, env)
        return ref

    @staticmethod
    def _write_parts(ref: CheckpointRef, shared: dict[str, Any], rank_state: dict[str, Any], env: DistEnv) -> None:
        save_atomic({**rank_state, keys.RANK: env.rank}, ref.rank_file(env.rank))
        if env.is_main:
            save_atomic(shared, ref.shared_file)

    def _run_everywhere(self, phase: Any, folder: Path, env: DistEnv) -> None:
        error: BaseException | None = None
        try:
            phase()
        except Exception as exc:  # every failure must reach the agreement below
            error = exc
        failed = int(sum_across_ranks(float(error is not None)).item())
        if failed:
            if env.is_main:
                shutil.rmtree(folder, ignore_errors=True)
            if isinstance(error, CheckpointError):
                raise error
            reason = f": {error}" if error is not None else ""
            raise CheckpointError(f"{folder}: checkpoint not written: {failed} rank(s) failed to write their part{reason}") from error

    def _finish(self, folder: Path, step: int, env: DistEnv) -> None:
        marker = {"step": step, "world_size": env.world_size, "time": time.time(), "files": sorted(p.name for p in folder.iterdir())}
        write_bytes_atomic(folder / keys.COMPLETE_FILE, json.dumps(marker).encode())
        write_bytes_atomic(self.root / keys.LATEST_FILE, folder.name.encode())
        self._prune(keep=folder)

    def _prepare_folder(self, folder: Path) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir()
        except OSError as error:
            raise CheckpointError(f"{folder}: cannot create checkpoint folder ({error.strerror or error})") from error
        fsync_directory(self.root)

    def _prune(self, keep: Path) -> None:
        """Drop half-written folders and complete ones beyond ``keep_last`` (never the newest)."""
        complete = self.complete()
        doomed = [ref.path for ref in complete[: -self.keep_last]] if self.keep_last else []
        doomed += [folder for folder in self.root.iterdir() if _step_of(folder) is not None and not (folder / keys.COMPLETE_FILE).is_file()]
        for folder in doomed:
            if folder != keep:
                shutil.rmtree(folder, ignore_errors=True)

    def resolve(self, location: str | Path | None) -> CheckpointRef:
        """A checkpoint from a step folder, a file inside one, a run dir, or None (this run's latest)."""
        if location is None:
            ref = self.latest()
            if ref is None:
                raise CheckpointError(f"{self.root}: no complete checkpoint to resume from")
            return ref
        return find_checkpoint(location)

    @staticmethod
    def load_shared(ref: CheckpointRef) -> dict[str, Any]:
        state = load_safely(ref.shared_file)
        version = state.get(keys.FORMAT)
        if version != keys.FORMAT_VERSION:
            raise CheckpointError(
                f"{ref.shared_file}: checkpoint format {version!r} is not supported (this ampddp reads format {keys.FORMAT_VERSION})"
            )
        return state


def find_checkpoint(location: str | Path) -> CheckpointRef:
    """Resolve a user-given path: a step folder, a file in one, a run dir, or its checkpoints dir."""
    path = Path(location)
    if path.is_file():
        path = path.parent
    if not path.exists():
        raise CheckpointError(f"{location}: no such checkpoint or run directory")
    step = _step_of(path)
    if step is not None:
        if not (path / keys.COMPLETE_FILE).is_file():
            raise CheckpointError(f"{path}: incomplete checkpoint (no {keys.COMPLETE_FILE} marker: the save was interrupted)")
        return CheckpointRef(path, step)
    run_dir = path.parent if path.name == keys.CHECKPOINTS_DIR else path
    ref = CheckpointStore(run_dir, keep_last=None).latest()
    if ref is None:
        raise CheckpointError(
            f"{location}: no complete checkpoint found (expected {keys.CHECKPOINTS_DIR}/step-*/ with a {keys.COMPLETE_FILE} marker)"
        )
    return ref
