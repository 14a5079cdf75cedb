"""The files a run writes in its run dir besides checkpoints: their names, how they are written, and
reading the summary back.

Nothing is written through a symbolic link found in a run dir: a link planted where the lock, the
metrics, the summary or a plot belongs could make the run overwrite or append to any file its user
can write. Appended files are opened with ``O_NOFOLLOW``; whole files are written to a fresh
temporary name (``O_EXCL``) and renamed over the old one, which replaces a link rather than following
it. Torch-free: a start of a finished run reads the summary before torch is imported.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ampddp.errors import ConfigError, RunIOError

logger = logging.getLogger("ampddp.observe")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILES = ("loss.png", "eval_accuracy.png", "loss_scale.png")


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary a run wrote (empty when there is none or it does not parse)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8"))
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


def open_no_follow(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` that refuses, in one line, a symbolic link at ``path``."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link; ampddp does not write through links in a run dir (it could write outside it): "
                "remove the link, or use another trainer.run_dir"
            ) from None
        raise


def open_for_append(path: Path) -> TextIO:
    """``path`` opened for appending text (created if missing), refusing a symbolic link."""
    return os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def create_temporary(path: Path) -> tuple[int, Path]:
    """A new file beside ``path`` under a fresh random name, opened for writing: created with
    ``O_EXCL`` (a link planted there is never followed) and the usual mode (0o666 less the umask,
    as ``open`` gives, unlike ``tempfile``'s 0o600)."""
    path = Path(path)
    while True:
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), temporary
        except FileExistsError:
            continue


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` as ``path`` whole: a fresh temporary file in the same folder, fsynced, renamed
    over ``path`` (a link there is replaced, never followed; a crash leaves the old file)."""
    fd, temporary = create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def run_file_errors(path: Path) -> Iterator[None]:
    """An ``OSError`` while writing ``path`` (disk full, I/O error, read-only) as a one-line ``RunIOError``."""
    try:
        yield
    except OSError as error:
        raise RunIOError(f"{path}: cannot write ({error.strerror or error})") from error


def drop_torn_tail(path: Path) -> None:
    """Cut an append-only log back to its last whole line: a record torn by a crash or a full disk
    is dropped (with a warning) before new records follow it, as a database treats a torn log tail."""
    try:
        fd = open_no_follow(path, os.O_RDWR)
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
