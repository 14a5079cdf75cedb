"""One run per run directory: a ``flock`` on ``<run_dir>/.ampddp-lock``, held by every process of the run.

Two runs writing the same run_dir (a double-submitted job) would interleave metrics and race on
checkpoint folders. A run is admitted by taking the lock exclusively (no other process holds it in
any way), writing its identity, and turning it into a shared lock; each other process of the run (a
spawned rank, a torchrun rank) then joins with a shared lock of its own. A later run's exclusive
request fails while *any* of them lives, so ranks that outlive a killed launcher for a moment still
keep a second run out. Locks are held on open file descriptors, so the OS drops each when its holder
exits or is killed: a dead run never leaves a stale lock, and a torchrun restart or a SLURM requeue
takes it again. The file itself stays on disk; only its locks and the holder's identity change.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from ampddp.errors import ConfigError
from ampddp.rundir.files import open_no_follow

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there go unlocked (see RunDirLock)
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".ampddp-lock"
HELD_ERRNOS = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
"""flock's answers for "another process holds it"; any other error means the filesystem cannot lock."""

logger = logging.getLogger("ampddp.rundir.lock")


def holder_identity() -> dict[str, object]:
    """Who this process is, as written into the lock file for a refused run to quote."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(sys.argv),
    }


def describe_holder(text: str) -> str:
    """The lock file's content as 'pid P on host H, started T: CMD' (or why it cannot be said)."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}: {holder['command']}"
    except (ValueError, TypeError, KeyError):
        return "holder not recorded yet" if not text.strip() else "holder record unreadable"


class RunDirLock:
    """Context manager holding this process's lock on ``run_dir`` from ``__enter__`` to ``__exit__``.

    ``joining`` False (the run's first claimant): admits the run — raises ConfigError on entry when
    another process holds the lock in any way, else records this process as the holder and keeps a
    shared lock. ``joining`` True (another process of an admitted run): a shared lock only, refused
    the same way while a different run is being admitted. Where locks are unavailable (no fcntl, as
    on Windows, or a filesystem that refuses flock, such as Lustre mounted without ``-o flock``), it
    logs a warning and the run goes ahead unlocked rather than not at all.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, joining: bool = False) -> None:
        self.run_dir = str(run_dir)
        self.path = Path(run_dir) / LOCK_FILE
        self.joining = joining
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        if fcntl is None:
            logger.warning("no fcntl on this platform: %s is not locked; do not start two runs on it", self.run_dir)
            return self
        try:
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as error:
            raise ConfigError(
                f"trainer.run_dir={self.run_dir}: cannot open its lock file {self.path} ({error.strerror or error}); "
                "give a run_dir this user can write"
            ) from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.joining else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as error:
            self._refuse(fd, error)
            return self
        self._fd = fd
        if self.joining:
            return self
        try:
            self._record(fd)
        except OSError as error:
            self.release()
            raise ConfigError(
                f"trainer.run_dir={self.run_dir}: cannot write its lock file {self.path} ({error.strerror or error}); "
                "give a writable run_dir with free space"
            ) from None
        try:  # admitted: shared from now on, so the run's other processes can join it
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:  # flock turns a lock over non-atomically: another run got in meanwhile
            self._fd = None
            self._refuse(fd, error)
        return self

    def _refuse(self, fd: int, error: OSError) -> None:
        """Close ``fd`` after a failed flock: raise when another run holds the lock, warn (and go on
        unlocked) when the filesystem cannot lock."""
        holder = os.pread(fd, 64 * 1024, 0).decode("utf-8", "replace")
        os.close(fd)
        if error.errno in HELD_ERRNOS:
            raise ConfigError(
                f"trainer.run_dir={self.run_dir} is in use by another ampddp run ({describe_holder(holder)}); "
                "wait for it to finish, stop it, or use another run_dir"
            ) from None
        reason = error.strerror or error
        logger.warning("%s is not locked: its filesystem cannot lock files (%s); do not start two runs on it", self.run_dir, reason)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()

    @staticmethod
    def _record(fd: int) -> None:
        """Replace the file's content with this holder's identity, durably, while holding the lock."""
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_identity()) + "\n").encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays, for the next run to lock again."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
