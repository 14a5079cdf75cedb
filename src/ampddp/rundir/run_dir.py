"""``RunDir``: a run's directory as one value, made once and handed to every part that writes there.

It knows where the run's own files go (checkpoints/, abandoned/, metrics.jsonl, summary.json),
probes the directory for writing before a run claims it, takes the lock, and remembers which folder
the run started in: the checkpoint store and the observer share one ``RunDir``, so one record
notices the folder being moved or removed mid-run. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from ampddp.errors import ConfigError
from ampddp.rundir.files import METRICS_FILE, SUMMARY_FILE, RunDirIdentity
from ampddp.rundir.lock import RunDirLock
from ampddp.rundir.paths import refuse_long_names, refuse_tilde_folder

CHECKPOINTS_DIR = "checkpoints"
ABANDONED_DIR = "abandoned"
_PROBE = ".ampddp-write-probe-{pid}"
_PROBE_BYTES = 64 * 1024


class RunDir:
    """The run dir at ``path`` (a ``~`` folder or a name past the file system's limits refused, naming
    ``setting``); nothing is created until the run first writes (:meth:`check`) or :meth:`probe` is asked."""

    def __init__(self, path: str | os.PathLike[str], setting: str = "run_dir") -> None:
        refuse_tilde_folder(path, setting)
        refuse_long_names(path, setting)
        self.path = Path(path)
        self.setting = setting
        self.given = os.fspath(path)
        """The path as the user wrote it, for messages."""
        self._identity = RunDirIdentity(self.path)

    @classmethod
    def of(cls, value: RunDir | str | os.PathLike[str], setting: str = "run_dir") -> RunDir:
        """``value`` itself when it is a RunDir (shared, with its identity), else a new one."""
        return value if isinstance(value, RunDir) else cls(value, setting)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def abandoned(self) -> Path:
        """Where step folders a resume set aside go (never deleted)."""
        return self.path / ABANDONED_DIR

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    def check(self) -> None:
        """Before each write: the first records the folder (creating it); later ones raise RunIOError
        when the path names another folder or none (see :class:`RunDirIdentity`)."""
        self._identity.check()

    def lock(self, *, joining: bool = False) -> RunDirLock:
        """The lock that makes this run the only writer here (a context manager): taken by the run's
        first process, ``joining`` by each of its others (see :class:`RunDirLock`)."""
        return RunDirLock(self.path, joining=joining)

    def folders_to_make(self) -> list[Path]:
        """The folders of the path that do not exist yet, deepest first; ConfigError when the path is,
        or lies under, a file, a broken link or another non-directory. Reads only: the check of a run
        dir that needs no torch, made before torch loads."""
        missing = []
        existing = self.path
        while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
            missing.append(existing)
            existing = existing.parent
        if not existing.is_dir():
            kind = "a file" if existing.is_file() else "a broken link" if existing.is_symlink() else "not a directory"
            where = "is" if existing == self.path else f"lies under {existing}, which is"
            raise ConfigError(f"{self.setting}={self.given} {where} {kind}; give a directory (existing or to be created)")
        return missing

    def probe(self) -> None:
        """The run dir is (or can be created as) a writable directory with free space: a small file is
        created, filled, fsynced and removed. Folders created for the probe are removed again when it
        fails, so a refused run leaves nothing."""
        missing = self.folders_to_make()
        created: list[Path] = []
        try:
            for folder in reversed(missing):
                try:
                    folder.mkdir()
                except FileExistsError:  # another rank of this job made it a moment ago
                    if not folder.is_dir():
                        raise
                    continue
                created.append(folder)
            _write_probe(self.path)
        except OSError as error:
            for folder in reversed(created):
                try:
                    folder.rmdir()
                except OSError:
                    break
            reason = error.strerror or str(error)
            problem = f"{self.setting}={self.given} is not writable ({reason})"
            raise ConfigError(f"{problem}; give a writable directory with free space") from None


def _write_probe(directory: Path) -> None:
    """Create, fill, fsync and remove a small file: a read-only or full filesystem fails here."""
    probe = directory / _PROBE.format(pid=os.getpid())
    descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(descriptor, b"\0" * _PROBE_BYTES)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
        probe.unlink(missing_ok=True)
