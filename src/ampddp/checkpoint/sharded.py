"""Sharded checkpoints: every rank writes its own shards of the model and optimizer state.

Gathering an FSDP2 model into whole tensors costs time and rank 0's host memory; with the sharded
layout each rank writes only what it holds, through ``torch.distributed.checkpoint`` (DCP: files
``__<rank>_<n>.distcp`` and ``.metadata`` in the step folder), and ampddp's guarantees stay: every
file is hashed into the manifest and verified before it is read, the ``COMPLETE`` marker is written
last, non-finite shards are refused on every rank. Reading cuts the saved tensors as the live run
holds them, so a checkpoint saved by N ranks resumes on M, under FSDP2 or as whole tensors (DDP, one
process, ``inspect``, ``export``).

The shared file keeps everything else; its optimizer entry keeps torch's layout (per-parameter
entries by index) without the tensors, and ``SHARDS`` records each sharded tensor's shape and
dtype, so the checks of a resume read no shard. DCP's ``.metadata`` is a pickle: it is read with an
unpickler that knows only DCP's metadata classes, and shard files hold tensors only (loaded with
``weights_only``), so reading a hostile checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from ampddp.checkpoint import keys
from ampddp.checkpoint.keys import METADATA_FILE, is_sharded_file
from ampddp.checkpoint.manifest import FileDigest, Manifest, hash_open_file, read_manifest, verify_file
from ampddp.distributed.data import gather_objects
from ampddp.distributed.env import DistEnv
from ampddp.distributed.full_state import plain_tensor
from ampddp.errors import CheckpointError, CheckpointWriteError
from ampddp.precision.dtypes import dtype_name
from ampddp.torch_compat import is_dtensor

if TYPE_CHECKING:
    from ampddp.checkpoint.dcp_reader import SafeReader

MODEL_PREFIX, OPTIMIZER_PREFIX = "model/", "optimizer/"


# ---- saving -------------------------------------------------------------------------------------
def split_state(
    model_state: Mapping[str, Any], optimizer_state: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(the tensors each rank writes, keyed ``model/<name>`` and ``optimizer/<index>/<entry>``; the
    optimizer state without them; the record of each tensor's shape and dtype for the shared file)."""
    tensors: dict[str, torch.Tensor] = {f"{MODEL_PREFIX}{name}": plain_tensor(value) for name, value in model_state.items()}
    rest: dict[int, dict[str, Any]] = {}
    for index, entries in optimizer_state["state"].items():
        rest[index] = {}
        for entry, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER_PREFIX}{index}/{entry}"] = plain_tensor(value)
            elif _holds_tensors(value):  # rank 0's copy alone would be saved: wrong for per-rank (sharded) values
                raise CheckpointError(
                    f"optimizer state {index}/{entry} holds tensors inside a {type(value).__name__}; the sharded layout saves "
                    "tensors that are a parameter's state entries themselves: use checkpoint layout whole for this optimizer"
                )
            else:
                rest[index][entry] = value
    record = {name: {"shape": list(value.shape), "dtype": dtype_name(value.dtype)} for name, value in tensors.items()}
    return tensors, {**optimizer_state, "state": rest}, record


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensors(item) for item in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensors(item) for item in value)


def local_shards(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What this rank holds of each tensor (a DTensor's local shard), for checks that must not gather."""
    return {name: value.to_local() if is_dtensor(value) else value for name, value in tensors.items()}


def write_shards(folder: Path, tensors: Mapping[str, torch.Tensor], env: DistEnv) -> dict[str, FileDigest]:
    """Write ``tensors`` into ``folder`` collectively (every rank its shards; rank 0 the metadata);
    returns the digests of the files this rank wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True)
    # A tensor every rank holds whole (a buffer) is written once: rank 0's, as the whole layout writes it.
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    try:
        with _one_process_quietly(not env.distributed):
            dcp.save(dict(tensors), storage_writer=writer, planner=planner, no_dist=not env.distributed)
    except CheckpointException as error:  # a BaseException: turned into an error the ranks agree on
        reason = " ".join(str(error).split())[:300]
        raise CheckpointWriteError(f"{folder}: the shards were not written ({reason})") from None
    mine = (f"__{env.rank}_", METADATA_FILE) if env.is_main else (f"__{env.rank}_",)
    written = sorted(path for path in folder.iterdir() if is_sharded_file(path.name) and path.name.startswith(mine))
    digests = {}
    for path in written:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            digests[path.name] = FileDigest(size, hash_open_file(handle, size))
    return digests


# ---- reading ------------------------------------------------------------------------------------
def shard_files(folder: Path, manifest: Manifest) -> list[str]:
    """The shard files the manifest lists, checked to be a sharded checkpoint's (its metadata among
    them, with checksums): a manifest without them cannot vouch for what DCP would read."""
    names = sorted(name for name in manifest.names if is_sharded_file(name))
    if METADATA_FILE not in names:
        raise CheckpointError(f"{folder / keys.COMPLETE_FILE}: a sharded checkpoint without {METADATA_FILE} listed: incomplete")
    if manifest.digests is None:
        raise CheckpointError(f"{folder / keys.COMPLETE_FILE}: a sharded checkpoint must list checksums")
    return names


def verify_shards(folder: Path, manifest: Manifest, env: DistEnv | None = None) -> None:
    """Check the sharded files against the manifest: all of them, or (``env``) this rank's share of
    them (file i by rank i mod world); the caller agrees over the ranks."""
    names = shard_files(folder, manifest)
    for index, name in enumerate(names):
        if env is None or index % env.world_size == env.rank:
            verify_file(folder / name, manifest.digests[name])


def shards_problem(folder: Path, env: DistEnv) -> str | None:
    """The ranks hash a sharded checkpoint's files together (file i by rank i mod world): the first
    problem any rank found (its manifest unreadable included), the same answer on every rank; None
    when all verify (or none are shards)."""
    try:
        manifest = read_manifest(folder)
        if any(is_sharded_file(name) for name in manifest.names):
            verify_shards(folder, manifest, env)
        problem = None
    except CheckpointError as error:
        problem = str(error)
    return next((found for found in gather_objects(problem, env) if found), None)


def _record(shared: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The shards record (name -> shape and dtype), every entry checked: what is read from it next
    (names cut into an optimizer index, shapes made into tensors) cannot fail in another way."""
    record = shared.get(keys.SHARDS)
    if not isinstance(record, dict):
        raise CheckpointError(f"{where}: its {keys.SHARDS!r} record is a {type(record).__name__}, not a mapping of tensor names")
    for name, entry in record.items():
        problem = _entry_problem(name, entry)
        if problem is not None:
            raise CheckpointError(f"{where}: malformed {keys.SHARDS!r} record: entry {str(name)[:120]!r} {problem}")
        _dtype(entry["dtype"], where)
    return record


def _entry_problem(name: Any, entry: Any) -> str | None:
    if not isinstance(name, str):
        return "is not a name"
    if name.startswith(OPTIMIZER_PREFIX):
        index, _, state = name.removeprefix(OPTIMIZER_PREFIX).partition("/")
        if not (index.isdigit() and index.isascii() and state):
            return f"names no optimizer state as {OPTIMIZER_PREFIX}<index>/<entry>"
    elif not name.startswith(MODEL_PREFIX):
        return f"is neither {MODEL_PREFIX}<name> nor {OPTIMIZER_PREFIX}<index>/<entry>"
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return "has no dtype"
    shape = entry.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(type(size) is int and size >= 0 for size in shape):
        return f"has shape {str(shape)[:60]}, not a list of sizes"
    return None


def _dtype(name: str, where: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r} in its {keys.SHARDS!r} record")
    return value


def _merged(shared: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], index_map: Mapping[int, int] | None = None) -> dict[str, Any]:
    """``shared`` with the model and optimizer entries holding ``tensors`` again, in torch's layout (``index_map``: the
    optimizer indices of the files -> the live optimizer's, a pipeline stage's part of a whole model's)."""
    model = {name.removeprefix(MODEL_PREFIX): value for name, value in tensors.items() if name.startswith(MODEL_PREFIX)}
    optimizer = dict(shared[keys.OPTIMIZER])
    state = {index: dict(entries) for index, entries in optimizer["state"].items()}
    for name, value in tensors.items():
        if name.startswith(OPTIMIZER_PREFIX):
            index, entry = name.removeprefix(OPTIMIZER_PREFIX).split("/", 1)
            state.setdefault(int(index) if index_map is None else index_map[int(index)], {})[entry] = value
    optimizer["state"] = state
    return {**shared, keys.MODEL: model, keys.OPTIMIZER: optimizer}


def shape_view(shared: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``shared`` with meta tensors (shape and dtype, no data) in place of the shards: what the checks
    of a resume compare with the live run, without reading a shard."""
    record = _record(shared, where)
    meta = {name: torch.empty(entry["shape"], dtype=_dtype(entry["dtype"], where), device="meta") for name, entry in record.items()}
    return _merged(shared, meta)


def whole_view(folder: Path, shared: Mapping[str, Any], manifest: Manifest, verify: bool = True) -> dict[str, Any]:
    """``shared`` with whole CPU tensors read from the shards (verified first, unless the caller just
    did), in this process alone (no process group needed): for ``inspect``, ``export`` and starting a
    run from these weights."""
    where = str(folder / keys.SHARED_FILE)
    if verify:
        verify_shards(folder, manifest)
    reader = _reader(folder, manifest, _record(shared, where), where)
    tensors = _allocated(lambda: {name: torch.empty(entry["shape"], dtype=_dtype(entry["dtype"], where))
                                  for name, entry in _record(shared, where).items()}, where)  # fmt: skip
    _load(reader, tensors, folder, no_dist=True)
    return _merged(shared, tensors)


def _reader(folder: Path, manifest: Manifest, record: Mapping[str, Mapping[str, Any]], where: str) -> SafeReader:
    """DCP's reader of ``folder``, its metadata read (refused in one line, before DCP would wrap the
    error in its own) and agreeing with ``record`` tensor by tensor before anything is allocated."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ampddp.checkpoint.dcp_reader import SafeReader

    reader = SafeReader(folder, {name: manifest.digests[name].size for name in shard_files(folder, manifest)})
    saved = reader.read_metadata().state_dict_metadata
    for name, entry in record.items():
        found = saved.get(name)
        if (
            not isinstance(found, TensorStorageMetadata)
            or list(found.size) != list(entry["shape"])
            or found.properties.dtype != _dtype(entry["dtype"], where)
        ):
            held = f"{list(found.size)} {found.properties.dtype}" if isinstance(found, TensorStorageMetadata) else "nothing"
            raise CheckpointError(f"{where}: records {name} as {entry['shape']} {entry['dtype']}, but the shards hold {held} for it")
    return reader


def _allocated(make: Callable[[], dict[str, torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
    try:
        return make()
    except (RuntimeError, MemoryError) as error:
        raise CheckpointError(f"{where}: cannot make room for the recorded tensors ({' '.join(str(error).split())[:200]})") from None


@contextlib.contextmanager
def _one_process_quietly(no_dist: bool) -> Iterator[None]:
    """DCP warns that it works in one process, which is what ``no_dist`` asks for: not worth a line."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load(reader: SafeReader, tensors: dict[str, torch.Tensor], folder: Path, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ampddp.checkpoint.dcp_reader import first_line

    try:
        with _one_process_quietly(no_dist):
            dcp.load(tensors, storage_reader=reader, no_dist=no_dist)
    except (Exception, CheckpointException) as error:  # DCP wraps the readers' failures in its own (a BaseException)
        cause = _underlying(error)
        if isinstance(cause, CheckpointError):  # ours: it names the shard file and what is wrong
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(f"{folder}: cannot read the sharded checkpoint ({first_line(cause)})") from None


def _underlying(error: BaseException) -> BaseException:
    """The first failure a DCP ``CheckpointException`` wraps (per rank: the exception and its
    traceback), or ``error`` itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            return first
    return error


def read_into_live(
    folder: Path,
    shared: Mapping[str, Any],
    manifest: Manifest,
    live_model: Mapping[str, Any],
    optimizer: Optimizer,
    env: DistEnv,
    index_map: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """``shared`` with the model and optimizer tensors read from the shards, each cut as the live run
    holds it (an FSDP2 rank reads its own part, a DDP rank the whole); collective over the ranks.
    ``index_map``: the optimizer indices of the files -> the live optimizer's (a pipeline stage, whose
    record lists only its own tensors: ``StageView.restrict``)."""
    where = str(folder / keys.SHARED_FILE)
    reader = _reader(folder, manifest, _record(shared, where), where)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    templates: dict[str, torch.Tensor] = {}
    for name, entry in _record(shared, where).items():
        dtype, shape = _dtype(entry["dtype"], where), torch.Size(entry["shape"])
        like = live_model.get(name.removeprefix(MODEL_PREFIX)) if name.startswith(MODEL_PREFIX) else None
        if name.startswith(OPTIMIZER_PREFIX):
            index = int(name.removeprefix(OPTIMIZER_PREFIX).split("/", 1)[0])
            index = index if index_map is None else index_map[index]
            like = params[index] if index < len(params) else None
        if isinstance(like, torch.Tensor) and like.shape == shape:
            templates[name] = torch.empty_like(plain_tensor(like), dtype=dtype)
        else:
            templates[name] = _allocated(lambda shape=shape, dtype=dtype: {"": torch.empty(shape, dtype=dtype)}, where)[""]
    _load(reader, templates, folder, no_dist=not env.distributed)
    return _merged(shared, templates, index_map)
