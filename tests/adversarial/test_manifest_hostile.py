"""A hostile ``COMPLETE`` manifest cannot make a checkpoint check read outside its folder, reveal the
checksum of another file, or exhaust memory: names must be plain file names of the folder, the rank
count must fit the files listed, and the marker is read with a size cap."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ampddp.checkpoint import keys
from ampddp.checkpoint.manifest import MAX_MANIFEST_BYTES, VERIFIED, FileDigest, hash_open_file, read_manifest, verify_folder
from ampddp.errors import CheckpointError


def digest_of(path: Path) -> dict:
    with open(path, "rb") as handle:
        return FileDigest(path.stat().st_size, hash_open_file(handle, path.stat().st_size)).to_json()


def checkpoint(tmp_path: Path, extra: dict | None = None, world_size: int = 1) -> Path:
    folder = tmp_path / "run" / keys.CHECKPOINTS_DIR / keys.STEP_DIR.format(step=1)
    folder.mkdir(parents=True)
    for name in (keys.SHARED_FILE, keys.RANK_FILE.format(rank=0)):
        (folder / name).write_bytes(os.urandom(256))
    files = {name: digest_of(folder / name) for name in (keys.SHARED_FILE, keys.RANK_FILE.format(rank=0))}
    marker = {"step": 1, "world_size": world_size, "checksum": "xxh3_128", "files": {**files, **(extra or {})}}
    (folder / keys.COMPLETE_FILE).write_text(json.dumps(marker))
    return folder


def test_an_honest_manifest_verifies(tmp_path):
    folder = checkpoint(tmp_path)
    assert verify_folder(folder, read_manifest(folder)) == VERIFIED


@pytest.mark.parametrize("name", ["../../../secret.txt", "/etc/hostname", "sub/shared.pt", "..", ".", "", "a\\b"])
def test_a_name_outside_the_folder_is_refused_before_anything_is_read(tmp_path, name):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    folder = checkpoint(tmp_path, extra={name: digest_of(secret)})  # even a matching size and checksum
    with pytest.raises(CheckpointError, match="which is not a file name of this checkpoint folder") as refused:
        read_manifest(folder)
    assert digest_of(secret)["xxh3_128"] not in str(refused.value)


def test_an_absolute_path_with_a_wrong_checksum_reveals_nothing(tmp_path):
    folder = checkpoint(tmp_path, extra={"/etc/hostname": {"size": 1, "xxh3_128": "0" * 32}})
    with pytest.raises(CheckpointError) as refused:
        read_manifest(folder)
    assert "checksum" not in str(refused.value) and "/etc/hostname" in str(refused.value)


def test_a_huge_declared_world_size_is_refused_at_once(tmp_path):
    folder = checkpoint(tmp_path, world_size=1_000_000_000)
    with pytest.raises(CheckpointError, match="declares 1000000000 ranks but lists 2 files"):
        read_manifest(folder)


@pytest.mark.parametrize("world_size", [0, -1, "2", 1.5])
def test_a_world_size_that_is_not_a_positive_integer_is_refused(tmp_path, world_size):
    folder = checkpoint(tmp_path, world_size=world_size)
    with pytest.raises(CheckpointError, match="malformed completion marker"):
        read_manifest(folder)


def test_an_oversized_marker_is_refused_without_reading_it_whole(tmp_path):
    folder = checkpoint(tmp_path)
    with open(folder / keys.COMPLETE_FILE, "r+b") as handle:
        handle.truncate(4 * 2**30)  # sparse: 4 GiB declared, nothing on disk
    with pytest.raises(CheckpointError, match=f"larger than {MAX_MANIFEST_BYTES // 2**20} MiB"):
        read_manifest(folder)
