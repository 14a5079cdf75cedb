"""A checkpoint's ``COMPLETE`` manifest and the checks made with it, without torch.

Reading a manifest and verifying the files it lists (size and XXH3-128 checksum) needs no torch, so
``ampddp train`` can tell a finished run from its last checkpoint before importing torch (see
``ampddp.recipe.finished``); the checkpoint store and loader use the same functions.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ampddp.checkpoint import keys
from ampddp.errors import CheckpointError, ConfigError
from ampddp.rundir.beneath import file_kind, link_refused, open_beneath

CHECKSUM = "xxh3_128"
"""The checksum of every checkpoint file: XXH3-128 runs at memory speed (~10 GiB/s on one core, vs
~0.6 for blake2b and ~1.1 for SHA-256 with CPU SHA extensions), so hashing costs a save or load
only a few percent. It detects corruption, not tampering (the weights-only loader handles that)."""


def new_hasher() -> Any:
    """A fresh XXH3-128 hasher (``update(bytes-like)``, ``hexdigest()``)."""
    try:
        import xxhash
    except ImportError:  # a dependency in setup.py; only a broken install lacks it
        raise CheckpointError("checkpoint checksums need the xxhash package, which is missing: pip install xxhash") from None
    return xxhash.xxh3_128()


@dataclass(frozen=True)
class FileDigest:
    """Size in bytes and checksum of one checkpoint file, as recorded in ``COMPLETE``."""

    size: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, CHECKSUM: self.checksum}

    @classmethod
    def from_json(cls, entry: Any, where: str) -> FileDigest:
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get(CHECKSUM), str):
            raise CheckpointError(f"{where}: malformed manifest entry {entry!r}; expected {{'size': int, '{CHECKSUM}': hex}}")
        return cls(entry["size"], entry[CHECKSUM])


def hash_open_file(handle: BinaryIO, size: int) -> str:
    """Checksum of the first ``size`` bytes of an open file: one pass over a read-only mapping (no copy)."""
    hasher = new_hasher()
    if size > 0:
        try:
            mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            mapping = None
        if mapping is not None:
            with mapping:
                hasher.update(mapping)
        else:  # file systems or platforms without mmap
            handle.seek(0)
            while chunk := handle.read(16 * 2**20):
                hasher.update(chunk)
    return hasher.hexdigest()


def verify_file(path: Path, expected: FileDigest) -> None:
    """Raise ``CheckpointError`` naming ``path`` unless it has ``expected``'s size and checksum."""
    path = Path(path)
    try:
        with open_checkpoint_file(path) as handle:
            _verify_open_file(path, handle, expected)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({expected.size} bytes listed in {path.parent.name}/COMPLETE)") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read checkpoint file ({error.strerror or error})") from None


def open_checkpoint_file(path: Path) -> BinaryIO:
    """``path`` open for reading: a regular file, not a link (a checkpoint's files are ampddp's own,
    never links) nor a FIFO or device (which would block or never end); else a ``CheckpointError``."""
    try:
        return os.fdopen(open_beneath(Path(path).parent, Path(path), os.O_RDONLY), "rb")
    except ConfigError as error:
        raise CheckpointError(f"{error}: not a checkpoint file ampddp wrote") from None


def _size_mismatch(path: Path, size: int, expected: FileDigest) -> CheckpointError:
    return CheckpointError(
        f"{path}: size mismatch: {size} bytes on disk, {expected.size} recorded in COMPLETE (the file is truncated or was replaced)"
    )


def check_size(path: Path, expected: FileDigest) -> None:
    """Raise ``CheckpointError`` naming ``path`` unless it exists with ``expected``'s size (no hashing)."""
    try:
        found = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(found.st_mode):
            raise CheckpointError(f"{path} is {file_kind(found.st_mode)}, not a regular file: not a checkpoint file ampddp wrote")
        size = found.st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({expected.size} bytes listed in {Path(path).parent.name}/COMPLETE)") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read checkpoint file ({error.strerror or error})") from None
    if size != expected.size:
        raise _size_mismatch(path, size, expected)


def _verify_open_file(path: Path, handle: BinaryIO, expected: FileDigest) -> None:
    size = os.fstat(handle.fileno()).st_size
    if size != expected.size:
        raise _size_mismatch(path, size, expected)
    actual = hash_open_file(handle, size)
    if actual != expected.checksum:
        raise CheckpointError(
            f"{path}: checksum mismatch: {CHECKSUM} {actual} on disk, {expected.checksum} recorded in COMPLETE (the file is corrupted)"
        )


UNVERIFIED = "not verified (written before checksums)"
VERIFIED = "verified"


@dataclass(frozen=True)
class Manifest:
    """The content of a ``COMPLETE`` marker.

    ``digests`` maps each file name to its size and checksum; ``None`` for a marker written before
    checksums (its ``files`` were a list of names), which can be checked for presence only.
    """

    step: int | None
    world_size: int | None
    names: tuple[str, ...]
    digests: dict[str, FileDigest] | None
    run: dict[str, Any] | None = None
    """What the run looked like at this checkpoint (``progress``, ``config_sha256``, ``ampddp``
    version), for telling a finished run without loading it; None in markers written before it."""

    @property
    def verifiable(self) -> bool:
        return self.digests is not None


MAX_MANIFEST_BYTES = 64 * 2**20
"""The largest ``COMPLETE`` read: a manifest lists two short entries per rank (~130 bytes each), so
this allows some 250,000 ranks, and a planted multi-GiB marker is refused rather than read whole."""


def read_manifest(folder: Path) -> Manifest:
    """Parse ``folder/COMPLETE``; a missing, oversized or malformed marker is a ``CheckpointError``
    naming it. Every name it lists must be a plain file name of ``folder``: a manifest that points
    elsewhere (``../x``, ``/etc/passwd``) is refused before any file is read, so checking it can
    neither read outside the checkpoint nor reveal the checksum of another file."""
    marker = Path(folder) / keys.COMPLETE_FILE
    content = _marker_content(folder, marker)
    files = content.get("files") if isinstance(content, dict) else None
    world_size = content.get("world_size") if isinstance(content, dict) else None
    if not isinstance(files, (dict, list)) or not (world_size is None or (isinstance(world_size, int) and world_size >= 1)):
        raise CheckpointError(f"{marker}: malformed completion marker: expected JSON with 'files' and 'world_size' (an integer >= 1)")
    names = tuple(files)
    for name in names:
        if not _is_plain_file_name(name):
            raise CheckpointError(
                f"{marker}: lists {str(name)[:120]!r}, which is not a file name of this checkpoint folder "
                "(names may not hold path separators or be '.', '..' or empty); refused without reading it"
            )
    if world_size is not None and world_size > len(names):
        raise CheckpointError(f"{marker}: declares {world_size} ranks but lists {len(names)} files: incomplete or not written by ampddp")
    if isinstance(files, list):  # written before checksums: names only
        return Manifest(content.get("step"), world_size, names, None)
    digests = {name: FileDigest.from_json(entry, f"{marker} ({name})") for name, entry in files.items()}
    run = content.get("run")
    return Manifest(content.get("step"), world_size, names, digests, run if isinstance(run, dict) else None)


def _marker_content(folder: Path, marker: Path) -> Any:
    """The marker's JSON, read no further than ``MAX_MANIFEST_BYTES``."""
    try:
        with open_checkpoint_file(marker) as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            limit = MAX_MANIFEST_BYTES // 2**20
            raise CheckpointError(f"{marker}: completion marker larger than {limit} MiB, far beyond any manifest: not one ampddp wrote")
        return json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: incomplete checkpoint (no {keys.COMPLETE_FILE} marker: the save was interrupted)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{marker}: unreadable completion marker ({str(error).splitlines()[0][:120]})") from None


def _is_plain_file_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and Path(name).name == name
    )


def verify_folder(folder: Path, manifest: Manifest, sized_only: Callable[[str], bool] | None = None) -> str:
    """Check every file of the checkpoint in ``folder`` against its manifest; returns ``VERIFIED`` or
    ``UNVERIFIED`` (an old marker: files present, no checksums to compare). Anything wrong — a file
    missing, truncated or corrupted, a rank file absent — is a ``CheckpointError`` naming the file
    and what is wrong. ``sized_only(name)``: files whose size alone is checked here, their checksums
    left to the caller (the shards of a sharded checkpoint, which the ranks verify together)."""
    folder = Path(folder)
    marker = folder / keys.COMPLETE_FILE
    required = [keys.SHARED_FILE] + [keys.RANK_FILE.format(rank=r) for r in range(manifest.world_size or 0)]
    for name in required:
        if name not in manifest.names:
            raise CheckpointError(f"{marker}: incomplete checkpoint: {name} is not listed (saved by {manifest.world_size} rank(s))")
    missing = sorted((n for n in manifest.names if not (folder / n).is_file()), key=lambda n: (n != keys.SHARED_FILE, n))
    if missing:
        others = f"; also missing: {', '.join(missing[1:])}" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder / missing[0]}: missing (listed in {keys.COMPLETE_FILE}){others}")
    for name, digest in (manifest.digests or {}).items():
        if sized_only is not None and sized_only(name):
            check_size(folder / name, digest)
        else:
            verify_file(folder / name, digest)
    return VERIFIED if manifest.verifiable else UNVERIFIED


def step_folders_in(root: Path) -> list[Path]:
    """Every ``step-<N>`` folder directly under ``root`` (a run's ``checkpoints/``), oldest first; a
    link there is no checkpoint of this run and is passed over, and ``root`` itself a link is refused
    (ConfigError): pruning through it would remove folders outside the run dir."""
    root = Path(root)
    if root.is_symlink():
        raise link_refused(root)
    if not root.is_dir():
        return []
    found = [folder for folder in root.iterdir() if step_of(folder) is not None and not folder.is_symlink() and folder.is_dir()]
    return sorted(found, key=lambda folder: step_of(folder) or 0)


def complete_folders(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<N>`` folder under ``root`` with a ``COMPLETE`` marker, as (step, folder), oldest first."""
    return [(step_of(folder) or 0, folder) for folder in step_folders_in(root) if (folder / keys.COMPLETE_FILE).is_file()]


def config_digest(config: dict[str, Any]) -> str:
    """SHA-256 of a run's settings in canonical JSON: what a manifest records to say which settings
    the run had, so a later start can tell "the same run" without loading the checkpoint. The run
    dir (``trainer.run_dir``) is left out: a run dir moved or copied elsewhere holds the same run."""
    trainer = config.get("trainer")
    if isinstance(trainer, dict) and "run_dir" in trainer:
        config = {**config, "trainer": {key: value for key, value in trainer.items() if key != "run_dir"}}
    canonical = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def step_of(folder: Path) -> int | None:
    """The step of a ``step-<N>`` checkpoint folder, or None for any other name."""
    name = folder.name
    if not name.startswith(keys.STEP_DIR_PREFIX):
        return None
    digits = name[len(keys.STEP_DIR_PREFIX) :]
    return int(digits) if digits.isdigit() else None
