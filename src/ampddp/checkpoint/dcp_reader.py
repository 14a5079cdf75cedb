"""DCP's file reader, restricted to what an ampddp sharded checkpoint holds (``checkpoint.sharded``).

DCP's ``.metadata`` is a pickle and names the files and offsets its chunks are read from: read as
torch does, a hostile checkpoint could run code or make DCP read any file the process can. This reader
unpickles the metadata with an unpickler that knows only DCP's metadata classes, lets it point only at
the shard files the manifest lists, checks every chunk to fit its file and not to overlap another
before anything is allocated, and names the shard file a failing read was reading. A module of its
own: importing DCP takes ``torch.distributed.tensor`` and sympy along (0.7 s), which only a sharded
checkpoint's reading needs.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from ampddp.checkpoint.keys import METADATA_FILE, is_sharded_file
from ampddp.checkpoint.manifest import open_checkpoint_file
from ampddp.errors import CheckpointError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "StorageMeta", "MetadataIndex",
                 "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes and torch's dtypes: anything else (a function to call, a bytes
    entry we never write) is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"sharded checkpoint metadata refers to {module}.{name}, which no ampddp checkpoint holds; refused unread")


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by the restricted unpickler and allowed to point
    only at the shard files the manifest lists (``listed``: name -> size), its chunks checked to fit
    them; a failure while reading names the shard file it was reading."""

    def __init__(self, path: Path, listed: Mapping[str, int]) -> None:
        super().__init__(path)
        self.listed = dict(listed)
        self.reading: str | None = None
        opened = self.fs.create_stream

        def recording(where: Any, mode: str) -> Any:
            self.reading = str(where)
            return opened(where, mode)

        self.fs.create_stream = recording

    def read_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_data(*args, **kwargs)
        except Exception as error:  # torch.load's or the stream's, about bytes of one shard file
            reason = "its bytes are not a tensor as DCP writes one (corrupted)" if isinstance(error, pickle.UnpicklingError) else None
            raise CheckpointError(f"{self.reading or self.path}: cannot read a chunk: {reason or first_line(error)}") from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / METADATA_FILE
        try:
            with open_checkpoint_file(path) as handle:
                data = handle.read(self.listed.get(METADATA_FILE, 0) + 1)
        except OSError as error:
            raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError as error:
            raise CheckpointError(f"{path}: {error}") from None
        except Exception as error:  # a damaged pickle: any of pickle's many errors
            raise CheckpointError(f"{path}: unreadable sharded checkpoint metadata ({type(error).__name__})") from None
        if type(metadata).__name__ != "Metadata":
            raise CheckpointError(f"{path}: not a sharded checkpoint's metadata (found a {type(metadata).__name__})")
        from torch.distributed.checkpoint.metadata import StorageMeta

        _check_storage(metadata, path, frozenset(self.listed))
        _check_chunks(metadata, path, self.listed)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage(metadata: Any, path: Path, listed: frozenset[str]) -> None:
    """Every storage entry must point into a shard file of this folder that the manifest lists
    (``listed``: so it was verified), at a plain offset and length, untransformed (what ampddp
    writes): a planted ``../x`` or absolute path would make DCP read any file the process can;
    tensors only (a bytes entry would be unpickled without restriction)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not all(isinstance(entry, TensorStorageMetadata) for entry in getattr(metadata, "state_dict_metadata", {}).values()):
        raise CheckpointError(f"{path}: holds entries that are not tensors, which no ampddp checkpoint writes; refused")
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        plain = isinstance(info, _StorageInfo) and isinstance(info.relative_path, str) and is_sharded_file(info.relative_path)
        plain = plain and info.relative_path != METADATA_FILE and info.relative_path in listed
        plain = plain and all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length))
        if not plain or getattr(info, "transform_descriptors", None):
            where = getattr(info, "relative_path", info)
            raise CheckpointError(f"{path}: points at {str(where)[:120]!r}, not a shard file of this checkpoint; refused unread")


def _check_chunks(metadata: Any, path: Path, sizes: Mapping[str, int]) -> None:
    """Before anything is allocated: each tensor's chunks lie inside its shape and cover it exactly
    once, and each chunk's bytes are declared inside a listed shard file (``sizes``: name -> bytes)
    with room for its elements. A planted metadata file declaring a 4 GiB tensor over a few MB of
    shards, or a truncated shard re-hashed into its manifest, is refused here in one line."""
    located = {(index.fqn, tuple(index.offset or ())): info for index, info in (metadata.storage_data or {}).items()}
    for name, entry in metadata.state_dict_metadata.items():
        shape = tuple(entry.size)
        boxes = []
        for chunk in entry.chunks:
            offsets, lengths = tuple(chunk.offsets), tuple(chunk.sizes)
            inside = len(offsets) == len(lengths) == len(shape)
            if not inside or any(o < 0 or n < 0 or o + n > size for o, n, size in zip(offsets, lengths, shape)):
                raise CheckpointError(f"{path}: a chunk of {name[:120]} at {list(offsets)} of size {list(lengths)} lies outside its "
                                      f"shape {list(shape)}; refused unread")  # fmt: skip
            _check_chunk_bytes(path, name, located.get((name, offsets)), math.prod(lengths) * entry.properties.dtype.itemsize, sizes)
            boxes.append((offsets, lengths))
        if sum(math.prod(lengths) for _, lengths in boxes) != math.prod(shape) or _overlap(boxes):
            raise CheckpointError(f"{path}: the chunks of {name[:120]} do not cover its shape {list(shape)} exactly once; refused unread")


def _check_chunk_bytes(path: Path, name: str, info: Any, needed: int, sizes: Mapping[str, int]) -> None:
    if info is None:
        raise CheckpointError(f"{path}: a chunk of {name[:120]} has no bytes stored for it; refused unread")
    held = sizes.get(info.relative_path, 0)
    if info.length < needed or info.offset + info.length > held:
        raise CheckpointError(
            f"{path}: a chunk of {name[:120]} needs {needed} bytes, declared as {info.length} bytes at offset {info.offset} of "
            f"{info.relative_path}, which holds {held}; refused unread (a truncated shard, or metadata not written with it)"
        )


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the boxes (offsets, sizes) share an element: a sweep along the first dimension
    (shards of FSDP2 never meet there, so each box is compared with its neighbours only)."""
    solid = sorted((box for box in boxes if box[1] and all(box[1])), key=lambda box: box[0][0])
    for index, (offsets, lengths) in enumerate(solid):
        for other, other_lengths in solid[index + 1 :]:
            if other[0] >= offsets[0] + lengths[0]:
                break
            if all(a < b + m and b < a + n for a, n, b, m in zip(offsets, lengths, other, other_lengths)):
                return True
    return False


def first_line(error: BaseException) -> str:
    """``Type: the first line of the message``, cut to 200 characters: what a reader needs of a failure."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}"[:200] if text else type(error).__name__
