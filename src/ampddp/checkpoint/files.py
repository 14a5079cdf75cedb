"""Atomic, durable writes and safe, verified reads of single checkpoint files.

Write: temporary file in the same directory, flush + fsync, ``os.replace``, fsync the directory,
so a crash at any moment leaves either the old file or the complete new one. The bytes are hashed
(xxHash XXH3-128) as they stream to disk, and the writer returns the file's ``FileDigest`` (size and
checksum) for the checkpoint's ``COMPLETE`` manifest. Read: ``torch.load(weights_only=True)`` only;
given the expected digest, the file's size and checksum are checked first (one pass over the mapped
file, which ``torch.load(mmap=True)`` then reads without another copy). Every failure becomes a
one-line ``CheckpointError`` that names the file, and nothing on disk is touched.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ampddp.checkpoint.manifest import FileDigest, new_hasher, verify_file
from ampddp.errors import CheckpointError, CheckpointWriteError
from ampddp.rundir.beneath import replace_beneath


def fsync_directory(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, root: Path | None = None) -> FileDigest:
    """Write ``data`` to ``path`` atomically and durably; returns its digest. ``root``: the folder
    (the run dir) below which no link is followed on the way to ``path`` (default: its own folder)."""
    hasher = new_hasher()
    hasher.update(data)
    _write_atomic(Path(path), lambda handle: handle.write(data), root)
    return FileDigest(len(data), hasher.hexdigest())


def _write_atomic(path: Path, write: Callable[[BinaryIO], Any], root: Path | None) -> None:
    """A fresh temporary name (``O_EXCL``: a link planted at a predictable one is never followed),
    fsynced and renamed over ``path``, its folder fsynced (see ``rundir.beneath.replace_beneath``)."""
    try:
        replace_beneath(Path(root or path.parent), path, write)
    except OSError as error:
        raise CheckpointWriteError(f"{path}: cannot write checkpoint file ({error.strerror or error})") from error


class _WritebackAsYouGo(io.RawIOBase):
    """File wrapper that starts the kernel's writeback of each finished stretch while serialisation
    goes on, so the closing fsync waits only for the tail instead of the whole file (a checkpoint
    saves at ~0.9 or more of a plain, non-durable ``torch.save`` instead of ~0.7). Every byte
    is hashed on its way through (torch's zip writer writes strictly in order, never seeking back),
    so the file's digest costs no second pass over the data."""

    STRETCH = 4 * 2**20

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__()
        self._handle = handle
        self._hint = getattr(os, "posix_fadvise", None)
        self._start = self._pending = self.size = 0
        self.hasher = new_hasher()
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            written = self._handle.write(data)
        except OSError as error:
            self.error = error  # torch's writer reports it as "unexpected pos"; save_atomic re-raises this
            raise
        view = memoryview(data).cast("B")
        self.hasher.update(view if written == len(view) else view[:written])
        self.size += written
        self._pending += written
        if self._pending >= self.STRETCH and self._hint is not None:
            self._handle.flush()
            with contextlib.suppress(OSError):  # only a hint: some file systems refuse it
                self._hint(self._handle.fileno(), self._start, self._pending, os.POSIX_FADV_DONTNEED)
            self._start += self._pending
            self._pending = 0
        return written


def save_atomic(obj: Any, path: Path, root: Path | None = None) -> FileDigest:
    """``torch.save`` ``obj`` to ``path`` atomically and durably (streamed: no extra copy in memory);
    returns the file's size and checksum, computed from the bytes as they were written. ``root``: as
    for ``write_bytes_atomic``."""
    writers: list[_WritebackAsYouGo] = []

    def write(handle: BinaryIO) -> None:
        writers.append(_WritebackAsYouGo(handle))
        try:
            torch.save(obj, writers[0])
        except RuntimeError:
            if writers[0].error is not None:  # the file system's own error (disk full), not torch's wording of it
                raise writers[0].error from None
            raise

    _write_atomic(Path(path), write, root)
    return FileDigest(writers[0].size, writers[0].hasher.hexdigest())


def refuse_inflating_entries(path: Path) -> None:
    """Refuse a zip-format file whose entries would inflate beyond the file: torch.save stores every
    entry uncompressed, so a compressed entry, or one declaring more bytes than the whole file holds,
    is a decompression bomb (a 1 MiB file declaring 1 GiB), never a checkpoint."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # not a zip (torch's legacy format, or garbage): torch.load's own error names it
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > size:
            raise CheckpointError(
                f"{path}: entry {entry.filename[:80]!r} declares {entry.file_size} bytes in a {size}-byte file"
                f"{' (compressed)' if entry.compress_type != zipfile.ZIP_STORED else ''}; torch.save never compresses: "
                "refused unread (a decompression bomb, not a checkpoint)"
            )


def load_safely(path: Path, map_location: Any = "cpu", expected: FileDigest | None = None) -> dict[str, Any]:
    """Load a checkpoint file with ``weights_only=True``; raise CheckpointError naming what is wrong.

    With ``expected`` (from the checkpoint's manifest) the size and checksum are verified before
    anything is unpickled, and the verified file is memory-mapped rather than copied.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if expected is not None:
        verify_file(path, expected)
    refuse_inflating_entries(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=expected is not None)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "unreadable")
        if "GLOBAL" in reason:
            raise CheckpointError(
                f"{path}: refused to load: it holds Python objects other than tensors and plain data, which could run "
                f"code when unpickled; only tensors and plain containers are accepted ({reason[:160]})"
            ) from None
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint, or not a torch checkpoint file ({reason[:160]})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: truncated or corrupted checkpoint file ({reason[:200]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of state, found {type(state).__name__}")
    return state
