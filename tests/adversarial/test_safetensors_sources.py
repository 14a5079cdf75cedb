"""Safetensors given as weights to start from are untrusted bytes: an index that names files outside
its folder, is not JSON or is past its size bound, a FIFO where a file should be, garbage, a truncated
file, a header that declares more data than the file holds: each refused in one line naming the file,
before any tensor is read or allocated."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ampddp.checkpoint.safetensors_weights import SafetensorsWeights, tensor_digest
from ampddp.errors import CheckpointError


def write(path, text: str) -> None:
    path.write_text(text)


def truncated(folder) -> None:
    save_file(nn.Linear(4, 4).state_dict(), folder / "w.safetensors")
    os.truncate(folder / "w.safetensors", 64)


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        (lambda d: write(d / "model.safetensors.index.json", json.dumps({"weight_map": {"a": "../outside.safetensors"}})),
         r"names file '\.\./outside\.safetensors'; an index names files of its own folder"),
        (lambda d: write(d / "model.safetensors.index.json", "{not json"), r"not a safetensors index with a 'weight_map'"),
        (lambda d: write(d / "model.safetensors.index.json", json.dumps({"weight_map": {"a": "gone.safetensors"}})),
         r"gone\.safetensors: cannot read it"),
        (lambda d: os.mkfifo(d / "w.safetensors"), r"w\.safetensors: not a regular file; weights are read from plain files only"),
        (lambda d: write(d / "w.safetensors", "garbage" * 20), r"w\.safetensors: not a readable safetensors file"),
        (truncated, r"w\.safetensors: not a readable safetensors file"),
    ],
    ids=["index-escapes", "index-not-json", "index-names-missing-file", "fifo", "garbage", "truncated"],
)  # fmt: skip
def test_bad_sources_are_refused_in_one_line_before_any_tensor_is_read(tmp_path, plant, expected):
    plant(tmp_path)
    with pytest.raises(CheckpointError, match=expected) as caught:
        SafetensorsWeights(tmp_path)
    assert "\n" not in str(caught.value)


def test_an_index_past_its_bound_is_refused_unread(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    with index.open("wb") as handle:
        handle.truncate((64 << 20) + 1)
    with pytest.raises(CheckpointError, match=r"larger than 64 MiB: not a safetensors index"):
        SafetensorsWeights(tmp_path)


def declares_more_than_it_holds(folder) -> None:
    """A header declaring a 16 GiB tensor over a 64-byte body."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 30, 4], "data_offsets": [0, 16 << 30]}}).encode()
    (folder / "w.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))


def test_a_header_declaring_more_than_the_file_holds_is_refused_unallocated(tmp_path):
    declares_more_than_it_holds(tmp_path)
    with pytest.raises(CheckpointError, match=r"w\.safetensors: not a readable safetensors file \(.*not fully covered"):
        SafetensorsWeights(tmp_path)


def test_the_index_is_read_only_as_a_mapping_of_names_to_plain_files(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": ["list.safetensors"]}}))
    with pytest.raises(CheckpointError, match=r"not a safetensors index with a 'weight_map' \(TypeError\)"):
        SafetensorsWeights(tmp_path)
    save_file({"a": torch.zeros(1)}, tmp_path / "real.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": str(tmp_path / "real.safetensors")}}))
    with pytest.raises(CheckpointError, match=r"names file '/.*real\.safetensors'; an index names files of its own folder"):
        SafetensorsWeights(tmp_path)


def test_a_changed_export_is_caught_by_its_digests_whole_and_by_shares(tmp_path):
    tensors = {"a": torch.arange(4096.0).view(64, 64), "b": torch.ones(3, dtype=torch.bfloat16), "c": torch.tensor(7)}
    digests = json.dumps({name: tensor_digest(value) for name, value in tensors.items()})
    save_file(tensors, tmp_path / "w.safetensors", metadata={"sha256": digests})
    assert SafetensorsWeights(tmp_path / "w.safetensors").verify() == []
    data = bytearray((tmp_path / "w.safetensors").read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor in the file
    (tmp_path / "w.safetensors").write_bytes(bytes(data))
    weights = SafetensorsWeights(tmp_path / "w.safetensors")
    found = weights.verify(0, 2) + weights.verify(1, 2)
    assert len(found) == 1 and "does not match the SHA-256 its export wrote: the file changed" in found[0], found
    with pytest.raises(CheckpointError, match=r"w\.safetensors: tensor '\w' does not match the SHA-256 its export wrote"):
        weights.whole()


def test_digests_that_are_not_a_mapping_are_refused(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "w.safetensors", metadata={"sha256": "[1, 2]"})
    with pytest.raises(CheckpointError, match=r"its metadata's 'sha256' entry is not a mapping of tensor names to digests"):
        SafetensorsWeights(tmp_path / "w.safetensors")
