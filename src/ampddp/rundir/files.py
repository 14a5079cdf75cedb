"""The files a run writes in its run dir besides checkpoints: their names, how they are written, and
reading the summary back.

Nothing is written through a symbolic link found in a run dir, at the file or at any folder above
it (see ``ampddp.rundir.beneath``): a link planted where the lock, the metrics, the summary, a plot
or a logger's folder belongs could make the run overwrite or append to any file its user can write.
Appended files are opened with ``O_NOFOLLOW``; whole files are written to a fresh temporary name
(``O_EXCL``) and renamed over the old one, which replaces a link rather than following it. Special
files (FIFOs, devices) are refused before any read or write. Torch-free: a start of a finished run
reads the summary before torch is imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ampddp.errors import ConfigError, RunIOError
from ampddp.rundir import strict_json
from ampddp.rundir.beneath import not_regular, open_beneath, read_beneath, replace_beneath

logger = logging.getLogger("ampddp.observe")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILES = ("loss.png", "eval_accuracy.png", "lr.png", "loss_scale.png", "report.png")
"""The plots of a run (loss_scale.png only where the scale moved; eval_<metric>.png per evaluation metric)."""


MAX_SUMMARY_BYTES = 16 * 1024 * 1024
"""The largest summary.json read (ampddp writes under 1 KiB)."""


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary a run wrote (empty when there is none, it does not parse, or a link stands there,
    which the next write replaces); a special or oversized file there is refused (ConfigError)
    before any read."""
    path = Path(run_dir) / SUMMARY_FILE
    if path.is_symlink():
        return {}
    try:
        summary = strict_json.loads(read_beneath(Path(run_dir), path, MAX_SUMMARY_BYTES, "a run's summary").decode("utf-8"))
    except ConfigError:
        raise
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


class RunDirIdentity:
    """The run dir a run started in (its device and inode), to notice it being moved or removed.

    Writing by path after that would silently recreate an empty run dir and split the run in two:
    early steps, metrics and lock in the moved folder, later checkpoints and the summary in a new one
    without a lock, where a second writer could start. The first ``check`` records the folder
    (creating it if it does not exist yet); every later one raises ``RunIOError`` if the path now
    names another folder or none.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir)
        self._identity: tuple[int, int] | None = None

    def check(self) -> None:
        if self._identity is None:
            self.path.mkdir(parents=True, exist_ok=True)
            found = self.path.stat()
            self._identity = (found.st_dev, found.st_ino)
            return
        try:
            found = self.path.stat()
        except FileNotFoundError:
            raise RunIOError(
                f"{self.path}: the run dir was removed during the run; stopping rather than recreating it empty "
                "(its files, if it was moved, are where it was moved to: resume there)"
            ) from None
        if (found.st_dev, found.st_ino) != self._identity:
            raise RunIOError(
                f"{self.path}: the run dir was moved or replaced during the run; stopping rather than writing into "
                "another folder (resume from the folder it was moved to)"
            )


def open_no_follow(path: Path, flags: int, root: Path | None = None) -> int:
    """``os.open(path, flags)`` of a regular file, refusing in one line a symbolic link at ``path`` or
    at any folder between ``root`` (default: ``path``'s own folder) and it, and a special file."""
    return open_beneath(Path(root or Path(path).parent), Path(path), flags)


def read_regular_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the file a user named (a link is followed: the user chose it), at most ``limit``:
    a special file is refused before any read (a FIFO would block), a bigger file unread (ConfigError
    naming ``what`` it should be and the bound)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise not_regular(Path(path), found.st_mode)
        os.set_blocking(fd, True)
        data = handle.read(limit + 1) if found.st_size <= limit else b""
    if found.st_size > limit or len(data) > limit:
        raise ConfigError(f"{path}: {max(found.st_size, len(data))} bytes; {what} is at most {limit} bytes here (refused unread)")
    return data


def open_for_append(path: Path, root: Path | None = None) -> TextIO:
    """``path`` opened for appending text (created if missing), refusing a link (see ``open_no_follow``)."""
    return os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, root), "a", encoding="utf-8")


def replace_file(path: Path, data: bytes, root: Path | None = None) -> None:
    """Write ``data`` as ``path`` whole: a fresh temporary file in the same folder, fsynced, renamed
    over ``path`` (a link there is replaced, never followed; a crash leaves the old file); no link
    followed between ``root`` (default: ``path``'s folder) and it."""
    path = Path(path)
    replace_beneath(Path(root or path.parent), path, lambda handle: handle.write(data))


@contextlib.contextmanager
def run_file_errors(path: Path) -> Iterator[None]:
    """An ``OSError`` while writing ``path`` (disk full, I/O error, read-only) as a one-line ``RunIOError``."""
    try:
        yield
    except OSError as error:
        raise RunIOError(f"{path}: cannot write ({error.strerror or error})") from error


def drop_torn_tail(path: Path, root: Path | None = None) -> None:
    """Cut an append-only log back to its last whole line: a record torn by a crash or a full disk
    is dropped (with a warning) before new records follow it, as a database treats a torn log tail."""
    try:
        fd = open_no_follow(path, os.O_RDWR, root)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return
        keep, block = 0, 64 * 1024
        position = size
        while position > 0:  # find the last newline, reading backwards
            start = max(0, position - block)
            handle.seek(start)
            chunk = handle.read(position - start)
            found = chunk.rfind(b"\n")
            if found >= 0:
                keep = start + found + 1
                break
            position = start
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    logger.warning("%s: dropped a torn last record (%d bytes) left by a crash or a full disk", path, size - keep)
