"""Checkpoint files: safe loading, clear errors, atomic writes that survive SIGKILL, retention."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from resume_helpers import final_state, make_model, make_trainer, tree_snapshot

from ampddp.checkpoint import CheckpointStore, check_model_state, find_checkpoint, initial_weights, keys, load_safely, save_atomic
from ampddp.distributed import detect_env
from ampddp.errors import CheckpointError, ConfigError


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp/ampddp-payload-ran")


def test_a_malicious_pickle_is_refused_and_its_code_never_runs(tmp_path):
    MARKER.unlink(missing_ok=True)
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(1)}, "boom": Payload()}, path)
    with pytest.raises(CheckpointError, match="refused to load") as error:
        load_safely(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert not MARKER.exists(), "the payload ran"
    with pytest.raises(CheckpointError, match="refused"):
        initial_weights(path)
    assert not MARKER.exists()
    plain = tmp_path / "plain.pickle"
    plain.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError):
        load_safely(plain)
    assert not MARKER.exists()


def test_truncated_corrupt_and_missing_files_get_one_line_errors(tmp_path):
    good = tmp_path / "good.pt"
    save_atomic({"model": {"w": torch.randn(100, 100)}}, good)
    data = good.read_bytes()
    truncated, garbage = tmp_path / "truncated.pt", tmp_path / "garbage.pt"
    truncated.write_bytes(data[: len(data) // 2])
    garbage.write_bytes(b"\x00not a checkpoint" * 50)
    before = tree_snapshot(tmp_path)
    for path, message in (
        (truncated, "truncated or corrupted"),
        (garbage, "truncated or corrupted|corrupted"),
        (tmp_path / "nope.pt", "no such"),
    ):
        with pytest.raises(CheckpointError, match=message) as error:
            load_safely(path)
        assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert tree_snapshot(tmp_path) == before, "a failed load must not touch the disk"


def test_a_checkpoint_for_another_model_names_keys_and_shapes(tmp_path):
    state = make_model().state_dict()
    state["4.weight"] = torch.zeros(5, 32)
    state.pop("1.running_var")
    state["extra.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as error:
        check_model_state(state, make_model(), "ckpt.pt")
    message = str(error.value)
    assert "missing keys: 1.running_var (32)" in message
    assert "unexpected keys: extra.bias (3)" in message
    assert "4.weight (checkpoint 5x32, model 4x32)" in message


def test_loading_a_mismatched_checkpoint_into_a_trainer_changes_nothing(tmp_path):
    make_trainer(tmp_path / "run", "O0", max_steps=2).fit()
    other = make_trainer(tmp_path / "other", "O0", max_steps=1)
    other.run.module[4] = torch.nn.Linear(32, 7)
    before_weights = {k: v.clone() for k, v in other.run.module.state_dict().items()}
    before_disk = tree_snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="different model"):
        other.load_checkpoint(find_checkpoint(tmp_path / "run"))
    assert all(torch.equal(v, other.run.module.state_dict()[k]) for k, v in before_weights.items())
    assert tree_snapshot(tmp_path) == before_disk


def test_latest_retention_and_step_folder_layout(tmp_path):
    trainer = make_trainer(tmp_path, "O1", max_steps=7, checkpoint_every=2, keep_last=2)
    trainer.fit()
    store = CheckpointStore(tmp_path, keep_last=2)
    assert [ref.step for ref in store.complete()] == [6, 7]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000000006", "step-000000007"]
    latest = store.latest()
    assert latest.step == 7
    assert sorted(p.name for p in latest.path.iterdir()) == ["COMPLETE", "rank-00000.pt", "shared.pt"]
    shared = load_safely(latest.shared_file)
    assert shared[keys.FORMAT] == keys.FORMAT_VERSION and shared[keys.WORLD_SIZE] == 1
    assert set(shared[keys.VERSIONS]) == {"ampddp", "torch", "python"}
    assert keys.RNG in load_safely(latest.rank_file(0))
    with pytest.raises(ConfigError, match="keep_last=0"):
        CheckpointStore(tmp_path, keep_last=0)


def test_an_incomplete_folder_is_never_trusted(tmp_path):
    make_trainer(tmp_path, "O0", max_steps=2).fit()
    half = tmp_path / "checkpoints" / "step-000000009"
    half.mkdir()
    (half / "shared.pt").write_bytes(b"partial")
    assert CheckpointStore(tmp_path).latest().step == 2
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        find_checkpoint(half)
    (tmp_path / "checkpoints" / "latest").write_text("step-000000009")  # the pointer older versions wrote: never read
    assert CheckpointStore(tmp_path).latest().step == 2


@pytest.mark.parametrize("failure", ["disk full", "read-only"])
def test_a_failing_save_is_a_clear_error_that_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure):
    import errno

    make_trainer(tmp_path, "O0", max_steps=2).fit()
    before = tree_snapshot(tmp_path)
    code = errno.ENOSPC if failure == "disk full" else errno.EROFS

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("ampddp.checkpoint.files.os.replace", refuse)
    with pytest.raises(CheckpointError, match=os.strerror(code)):
        CheckpointStore(tmp_path).save(3, {"x": torch.ones(1)}, {}, detect_env({}, device="cpu"))
    assert tree_snapshot(tmp_path) == before
    assert CheckpointStore(tmp_path).latest().step == 2


def test_init_from_plain_state_dict_and_apex_layout(tmp_path):
    weights = make_model().state_dict()
    weights = {k: v + 1 if v.is_floating_point() else v for k, v in weights.items()}
    torch.save(weights, tmp_path / "plain.pt")
    torch.save({"model": weights, "optimizer": {}, "amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}}}, tmp_path / "apex.pt")
    for name in ("plain.pt", "apex.pt"):
        trainer = make_trainer(tmp_path / name.split(".")[0], "O2", max_steps=1, init_from=tmp_path / name)
        torch.testing.assert_close(trainer.run.module.state_dict()["0.weight"], weights["0.weight"])
    with pytest.raises(CheckpointError, match="no model weights"):
        torch.save({"epoch": 3}, tmp_path / "empty.pt")
        initial_weights(tmp_path / "empty.pt")


SAVER = """
import sys, time
sys.path.insert(0, {tests!r})
from resume_helpers import make_trainer
trainer = make_trainer({run!r}, "O2", max_steps=10**6, checkpoint_every=1, keep_last=2)
print("ready", flush=True)
trainer.fit()
"""


def test_sigkill_at_random_moments_during_saves_leaves_a_loadable_latest(tmp_path):
    rng = random.Random(0)
    run = tmp_path / "run"
    make_trainer(run, "O2", max_steps=1).fit()
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(tests=str(Path(__file__).resolve().parents[1]), run=str(run)))
    for _ in range(12):
        process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        process.send_signal(signal.SIGKILL)
        process.wait()
        latest = CheckpointStore(run).latest()
        assert latest is not None
        state = final_state(run)
        assert state["progress"]["global_step"] == latest.step
        resumed = make_trainer(run, "O2", max_steps=latest.step)
        resumed.fit()
