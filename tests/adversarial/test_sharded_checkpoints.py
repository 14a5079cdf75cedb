"""Sharded checkpoints (each rank's DCP files beside shared.pt) keep every guarantee of the whole layout:
exact resume, every file verified before it is read, and no code run from a hostile metadata pickle."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from resume_helpers import assert_identical, final_state, make_trainer

from ampddp.checkpoint.inspect import summarize
from ampddp.checkpoint.manifest import FileDigest, hash_open_file
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import EXIT_USAGE, main
from ampddp.errors import CheckpointError


def sharded_run(run_dir: Path, steps: int = 4) -> Path:
    make_trainer(run_dir, "O2", max_steps=steps, layout="sharded").fit()
    return CheckpointStore(run_dir).latest().path


def test_a_sharded_layout_resumes_exactly_as_the_whole_one(tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    make_trainer(straight, "O2", 6, layout="sharded").fit()
    make_trainer(resumed, "O2", 3, layout="sharded").fit()
    make_trainer(resumed, "O2", 6, layout="sharded").fit()
    assert_identical(final_state(straight), final_state(resumed))
    whole = tmp_path / "whole"
    make_trainer(whole, "O2", 6).fit()
    assert_identical(final_state(straight), final_state(whole))
    assert summarize(straight)["model_sha256"] == summarize(whole)["model_sha256"]
    assert summarize(straight)["layout"] == "sharded" and summarize(whole)["layout"] == "whole"
    # A whole run continues with sharded checkpoints and back (the layout is how a run writes, not what it is).
    make_trainer(whole, "O2", 8, layout="sharded").fit()
    make_trainer(whole, "O2", 9).fit()
    assert final_state(whole)["progress"]["global_step"] == 9


def _replace_listed(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` and list its real size and checksum in COMPLETE (an attacker who controls the folder)."""
    (folder / name).write_bytes(data)
    with open(folder / name, "rb") as handle:
        digest = FileDigest(len(data), hash_open_file(handle, len(data)))
    marker = json.loads((folder / "COMPLETE").read_text())
    marker["files"][name] = digest.to_json()
    (folder / "COMPLETE").write_text(json.dumps(marker))


class Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_metadata_pickle_never_runs(tmp_path, capsys):
    step = sharded_run(tmp_path / "run")
    ran = tmp_path / "code-ran"
    _replace_listed(step, ".metadata", pickle.dumps(Planted(str(ran))))
    with pytest.raises(CheckpointError, match=r"\.metadata: sharded checkpoint metadata refers to posix\.system.*refused unread"):
        make_trainer(tmp_path / "run", "O2", max_steps=6, layout="sharded").fit()
    assert main(["inspect", str(step)]) == EXIT_USAGE
    assert main(["export", str(step), "--to", str(tmp_path / "m.safetensors")]) == EXIT_USAGE
    assert "refers to posix.system" in capsys.readouterr().err
    assert not ran.exists() and not (tmp_path / "m.safetensors").exists()


def two_checkpoints_the_newest_flipped(run_dir: Path) -> tuple[Path, Path]:
    """A run's checkpoints of steps 1 and 2, a byte of step 2's first shard flipped: (step 2's folder, that shard)."""
    make_trainer(run_dir, "O2", max_steps=2, layout="sharded", checkpoint_every=1).fit()
    newest = CheckpointStore(run_dir).latest().path
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return newest, shard


def test_a_corrupted_or_missing_shard_is_named_and_resume_falls_back(tmp_path, caplog):
    run_dir = tmp_path / "run"
    newest, shard = two_checkpoints_the_newest_flipped(run_dir)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        summarize(newest)
    trainer = make_trainer(run_dir, "O2", max_steps=3, layout="sharded", checkpoint_every=1)
    trainer.fit()
    assert "checkpoint step 2 does not verify" in caplog.text
    assert trainer.progress.global_step == 3
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing"):
        summarize(newest)


def test_a_shape_record_that_does_not_fit_the_model_is_refused_before_loading(tmp_path):
    step = sharded_run(tmp_path / "run", steps=2)
    shared = torch.load(step / "shared.pt", weights_only=True)
    shared["shards"]["model/0.weight"]["shape"] = [7, 7]
    buffer = Path(tmp_path / "shared.pt")
    torch.save(shared, buffer)
    _replace_listed(step, "shared.pt", buffer.read_bytes())
    with pytest.raises(CheckpointError, match=r"checkpoint is for a different model.*0\.weight \(checkpoint 7x7, model 32x16\)"):
        make_trainer(tmp_path / "run", "O2", max_steps=4, layout="sharded").fit()


@pytest.mark.parametrize("planted", ["../../outside.pt", "/etc/hostname", ".metadata"])
def test_metadata_pointing_outside_its_shards_is_refused_unread(tmp_path, planted):
    step = sharded_run(tmp_path / "run", steps=2)
    metadata = pickle.loads((step / ".metadata").read_bytes())  # this test's own file: trusted here
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = planted
    _replace_listed(step, ".metadata", pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"not a shard file of this checkpoint; refused unread"):
        summarize(step)


MALFORMED_RECORDS = {
    "a list": (lambda record: list(record), r"'shards' record is a list"),
    "a shape of words": (lambda record: {**record, "model/0.weight": {"shape": ["a"], "dtype": "float32"}}, r"has shape \['a'\]"),
    "a negative size": (lambda record: {**record, "model/0.weight": {"shape": [-1], "dtype": "float32"}}, r"has shape \[-1\]"),
    "no dtype": (lambda record: {**record, "model/0.weight": {"shape": [2]}}, r"'model/0.weight' has no dtype"),
    "an unknown dtype": (lambda record: {**record, "model/0.weight": {"shape": [2], "dtype": "float99"}}, r"unknown dtype 'float99'"),
    "a stray name": (lambda record: {**record, "weights": {"shape": [2], "dtype": "float32"}}, r"'weights' is neither model/"),
    "an optimizer name": (
        lambda record: {**record, "optimizer/x/exp_avg": {"shape": [2], "dtype": "float32"}},
        r"names no optimizer state",
    ),
    "another shape": (
        lambda record: {**record, "model/4.weight": {"shape": [3], "dtype": "float32"}},
        r"records model/4.weight as \[3\] float32, but the shards hold \[4, 32\] torch.float32",
    ),
    "a huge shape": (lambda record: {**record, "model/4.weight": {"shape": [2**40], "dtype": "float32"}}, r"but the shards hold"),
    "another dtype": (lambda record: {**record, "model/4.weight": {"shape": [4, 32], "dtype": "float16"}}, r"but the shards hold"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_RECORDS))
def test_a_malformed_shards_record_is_one_checkpoint_error(tmp_path, case):
    step = sharded_run(tmp_path / "run", steps=2)
    change, message = MALFORMED_RECORDS[case]
    shared = torch.load(step / "shared.pt", weights_only=True)
    shared["shards"] = change(shared["shards"])
    torch.save(shared, tmp_path / "shared.pt")
    _replace_listed(step, "shared.pt", (tmp_path / "shared.pt").read_bytes())
    with pytest.raises(CheckpointError, match=message):
        summarize(step)
    with pytest.raises(CheckpointError, match=f"{message}|checkpoint is for a different model"):  # a resume compares with the model first
        make_trainer(tmp_path / "run", "O2", max_steps=4, layout="sharded").fit()


def test_shards_the_manifest_does_not_list_are_never_read(tmp_path, caplog):
    # A COMPLETE rewritten without its shard entries, and a shard flipped: nothing vouches for the shards.
    run_dir = tmp_path / "run"
    newest, _ = two_checkpoints_the_newest_flipped(run_dir)
    marker = json.loads((newest / "COMPLETE").read_text())
    marker["files"] = {name: entry for name, entry in marker["files"].items() if not name.endswith((".distcp", ".metadata"))}
    (newest / "COMPLETE").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"\.metadata: a shard file COMPLETE does not list: incomplete checkpoint"):
        summarize(newest)
    trainer = make_trainer(run_dir, "O2", max_steps=3, layout="sharded", checkpoint_every=1)
    trainer.fit()
    assert "checkpoint step 2 does not verify" in caplog.text and trainer.progress.global_step == 3


def _grown_everywhere(step: Path, tmp_path: Path, name: str, rows: int) -> None:
    """The attack of a 4 GiB tensor over a few KB of shards: ``name``'s first dimension declared as
    ``rows`` in the metadata, its one chunk and the shared file's record alike, every file re-hashed."""
    metadata = pickle.loads((step / ".metadata").read_bytes())  # this test's own file: trusted here
    entry = metadata.state_dict_metadata[name]
    entry.size = torch.Size([rows, *entry.size[1:]])
    entry.chunks[0].sizes = torch.Size([rows, *entry.chunks[0].sizes[1:]])
    old = next(index for index in metadata.storage_data if index.fqn == name)
    metadata.storage_data = {**{index: info for index, info in metadata.storage_data.items() if index != old},
                             type(old)(name, entry.chunks[0].offsets): metadata.storage_data[old]}  # fmt: skip
    _replace_listed(step, ".metadata", pickle.dumps(metadata))
    shared = torch.load(step / "shared.pt", weights_only=True)
    shared["shards"][name]["shape"] = list(entry.size)
    torch.save(shared, tmp_path / "shared.pt")
    _replace_listed(step, "shared.pt", (tmp_path / "shared.pt").read_bytes())


def test_metadata_declaring_more_than_its_shards_hold_is_refused_before_any_allocation(tmp_path, monkeypatch, capsys):
    step = sharded_run(tmp_path / "run", steps=2)
    _grown_everywhere(step, tmp_path, "model/0.weight", 2**25)  # 2**25 x 16 float32: 2 GiB declared
    monkeypatch.setattr("ampddp.checkpoint.sharded._allocated", lambda *args: pytest.fail("allocated before the chunks were checked"))
    with pytest.raises(CheckpointError, match=r"a chunk of model/0\.weight needs 2147483648 bytes, declared as \d+ bytes at offset \d+ of "
                                              r"__0_0\.distcp, which holds \d+; refused unread"):  # fmt: skip
        summarize(step)
    assert main(["export", str(step), "--to", str(tmp_path / "m.safetensors")]) == EXIT_USAGE
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "m.safetensors").exists()


def test_chunks_that_leave_part_of_a_tensor_uncovered_or_cover_it_twice_are_refused(tmp_path):
    step = sharded_run(tmp_path / "run", steps=2)
    metadata = pickle.loads((step / ".metadata").read_bytes())
    chunk = metadata.state_dict_metadata["model/0.weight"].chunks[0]
    chunk.sizes = torch.Size([chunk.sizes[0] - 1, *chunk.sizes[1:]])  # the last row read from nowhere
    _replace_listed(step, ".metadata", pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"the chunks of model/0\.weight do not cover its shape \[32, 16\] exactly once"):
        summarize(step)
    chunk.sizes = torch.Size([40, *chunk.sizes[1:]])
    _replace_listed(step, ".metadata", pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"a chunk of model/0\.weight at \[0, 0\] of size \[40, 16\] lies outside its shape"):
        summarize(step)


def test_a_truncated_shard_hashed_into_its_manifest_is_named_with_what_is_wrong(tmp_path, capsys):
    step = sharded_run(tmp_path / "run", steps=2)
    shard = step / "__0_0.distcp"
    _replace_listed(step, shard.name, shard.read_bytes()[: shard.stat().st_size // 2])
    assert main(["inspect", str(step)]) == EXIT_USAGE
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"of {shard.name}, which holds" in said[0] and "truncated shard" in said[0], said


def test_a_shard_that_fails_to_read_is_named_with_the_first_cause(tmp_path, capsys):
    step = sharded_run(tmp_path / "run", steps=2)
    metadata = pickle.loads((step / ".metadata").read_bytes())
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "model/0.weight")
    data = bytearray((step / info.relative_path).read_bytes())
    data[info.offset : info.offset + 64] = b"\0" * 64  # the chunk's own header gone, the file's size kept
    _replace_listed(step, info.relative_path, bytes(data))
    assert main(["inspect", str(step)]) == EXIT_USAGE
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"ampddp inspect: error: {step / info.relative_path}: "), said
    assert "Traceback" not in said[0] and "CheckpointException" not in said[0]
