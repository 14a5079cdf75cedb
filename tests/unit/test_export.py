"""``ampddp export``: a verified checkpoint's weights as safetensors, with the policy in its metadata."""

from __future__ import annotations

import json
import os

import pytest
import torch
from resume_helpers import final_state, make_trainer
from safetensors import safe_open
from safetensors.torch import load_file

from ampddp.checkpoint import keys
from ampddp.checkpoint.safetensors_weights import SafetensorsWeights
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import EXIT_USAGE, main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    make_trainer(folder, "O2", max_steps=2).fit()
    return folder


def test_the_weights_and_their_policy_are_written_as_safetensors(run_dir, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--to", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    saved = final_state(run_dir)["model"]
    exported = load_file(out)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    assert exported["0.weight"].dtype == torch.float32  # O2's fp32 masters, not its fp16 model copy
    with safe_open(out, "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "ampddp-export/1" and metadata["mode"] == "O2" and metadata["step"] == "2"
    assert json.loads(metadata["policy"])["cast_model_type"] == "float16"
    assert metadata["source"] == str(CheckpointStore(run_dir).latest().path)
    # Each tensor's SHA-256, which init_from checks (a meta build: every rank its share of the tensors).
    assert json.loads(metadata["sha256"]).keys() == saved.keys()
    weights = SafetensorsWeights(out)
    assert weights.verify(0, 2) == weights.verify(1, 2) == [] and weights.whole().keys() == saved.keys()


def test_a_dtype_casts_the_floating_tensors_only(run_dir, tmp_path):
    out = tmp_path / "model-bf16.safetensors"
    assert main(["export", str(run_dir), "--to", str(out), "--dtype", "bf16"]) == 0
    exported = load_file(out)
    assert exported["0.weight"].dtype == torch.bfloat16
    assert exported["1.num_batches_tracked"].dtype == torch.int64
    assert SafetensorsWeights(out).verify() == []  # the digests are of the bytes as written: bf16


def test_an_existing_file_is_kept_unless_forced(run_dir, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"mine")
    assert main(["export", str(run_dir), "--to", str(out)]) == EXIT_USAGE
    assert "exists; choose another name or pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"mine"
    assert main(["export", str(run_dir), "--to", str(out), "--force"]) == 0
    assert load_file(out).keys() == final_state(run_dir)["model"].keys()


def test_a_directory_is_no_output_file_even_forced(run_dir, tmp_path, capsys):
    folder = tmp_path / "weights.safetensors"
    (folder / "kept").mkdir(parents=True)
    assert main(["export", str(run_dir), "--to", str(folder), "--force"]) == EXIT_USAGE
    assert f"--to {folder} is a directory; name a file to write" in capsys.readouterr().err
    assert [path.name for path in folder.iterdir()] == ["kept"]


def test_a_link_or_fifo_at_the_output_is_replaced_forced_never_written_through(run_dir, tmp_path, capsys):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (tmp_path / "linked.safetensors").symlink_to(outside)
    os.mkfifo(tmp_path / "fifo.safetensors")
    for name in ("linked.safetensors", "fifo.safetensors"):
        out = tmp_path / name
        assert main(["export", str(run_dir), "--to", str(out)]) == EXIT_USAGE
        assert "exists; choose another name or pass --force" in capsys.readouterr().err
        assert main(["export", str(run_dir), "--to", str(out), "--force"]) == 0  # no read or write of a FIFO: no hang
        assert out.is_file() and not out.is_symlink() and load_file(out).keys() == final_state(run_dir)["model"].keys()
    assert outside.read_text() == "keep me"


def test_bad_outputs_and_a_damaged_checkpoint_are_refused_writing_nothing(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "--to", str(tmp_path / "model.pt")]) == EXIT_USAGE
    assert "name the output file *.safetensors" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--to", str(tmp_path / "missing" / "model.safetensors")]) == EXIT_USAGE
    assert "no such directory" in capsys.readouterr().err
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    step = CheckpointStore(run_dir).latest().path
    copy = damaged / step.name
    copy.mkdir()
    for file in step.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    shared = copy / keys.SHARED_FILE
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    out = tmp_path / "from-damaged.safetensors"
    assert main(["export", str(copy), "--to", str(out)]) == EXIT_USAGE
    assert "ampddp export: error:" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
