"""Paths beneath a run dir, reached without following a link at any component.

A run writes irreplaceable state into its run dir, and only there. ``O_NOFOLLOW`` on a file's own
name is not enough: a folder above it (``checkpoints/``, ``csv/``) that is a link to somewhere else
would carry every write through it. So a path beneath a ``root`` (the run dir, or the folder a user
named) is reached one component at a time from a descriptor of ``root``, each folder opened with
``O_DIRECTORY | O_NOFOLLOW`` relative to the one before (``openat``), and the file itself with
``O_NOFOLLOW | O_NONBLOCK`` and checked to be a regular file before any read or write (a FIFO would
block, a device read without end). ``root`` itself may be a link: that is where the user put the run.

Libraries that take a path (TensorBoard's writer, W&B's dir, MLflow's SQLite file) get the path
after :func:`checked_folder` / :func:`refuse_links` walked it the same way. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ampddp.errors import ConfigError

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    return next((kind for test, kind in _KINDS if test(mode)), "a regular file")


def link_refused(path: Path) -> ConfigError:
    return ConfigError(
        f"{path} is a symbolic link; ampddp does not write through links in a run dir (it could write outside it): "
        "remove the link, or use another trainer.run_dir"
    )


def not_regular(path: Path, mode: int) -> ConfigError:
    return ConfigError(
        f"{path} is {file_kind(mode)}, not a regular file; ampddp reads and writes only regular files: remove it, or name a file"
    )


def _not_a_folder(path: Path, mode: int | None) -> ConfigError:
    what = "not a directory" if mode is None else file_kind(mode)
    return ConfigError(f"{path} is {what} where ampddp keeps a folder of the run: remove it, or use another trainer.run_dir")


def parts_beneath(root: Path, path: Path) -> tuple[str, ...]:
    """``path``'s components below ``root`` (``path`` is ``root`` itself or inside it, as a caller builds it)."""
    relative = Path(path).relative_to(root)
    if any(part == ".." for part in relative.parts):
        raise ValueError(f"{path} is not beneath {root}")
    return relative.parts


def _open_folder(parent: int, name: str, where: Path, create: bool) -> int:
    """The folder ``name`` of the folder open as ``parent``, created when missing and ``create``."""
    try:
        return os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as error:
        raise _refusal(parent, name, where, error) from None
    with contextlib.suppress(FileExistsError):  # another rank made it a moment ago
        os.mkdir(name, 0o777, dir_fd=parent)
    try:
        return os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    except OSError as error:
        raise _refusal(parent, name, where, error) from None


def _refusal(parent: int, name: str, where: Path, error: OSError) -> Exception:
    """What to raise for ``error`` opening folder ``name``: a link or a non-folder there named in one line."""
    if error.errno not in (errno.ELOOP, errno.ENOTDIR):
        return error
    found = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    return link_refused(where) if stat.S_ISLNK(found) else _not_a_folder(where, found)


@contextlib.contextmanager
def folder_descriptor(root: Path, folder: Path, create: bool = False) -> Iterator[int]:
    """A descriptor of ``folder`` (``root`` or beneath it), reached from ``root`` without following a
    link below it; missing folders are created when ``create``. Closed on leaving."""
    root = Path(root)
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = root
        for name in parts_beneath(root, folder):
            where = where / name
            inner = _open_folder(fd, name, where, create)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def open_beneath(root: Path, path: Path, flags: int, mode: int = 0o644, create_folders: bool = False) -> int:
    """``os.open(path, flags)`` of a regular file beneath ``root``, no link followed at any component
    below ``root`` and a special file refused (ConfigError naming it) before any read or write."""
    path = Path(path)
    with folder_descriptor(root, path.parent, create=create_folders) as folder:
        try:
            fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=folder)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise link_refused(path) from None
            if error.errno == errno.ENXIO:  # a FIFO opened for writing without a reader
                raise not_regular(path, stat.S_IFIFO) from None
            raise
    try:
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise not_regular(path, found)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_beneath(root: Path, path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` beneath ``root``, at most ``limit``: a bigger file is
    refused unread (ConfigError naming ``what`` it should be and the bound)."""
    with os.fdopen(open_beneath(root, path, os.O_RDONLY), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise ConfigError(f"{path}: {max(size, len(data))} bytes; {what} is at most {limit} bytes here (refused unread)")
    return data


TEMPORARY_NAME = ".ampddp-{token}.tmp"
"""A file written whole before it is renamed over its target: a fixed length (28 bytes) whatever the
target's name, so a target named at the file system's NAME_MAX (255 bytes) is written too (a name made
from the target's was longer than the target's, and failed with ENAMETOOLONG)."""


def replace_beneath(root: Path, path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` whole: ``write`` fills a fresh temporary file beside it (``O_EXCL``, a random
    name of ``TEMPORARY_NAME``'s form, the usual mode: 0o666 less the umask), which is fsynced and renamed
    over ``path`` (a link or FIFO there is replaced, never followed or opened); the folder is fsynced so
    the rename lasts. A crash leaves the old file; a failure removes the temporary."""
    path = Path(path)
    with folder_descriptor(root, path.parent) as folder:
        while True:
            temporary = TEMPORARY_NAME.format(token=secrets.token_hex(8))
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=folder)
                break
            except FileExistsError:
                continue
        try:
            with os.fdopen(fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=folder)
            raise
        with contextlib.suppress(OSError):  # some file systems refuse fsync on a folder
            os.fsync(folder)


def remove_beneath(root: Path, path: Path) -> None:
    """Remove the file or folder tree ``path`` beneath ``root`` (a link there is removed, never
    followed; ``shutil.rmtree`` with a folder descriptor never leaves the tree either)."""
    path = Path(path)
    with contextlib.ExitStack() as stack:
        try:
            folder = stack.enter_context(folder_descriptor(root, path.parent))
            found = os.stat(path.name, dir_fd=folder, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(found):
            shutil.rmtree(path.name, dir_fd=folder)
        else:
            os.unlink(path.name, dir_fd=folder)


def checked_folder(root: Path, folder: Path) -> Path:
    """``folder`` beneath ``root``, created where missing, with no link at any component below
    ``root``: for a library that takes a path (it opens what it finds there)."""
    with folder_descriptor(root, folder, create=True):
        return Path(folder)


def refuse_links(root: Path, path: Path) -> Path:
    """``path`` beneath ``root`` unless a component below ``root`` is a link or ``path`` is a special
    file (ConfigError naming it): for a library that opens the file by its path. A missing ``path``
    passes (the library creates it)."""
    path = Path(path)
    try:
        with folder_descriptor(root, path.parent) as folder:
            found = os.stat(path.name, dir_fd=folder, follow_symlinks=False).st_mode
    except FileNotFoundError:  # nothing there yet, nor a link to follow
        return path
    if stat.S_ISLNK(found):
        raise link_refused(path)
    if not stat.S_ISREG(found):
        raise not_regular(path, found)
    return path


def rename_beneath(root: Path, source: Path, target: Path) -> None:
    """``os.replace(source, target)``, both beneath ``root`` and reached without following a link
    below it (the target's folder is created when missing)."""
    source, target = Path(source), Path(target)
    with folder_descriptor(root, source.parent) as origin, folder_descriptor(root, target.parent, create=True) as destination:
        os.replace(source.name, target.name, src_dir_fd=origin, dst_dir_fd=destination)
        with contextlib.suppress(OSError):
            os.fsync(destination)
            os.fsync(origin)
