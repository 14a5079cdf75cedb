"""Safetensors weights to start from (checkpoint.init_from): one file or a folder of them (Hugging
Face's sharded layout with its index), renamed by a key map, checked against the model from the
headers alone, read whole or by slices (hostile sources: tests/adversarial/test_safetensors_sources.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ampddp.checkpoint.safetensors_weights import SafetensorsWeights, check_key_map, is_safetensors_source, weights_into
from ampddp.distributed.meta_init import ModelBuild
from ampddp.errors import CheckpointError, ConfigError


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def hf_folder(folder, state: dict[str, torch.Tensor], prefix: str = "model.") -> None:
    """``state`` as Hugging Face writes a sharded checkpoint: two files and an index naming them."""
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, part in parts.items():
        save_file({prefix + name: state[name].contiguous() for name in part}, folder / file, metadata={"format": "pt"})
    weight_map = {prefix + name: file for file, part in parts.items() for name in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))


def test_a_file_loads_whole_into_a_model_and_its_slices_read_only_their_rows(tmp_path):
    source = model()
    save_file(source.state_dict(), tmp_path / "w.safetensors", metadata={"format": "ampddp-export/1"})
    weights = SafetensorsWeights(tmp_path / "w.safetensors")
    target = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    weights_into(ModelBuild(target), weights)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    assert weights.metadata["format"] == "ampddp-export/1"
    with weights.reading() as reader:
        assert torch.equal(reader.read("0.weight", (slice(2, 5), slice(0, 6))), source[0].weight[2:5])


def test_a_hugging_face_folder_is_read_through_its_index_with_a_key_map(tmp_path):
    source = model()
    hf_folder(tmp_path, {**source.state_dict(), "unused.rotary": torch.zeros(2)})
    assert is_safetensors_source(tmp_path) and not is_safetensors_source(tmp_path / "missing")
    weights = SafetensorsWeights(tmp_path, key_map={r"model\.unused\..*": None, r"model\.(.*)": r"\1"})
    assert weights.names() == set(source.state_dict())
    loaded = weights.whole()
    assert all(torch.equal(loaded[name], value) for name, value in source.state_dict().items())


def test_a_folder_without_an_index_takes_its_safetensors_files(tmp_path):
    source = model()
    state = source.state_dict()
    save_file({k: v for k, v in state.items() if k.startswith("0.")}, tmp_path / "a.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith("0.")}, tmp_path / "b.safetensors")
    assert SafetensorsWeights(tmp_path).names() == set(state)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s.pop("2.bias"), r"missing keys: 2\.bias \(3\)"),
        (lambda s: s.update({"extra": torch.zeros(1)}), r"unexpected keys: extra \(1\)"),
        (lambda s: s.update({"2.weight": torch.zeros(3, 9)}), r"shape mismatches: 2\.weight \(checkpoint 3x9, model 3x8\)"),
        (lambda s: s.update({"0.bias": torch.zeros(8, dtype=torch.int64)}), r"'0\.bias' is torch\.int64 there and torch\.float32"),
    ],
    ids=["missing", "unexpected", "shape", "integer"],
)
def test_weights_for_another_model_are_refused_from_the_headers(tmp_path, change, expected):
    state = dict(model().state_dict())
    change(state)
    save_file(state, tmp_path / "w.safetensors")
    target = model()
    before = {name: value.clone() for name, value in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=expected) as caught:
        weights_into(ModelBuild(target), SafetensorsWeights(tmp_path / "w.safetensors"))
    assert "\n" not in str(caught.value)
    assert all(torch.equal(target.state_dict()[name], value) for name, value in before.items()), "nothing was loaded"


def test_two_tensors_renamed_to_one_name_are_refused(tmp_path):
    save_file({"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}, tmp_path / "w.safetensors")
    with pytest.raises(
        CheckpointError, match=r"two tensors become 'w' \('a\.weight' in w\.safetensors and 'b\.weight' in w\.safetensors\)"
    ):
        SafetensorsWeights(tmp_path / "w.safetensors", key_map={r".*\.weight": "w"})


@pytest.mark.parametrize(
    ("key_map", "expected"),
    [
        (["a"], r"model\.key_map=\['a'\] is not valid; give a mapping of regular expressions"),
        ({"(": "x"}, r"model\.key_map entry '\(' is not a regular expression"),
        ({"a": 3}, r"model\.key_map entry 'a': 3 is not valid"),
    ],
)
def test_key_maps_are_checked_when_given(key_map, expected):
    with pytest.raises(ConfigError, match=expected):
        check_key_map(key_map)
