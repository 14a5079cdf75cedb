"""The checkpoint directory: step folders, completion manifests, retention.

Rank 0 writes the shared file, every rank its own RNG file, each hashing its bytes as they stream
out; the ranks' digests are gathered and rank 0 writes ``COMPLETE`` — the manifest: every file's
size and XXH3-128 checksum. Every load checks the files it reads against the manifest. The newest
step folder with a ``COMPLETE`` marker is the latest checkpoint (no pointer file to fall out of
step with it), so a process killed at any moment leaves the previous complete checkpoint the
latest; half-written folders are never trusted and are cleaned up by the next successful save. A
checkpoint that does not verify is skipped by ``resume="auto"`` (the newest one that verifies wins)
and left on disk until a newer good one exists. This module stores, verifies and finds; which
checkpoint a run continues from is decided in ``ampddp.training.resume.source``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import fsync_directory, load_safely, save_atomic, write_bytes_atomic
from ampddp.checkpoint.keys import is_sharded_file
from ampddp.checkpoint.manifest import CHECKSUM, Manifest, complete_folders, read_manifest, step_folders_in, step_of, verify_folder
from ampddp.distributed.data import broadcast_from_main, gather_objects, sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.errors import CheckpointError, CheckpointWriteError, ConfigError, RunIOError
from ampddp.rundir.beneath import checked_folder, remove_beneath, rename_beneath
from ampddp.rundir.paths import refuse_long_names
from ampddp.rundir.run_dir import RunDir

logger = logging.getLogger("ampddp.checkpoint")
T = TypeVar("T")


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

    def manifest(self) -> Manifest:
        return read_manifest(self.path)

    def verify(self, manifest: Manifest | None = None, shards_sized_only: bool = False) -> str:
        """Check every file of the checkpoint against its manifest (see ``manifest.verify_folder``);
        ``shards_sized_only``: a sharded checkpoint's shards by size alone (the ranks hash them together)."""

        manifest = manifest or self.manifest()
        unlisted = sorted(p.name for p in self.path.iterdir() if is_sharded_file(p.name) and p.name not in manifest.names)
        if unlisted:  # shards its manifest does not vouch for: a torn or tampered marker
            raise CheckpointError(f"{self.path / unlisted[0]}: a shard file {keys.COMPLETE_FILE} does not list: incomplete checkpoint")
        return verify_folder(self.path, manifest, is_sharded_file if shards_sized_only else None)

    def looks_whole(self) -> bool:
        """Cheap check (no hashing): the marker parses and every listed file is there with its size."""
        try:
            manifest = self.manifest()
        except CheckpointError:
            return False
        for name in manifest.names:
            path = self.path / name
            size = manifest.digests[name].size if manifest.digests is not None else None
            if not path.is_file() or (size is not None and path.stat().st_size != size):
                return False
        return keys.SHARED_FILE in manifest.names

    def load_file(self, name: str, manifest: Manifest | None = None) -> dict[str, Any]:
        """Load one file of this checkpoint, verified against the manifest when it has checksums."""
        manifest = manifest or self.manifest()
        path = self.path / name
        if manifest.digests is None:
            return load_safely(path)
        if name not in manifest.digests:
            raise CheckpointError(f"{path}: not listed in {self.path / keys.COMPLETE_FILE}: incomplete checkpoint")
        return load_safely(path, expected=manifest.digests[name])


def check_keep_last(keep_last: int | None) -> None:
    """How many complete checkpoints retention keeps: a whole number >= 1, or None (all)."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"checkpoint.keep_last={keep_last!r} is not valid; it must be an integer >= 1 or None (keep all)")


class CheckpointStore:
    """Checkpoints of one run under ``<run_dir>/checkpoints``."""

    def __init__(self, run_dir: RunDir | str | Path, keep_last: int | None = 3) -> None:
        check_keep_last(keep_last)
        self.run_dir = RunDir.of(run_dir)
        """The run dir (shared with the run's observer: one record of which folder the run started in)."""
        self.root = self.run_dir.checkpoints
        self.keep_last = keep_last

    def complete(self) -> list[CheckpointRef]:
        """Every complete checkpoint, oldest first."""
        return [CheckpointRef(folder, step) for step, folder in complete_folders(self.root)]

    def latest(self) -> CheckpointRef | None:
        """The newest complete checkpoint: decided by the completion markers alone, which are
        written last, so a save interrupted at any point leaves the previous one the latest."""
        complete = self.complete()
        return complete[-1] if complete else None

    def save(
        self, step: int, shared: dict[str, Any], rank_state: dict[str, Any], env: DistEnv, run: dict[str, Any] | None = None,
        shards: dict[str, Any] | None = None,
    ) -> CheckpointRef:  # fmt: skip
        """Write one checkpoint collectively (every rank calls this with its own ``rank_state``);
        ``run``: plain facts about the run recorded in the manifest (see ``Manifest.run``);
        ``shards``: tensors every rank writes its own part of (a sharded checkpoint, see ``sharded``).

        Rank 0 decides whether the step already has a complete checkpoint, and after each phase all
        ranks agree on whether every write succeeded, so a failure on one rank raises
        ``CheckpointError`` on all of them instead of leaving the others waiting at a barrier.
        """
        folder = self.root / keys.STEP_DIR.format(step=step)
        ref = CheckpointRef(folder, step)
        exists = broadcast_from_main(self._existing_is_good(ref) if env.is_main else None, env)
        if exists:
            # A step is written once: replacing a complete checkpoint in place could lose it to a crash.
            return ref
        digests: dict[str, dict[str, Any]] = {}
        self._run_everywhere(lambda: self._prepare_folder(folder) if env.is_main else self.run_dir.check(), folder, env)
        self._run_everywhere(lambda: digests.update(self._write_parts(ref, shared, rank_state, env, shards)), folder, env)
        every_rank = gather_objects(digests, env)
        files = {name: entry for part in every_rank for name, entry in part.items()}
        self._run_everywhere(lambda: self._finish(folder, step, env, files, run) if env.is_main else None, folder, env)
        return ref

    def _existing_is_good(self, ref: CheckpointRef) -> bool:
        """Whether ``ref`` is already a complete checkpoint that verifies; a bad one is moved aside."""
        if not (ref.path / keys.COMPLETE_FILE).is_file():
            return False
        try:
            ref.verify()
        except CheckpointError as error:
            moved = self.move_aside([ref.path])
            logger.warning("checkpoint step %d does not verify (%s); moved it to %s and writing it anew", ref.step, error, moved[0])
            return False
        return True

    def _write_parts(self, ref: CheckpointRef, shared: dict[str, Any], rank_state: dict[str, Any], env: DistEnv,
                     shards: dict[str, Any] | None) -> dict[str, dict[str, Any]]:  # fmt: skip
        names = {}
        root = self.run_dir.path
        if shards is not None:  # first: collective, and DCP raises a failure on every rank
            from ampddp.checkpoint.sharded import write_shards

            names.update(write_shards(ref.path, shards, env))
        names[keys.RANK_FILE.format(rank=env.rank)] = save_atomic({**rank_state, keys.RANK: env.rank}, ref.rank_file(env.rank), root)
        if env.is_main:
            names[keys.SHARED_FILE] = save_atomic(shared, ref.shared_file, root)
        return {name: digest.to_json() for name, digest in names.items()}

    def _run_everywhere(self, phase: Any, folder: Path, env: DistEnv) -> None:
        error: BaseException | None = None
        try:
            phase()
        except Exception as exc:  # every failure must reach the agreement below
            error = exc
        failed = int(sum_across_ranks(float(error is not None)).item())
        if failed:
            if env.is_main:
                self._remove(folder)
            if isinstance(error, (CheckpointError, RunIOError, ConfigError)):
                raise error
            reason = f": {error}" if error is not None else ""
            raise CheckpointWriteError(f"{folder}: checkpoint not written: {failed} rank(s) failed to write their part{reason}") from error

    def _finish(self, folder: Path, step: int, env: DistEnv, files: dict[str, dict[str, Any]], run: dict[str, Any] | None) -> None:
        marker: dict[str, Any] = {"step": step, "world_size": env.world_size, "time": time.time(), "checksum": CHECKSUM}
        marker["files"] = dict(sorted(files.items()))  # every rank's digests of what it wrote
        if run is not None:
            marker["run"] = run
        write_bytes_atomic(folder / keys.COMPLETE_FILE, json.dumps(marker, indent=1).encode(), self.run_dir.path)
        self._prune(keep=folder)

    def _prepare_folder(self, folder: Path) -> None:
        """An empty step folder, reached (and made) without following a link in the run dir."""
        self.run_dir.check()  # moved or removed mid-run: stop, never recreate it
        try:
            remove_beneath(self.run_dir.path, folder)
            checked_folder(self.run_dir.path, folder)
        except OSError as error:
            raise CheckpointWriteError(f"{folder}: cannot create checkpoint folder ({error.strerror or error})") from error
        fsync_directory(self.root)

    def _remove(self, folder: Path) -> None:
        """Remove a step folder of this run (a link there is removed, never followed); best effort."""
        with contextlib.suppress(OSError):
            remove_beneath(self.run_dir.path, folder)

    def _prune(self, keep: Path) -> None:
        """Drop half-written folders, and complete ones beyond ``keep_last`` older than ``keep``.

        Complete folders newer than ``keep`` (the one just written) are checkpoints that did not
        verify and were skipped on resume: they stay untouched until a newer good one exists. The
        ``keep_last`` count only counts folders whose files are all there with their sizes.
        """
        for folder in [*self._beyond_retention(keep), *self._half_written()]:
            if folder != keep:
                self._remove(folder)

    def _beyond_retention(self, keep: Path) -> list[Path]:
        """Complete folders up to ``keep`` past the newest ``keep_last`` whole ones (none without keep_last)."""
        kept = step_of(keep)
        older = [ref for ref in self.complete() if kept is None or ref.step <= kept]
        if not self.keep_last:
            return []
        whole = [ref for ref in older if ref.path == keep or ref.looks_whole()]
        survivors = {ref.path for ref in whole[-self.keep_last :]}
        return [ref.path for ref in older if ref.path not in survivors]

    def _half_written(self) -> list[Path]:
        """Step folders without the completion marker: saves that were interrupted."""
        return [folder for folder in step_folders_in(self.root) if not (folder / keys.COMPLETE_FILE).is_file()]

    def move_aside(self, folders: list[Path]) -> list[Path]:
        """Move step folders into ``<run_dir>/abandoned/`` (never deleted); returns their new paths."""
        target_root = self.run_dir.abandoned
        moved = []
        try:
            checked_folder(self.run_dir.path, target_root)
            for folder in folders:
                target = target_root / folder.name
                suffix = 1
                while target.exists() or target.is_symlink():
                    suffix += 1
                    target = target_root / f"{folder.name}.{suffix}"
                rename_beneath(self.run_dir.path, folder, target)
                moved.append(target)
        except OSError as error:
            raise CheckpointWriteError(f"{target_root}: cannot move checkpoints aside ({error.strerror or error})") from error
        return moved

    def newest_verified(self, shards_sized_only: bool = False, passed_over: Collection[str] = ()) -> tuple[CheckpointRef | None, list[str]]:
        """The newest checkpoint that verifies, and one line for each newer one that does not;
        ``passed_over``: folders already found bad; ``shards_sized_only``: see ``CheckpointRef.verify``."""
        skipped = []
        for ref in reversed(self.complete()):
            if str(ref.path) in passed_over:
                continue
            try:
                ref.verify(shards_sized_only=shards_sized_only)
            except CheckpointError as error:
                skipped.append(f"checkpoint step {ref.step} does not verify, skipped and left on disk: {error}")
                continue
            return ref, skipped
        return None, skipped

    @staticmethod
    def load_shared(ref: CheckpointRef, manifest: Manifest | None = None) -> dict[str, Any]:
        """The shared file, verified against the manifest (size and checksum) before it is unpickled."""
        state = ref.load_file(keys.SHARED_FILE, manifest)
        version = state.get(keys.FORMAT)
        if version not in keys.FORMATS:
            readable = " and ".join(map(str, keys.FORMATS))
            raise CheckpointError(
                f"{ref.shared_file}: checkpoint format {version!r} is not supported (this ampddp reads formats {readable})"
            )
        return state

    @staticmethod
    def load_whole(ref: CheckpointRef, manifest: Manifest | None = None, shards_verified: bool = False) -> dict[str, Any]:
        """The shared file with whole model and optimizer tensors, also for a sharded checkpoint (its
        shards verified, unless the caller just did, and read in this process alone): for ``inspect``,
        ``export`` and ``init_from``."""
        manifest = manifest or ref.manifest()
        shared = CheckpointStore.load_shared(ref, manifest)
        if shared.get(keys.SHARDS) is None:
            return shared
        from ampddp.checkpoint.sharded import whole_view

        return whole_view(ref.path, shared, manifest, verify=not shards_verified)

    @staticmethod
    def load_rank(ref: CheckpointRef, rank: int, manifest: Manifest | None = None) -> dict[str, Any] | None:
        """``rank``'s own file, verified; None when the checkpoint was saved by fewer ranks than ``rank``.

        A rank of the saving world whose file is missing makes the checkpoint incomplete: an error.
        """
        manifest = manifest or ref.manifest()
        path = ref.rank_file(rank)
        saved_by = manifest.world_size
        if saved_by is not None and rank >= saved_by:
            return None
        if saved_by is None and not path.is_file():  # a marker without a world size: nothing to require
            return None
        if not path.is_file():
            raise CheckpointError(f"{path}: missing: incomplete checkpoint (saved by {saved_by} rank(s), each writes its own file)")
        return ref.load_file(path.name, manifest)

    def step_folders(self) -> list[Path]:
        """Every step folder, complete or not, oldest first."""
        return step_folders_in(self.root)


@dataclass(frozen=True)
class ResumeSource:
    """What a user-given checkpoint path points at: a step folder (``step`` its number) or a run dir
    (``step`` None; given as the run dir or its checkpoints/ folder)."""

    path: Path
    step: int | None


def resume_source(location: str | Path) -> ResumeSource:
    """The one reading of a checkpoint path: a file stands for its folder, a step folder for that
    checkpoint, ``checkpoints/`` for its run dir, anything else for a run dir (a name past the file
    system's limits is a ConfigError)."""
    refuse_long_names(location, "checkpoint path")
    path = Path(location)
    folder = path.parent if path.is_file() else path
    step = step_of(folder)
    if step is not None:
        return ResumeSource(folder, step)
    return ResumeSource(folder.parent if folder.name == keys.CHECKPOINTS_DIR else folder, None)


def find_checkpoint(location: str | Path) -> CheckpointRef:
    """Resolve a user-given path: a step folder, a file in one, a run dir, or its checkpoints dir."""
    source = resume_source(location)
    if not source.path.exists():
        raise CheckpointError(f"{location}: no such checkpoint or run directory")
    if source.step is not None:
        if not (source.path / keys.COMPLETE_FILE).is_file():
            raise CheckpointError(f"{source.path}: incomplete checkpoint (no {keys.COMPLETE_FILE} marker: the save was interrupted)")
        return CheckpointRef(source.path, source.step)
    ref = CheckpointStore(source.path, keep_last=None).latest()
    if ref is None:
        raise CheckpointError(
            f"{location}: no complete checkpoint found (expected {keys.CHECKPOINTS_DIR}/step-*/ with a {keys.COMPLETE_FILE} marker)"
        )
    return ref


READ_ATTEMPTS = 100
"""The most checkpoints ``read_newest`` tries before it gives up: a run that removes every one it is
shown faster than it can be read is not one to read from."""


def read_newest(location: str | Path, read: Callable[[CheckpointRef], T]) -> T:
    """``read`` of the checkpoint ``location`` names: a step folder (that one), or a run dir (its newest
    checkpoint that verifies). The run may be writing and pruning checkpoints at that moment: one
    removed while it is read is passed over for the newest one then; one that does not verify for the
    next older, with a warning saying why."""
    ref = find_checkpoint(location)  # a missing path or no complete checkpoint: its own one line
    if resume_source(location).step is not None:
        return read(ref)
    store = CheckpointStore(resume_source(location).path, keep_last=None)
    passed: set[Path] = set()
    skipped: list[str] = []
    for _ in range(READ_ATTEMPTS):
        try:
            result = read(ref)
        except (CheckpointError, OSError) as error:
            passed.add(ref.path)
            if ref.path.is_dir():  # still there: it does not verify (removed ones are no news)
                skipped.append(f"checkpoint step {ref.step} does not verify, passed over: {error}")
            newer_first = [found for found in reversed(store.complete()) if found.path not in passed]
            if not newer_first:
                raise CheckpointError(f"{location}: no complete checkpoint that verifies ({skipped[0] if skipped else error})") from None
            ref = newer_first[0]
            continue
        for line in skipped:
            logger.warning(line)
        return result
    raise CheckpointError(f"{location}: {READ_ATTEMPTS} checkpoints were removed or failed while being read; try again")
