"""A checkpoint file whose zip entries would inflate beyond the file (a decompression bomb: a small
file declaring a huge tensor) is refused before torch reads it, on every load path."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from ampddp.checkpoint.files import load_safely
from ampddp.checkpoint.restore import initial_weights
from ampddp.errors import CheckpointError


def rewrite_compressed(source: Path, target: Path, extra_entry: tuple[str, int] | None = None) -> None:
    """``source``'s entries deflated into ``target`` (what torch.save never writes), plus one zero-filled entry."""
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
        for info in original.infolist():
            bomb.writestr(info.filename, original.read(info.filename))
        if extra_entry is not None:
            name, size = extra_entry
            with bomb.open(name, "w", force_zip64=True) as handle:
                chunk = bytes(2**20)
                for _ in range(size // len(chunk)):
                    handle.write(chunk)


@pytest.fixture
def honest(tmp_path) -> Path:
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(4, 4)}, path)
    return path


def test_an_honest_file_loads(honest):
    assert torch.equal(load_safely(honest)["weight"], torch.ones(4, 4))


def test_a_compressed_file_is_refused_unread(honest, tmp_path):
    bomb = tmp_path / "bomb.pt"
    rewrite_compressed(honest, bomb, extra_entry=("weights/data/9", 64 * 2**20))  # 64 MiB of zeros in ~64 KiB
    assert bomb.stat().st_size < 2**20
    with pytest.raises(CheckpointError, match=r"declares \d+ bytes in a \d+-byte file \(compressed\); torch.save never compresses"):
        load_safely(bomb)
    with pytest.raises(CheckpointError, match="decompression bomb"):
        initial_weights(bomb)  # init_from's path too


def test_a_stored_entry_declaring_more_than_the_file_is_refused(honest, tmp_path):
    data = bytearray(honest.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = archive.infolist()[-1]
    central = data.rfind(b"PK\x01\x02")  # the last entry's central directory header (infolist order)
    size_field = central + 24  # its uncompressed size
    data[size_field : size_field + 4] = (len(data) * 4).to_bytes(4, "little")
    forged = tmp_path / "forged.pt"
    forged.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"entry {info.filename!r} declares {len(data) * 4} bytes in a {len(data)}-byte file;"):
        load_safely(forged)
