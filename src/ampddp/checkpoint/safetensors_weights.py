"""Weights to start from in safetensors: one file (``ampddp export``'s) or a folder of them (Hugging
Face's ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``), read tensor by
tensor and, for a sharded model, slice by slice: each rank reads only the bytes of the part it holds.

Everything is checked from the files' headers before a byte of a tensor is read: the files are plain
files (a FIFO would block the read), the index names files inside its own folder and is bounded in
size, every name (after ``model.key_map``'s renames) is one of the model's tensors with its shape, and
no floating tensor is loaded into an integer one or the other way round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampddp.checkpoint.restore import check_model_state, load_model_state
from ampddp.distributed.meta_init import ModelBuild
from ampddp.errors import CheckpointError, ConfigError

logger = logging.getLogger("ampddp.checkpoint")
DIGESTS_KEY = "sha256"
"""The metadata entry in which ``ampddp export`` writes each tensor's SHA-256 (of its bytes as stored), as JSON."""
CHUNK_BYTES = 64 << 20
"""How much of a tensor verification reads at a time: memory stays bounded whatever the tensor's size."""
INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20
"""An index of a 100B-parameter model's tensors is a few MiB: past this it is not an index."""

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""safetensors' dtype names as torch dtypes."""


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of ``tensor``'s bytes as safetensors stores them (row-major, little-endian)."""
    return _hashed(hashlib.sha256(), tensor).hexdigest()


def _hashed(hasher: Any, tensor: torch.Tensor) -> Any:
    hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher


def is_safetensors_source(path: str | Path) -> bool:
    """Whether ``path`` names safetensors weights: a ``*.safetensors`` file, or a folder holding an index or
    ``*.safetensors`` files directly (an ampddp run dir or checkpoint folder holds neither)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return True
    return path.is_dir() and ((path / INDEX_NAME).exists() or any(path.glob("*.safetensors")))


def _plain_file(path: Path) -> Path:
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read it ({error.strerror or error})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file; weights are read from plain files only")
    return path


def _files_of(path: Path) -> list[Path]:
    """The safetensors files ``path`` names: itself, the files its index names, or the folder's ``*.safetensors``."""
    if not path.is_dir():
        return [_plain_file(path)]
    index = path / INDEX_NAME
    if index.exists():
        return [_plain_file(path / name) for name in _indexed_names(index)]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: holds no *.safetensors file and no {INDEX_NAME}")
    return [_plain_file(file) for file in files]


def _indexed_names(index: Path) -> list[str]:
    """The file names a Hugging Face index maps the tensors to, each a plain name in its own folder."""
    if _plain_file(index).stat().st_size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{index}: larger than {MAX_INDEX_BYTES >> 20} MiB: not a safetensors index")
    try:
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({type(error).__name__})") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{index}: names file {name!r}; an index names files of its own folder")
    return names


@dataclass(frozen=True)
class _Entry:
    file: Path
    name: str
    """The tensor's name in its file."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: str | None = None
    """Its SHA-256 as ``ampddp export`` wrote it in the file's metadata (None: the file gives none)."""


def _digests(metadata: Mapping[str, str], file: Path) -> dict[str, str]:
    """The per-tensor digests in a file's metadata (``ampddp export``'s), by the names in the file."""
    if DIGESTS_KEY not in metadata:
        return {}
    try:
        digests = json.loads(metadata[DIGESTS_KEY])
    except ValueError:
        digests = None
    if not isinstance(digests, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
        raise CheckpointError(f"{file}: its metadata's {DIGESTS_KEY!r} entry is not a mapping of tensor names to digests")
    return digests


def _changed(entry: _Entry) -> str:
    return f"{entry.file}: tensor {entry.name!r} does not match the SHA-256 its export wrote: the file changed"


def _renamed(name: str, key_map: Mapping[str, str | None]) -> str | None:
    """``name`` after the first rule of ``key_map`` whose pattern matches all of it (None: dropped)."""
    for pattern, replacement in key_map.items():
        match = re.fullmatch(pattern, name)
        if match is not None:
            return None if replacement is None else match.expand(replacement)
    return name


def check_key_map(key_map: Any, where: str = "model.key_map") -> dict[str, str | None]:
    """``key_map`` as {regular expression: replacement or null}, each pattern compiled; one line otherwise."""
    if not isinstance(key_map, Mapping):
        raise ConfigError(f"{where}={key_map!r} is not valid; give a mapping of regular expressions to new names (or null to drop)")
    for pattern, replacement in key_map.items():
        if not isinstance(pattern, str) or not (replacement is None or isinstance(replacement, str)):
            raise ConfigError(f"{where} entry {pattern!r}: {replacement!r} is not valid; patterns and names are strings (null drops)")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigError(f"{where} entry {pattern!r} is not a regular expression ({error})") from None
    return dict(key_map)


class SafetensorsWeights:
    """The tensors of safetensors files by the names the model gives them, read whole or in part."""

    def __init__(self, path: str | Path, key_map: Mapping[str, str | None] | None = None) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self.entries: dict[str, _Entry] = {}
        self.metadata: dict[str, str] = {}
        key_map = check_key_map(key_map or {})
        for file in _files_of(self.path):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    handle_metadata = handle.metadata() or {}
                    self.metadata.update(handle_metadata)
                    headers = [(name, handle.get_slice(name)) for name in handle.keys()]  # noqa: SIM118 (not a dict)
                    found = [(name, tuple(part.get_shape()), part.get_dtype()) for name, part in headers]
            except (OSError, SafetensorError) as error:
                reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
                raise CheckpointError(f"{file}: not a readable safetensors file ({reason})") from None
            digests = _digests(handle_metadata, file)
            for name, shape, dtype_name in found:
                self._add(file, name, _renamed(name, key_map), shape, dtype_name, digests.get(name))

    def _add(self, file: Path, name: str, renamed: str | None, shape: tuple[int, ...], dtype_name: str, digest: str | None) -> None:
        if renamed is None:
            return
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype_name}, which torch cannot load")
        if renamed in self.entries:
            first = self.entries[renamed]
            raise CheckpointError(
                f"{self.path}: two tensors become {renamed!r} ({first.name!r} in {first.file.name} and {name!r} in {file.name}); "
                "fix model.key_map or the files"
            )
        self.entries[renamed] = _Entry(file, name, shape, DTYPES[dtype_name], digest)

    def check_against(self, module: nn.Module) -> None:
        """One line naming missing, unexpected and misshapen tensors, or floating weights for integer
        tensors (and back), before anything is read or allocated."""
        shapes = {name: torch.empty(entry.shape, dtype=entry.dtype, device="meta") for name, entry in self.entries.items()}
        check_model_state(shapes, module, str(self.path))
        for name, tensor in module.state_dict().items():
            entry = self.entries[name]
            if entry.dtype.is_floating_point != tensor.dtype.is_floating_point:
                raise CheckpointError(f"{self.path}: {name!r} is {entry.dtype} there and {tensor.dtype} in the model")

    def names(self) -> set[str]:
        return set(self.entries)

    def verify(self, rank: int = 0, world_size: int = 1) -> list[str]:
        """Check the tensors that are this rank's share (every ``world_size``-th by name, from ``rank``)
        against the digests ``ampddp export`` wrote, reading each in bounded chunks; what differs, in
        words (empty: all match, or the files carry no digests)."""
        problems = []
        with self.reading() as reader:
            for name in sorted(self.entries)[rank::world_size]:
                entry = self.entries[name]
                if entry.digest is not None and reader.digest(name) != entry.digest:
                    problems.append(_changed(entry))
        return problems

    @contextmanager
    def reading(self) -> Iterator[_Reader]:
        """A reader of these weights' tensors."""
        yield _Reader(self)

    def whole(self) -> dict[str, torch.Tensor]:
        """Every tensor whole (a model that is not sharded), each checked against its export digest."""
        with self.reading() as reader:
            tensors = {name: reader.read(name) for name in self.entries}
        for name, tensor in tensors.items():
            entry = self.entries[name]
            if entry.digest is not None and tensor_digest(tensor) != entry.digest:
                raise CheckpointError(_changed(entry))
        return tensors


class _Reader:
    """Reads tensors, whole or in part. Each read maps its file and unmaps it again: the file's pages it
    touched leave the resident set with it, so a rank reading its slices of a large model holds those
    slices and at most one read's pages of the file, not every page it has read so far."""

    def __init__(self, weights: SafetensorsWeights) -> None:
        self._weights = weights

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, or the part ``index`` (a slice per leading dimension) of it: only those bytes are read."""
        from safetensors import safe_open

        entry = self._weights.entries[name]
        with safe_open(str(entry.file), framework="pt") as handle:
            return handle.get_tensor(entry.name) if index is None else handle.get_slice(entry.name)[index]

    def digest(self, name: str) -> str:
        """SHA-256 of tensor ``name``'s bytes, read a bounded run of rows at a time."""
        entry = self._weights.entries[name]
        if not entry.shape:
            return tensor_digest(self.read(name))
        row_bytes = max(1, math.prod(entry.shape[1:]) * entry.dtype.itemsize)
        rows = max(1, CHUNK_BYTES // row_bytes)
        hasher = hashlib.sha256()
        for start in range(0, entry.shape[0], rows):
            _hashed(hasher, self.read(name, (slice(start, min(start + rows, entry.shape[0])),)))
        return hasher.hexdigest()


def weights_into(built: ModelBuild, weights: SafetensorsWeights) -> ModelBuild:
    """``built`` starting from ``weights``, checked against it first: a meta build reads each rank's part
    of every tensor once sharded (no rank reads or holds the whole model); a whole model loads them now."""
    weights.check_against(built.module)
    if built.init is not None:
        logger.info("weights from %s: %d tensors, each rank reading the slices it holds", weights.path, len(weights.entries))
        return dataclasses.replace(built, init=dataclasses.replace(built.init, weights=weights))
    load_model_state(weights.whole(), built.module, str(weights.path))
    logger.info("weights from %s: %d tensors", weights.path, len(weights.entries))
    return built
