"""Checkpoint save/load vs raw torch.save/torch.load of the same tensors, with raw disk bandwidth,
and the checksum every checkpoint file gets (XXH3-128) vs hashlib's SHA-256 and BLAKE2b."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch
from harness import Budget, Row, side_by_side

from ampddp.checkpoint.files import load_safely, save_atomic
from ampddp.checkpoint.manifest import CHECKSUM, hash_open_file


def _disk_bandwidth(folder: Path, size: int) -> float:
    data = os.urandom(size)
    path = folder / "bandwidth.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return size / elapsed / 2**20


def run(device: str, budget: Budget) -> list[Row]:
    size_mb = budget.pick(4, 32, 256)
    state = {f"layer{i}.weight": torch.randn(size_mb * 2**20 // 4 // 16) for i in range(16)}
    # Beside the results, not in /tmp: /tmp is often a RAM file system, where fsync costs nothing.
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".ampddp-bench-") as tmp:
        folder = Path(tmp)
        ours_path, raw_path = folder / "ours.pt", folder / "raw.pt"
        repeats = budget.pick(1, 5, 7)

        digests = []

        def ours_save() -> None:
            digests[:] = [save_atomic(state, ours_path)]

        def raw_save() -> None:
            torch.save(state, raw_path)

        bandwidth = _disk_bandwidth(folder, size_mb * 2**20)
        save = side_by_side("checkpoint/save", ours_save, raw_save, repeats=repeats, per=size_mb, unit="MiB/s", throughput=True,
                            note=f"atomic + fsync'd + {CHECKSUM} of the stream vs plain torch.save; "
                                 f"raw disk write {bandwidth:.0f} MiB/s (fsync'd)")  # fmt: skip

        def durable_raw_save() -> None:
            with open(raw_path, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())

        durable = side_by_side("checkpoint/save-vs-fsynced-torch-save", ours_save, durable_raw_save, repeats=repeats, per=size_mb,
                               unit="MiB/s", throughput=True, note="same durability: torch.save, then fsync")  # fmt: skip

        def ours_load() -> None:
            load_safely(ours_path, expected=digests[0])

        def raw_load() -> None:
            torch.load(raw_path, weights_only=False)

        load = side_by_side("checkpoint/load", ours_load, raw_load, repeats=repeats, per=size_mb, unit="MiB/s", throughput=True,
                            note=f"size + {CHECKSUM} verified, then weights_only=True (mmap'd) vs plain torch.load")  # fmt: skip

        def ours_hash() -> None:
            with open(ours_path, "rb") as handle:
                hash_open_file(handle, digests[0].size)

        def hashlib_file(name: str) -> None:
            with open(ours_path, "rb") as handle:
                hashlib.file_digest(handle, name)

        blake2b = side_by_side("checkpoint/checksum-blake2b", ours_hash, lambda: hashlib_file("blake2b"), repeats=repeats, per=size_mb,
                               unit="MiB/s", throughput=True, note=f"{CHECKSUM} vs hashlib blake2b of the same file")  # fmt: skip
        checksum = side_by_side("checkpoint/checksum", ours_hash, lambda: hashlib_file("sha256"), repeats=repeats, per=size_mb,
                                unit="MiB/s", throughput=True,
                                note=f"{CHECKSUM} (xxhash) vs hashlib sha256 of the same file (page cache); "
                                     f"blake2b {blake2b.baseline:.0f} MiB/s")  # fmt: skip
    return [save, durable, load, checksum]
