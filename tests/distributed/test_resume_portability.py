"""Resume under another precision mode or another number of processes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from resume_helpers import NoisyDigits, final_state, make_trainer

from ampddp.distributed import ResumableSampler, detect_env, launch_local
from ampddp.distributed.env import DistEnv


@pytest.mark.parametrize(
    ("source", "target", "expect"),
    [
        ("O1", "native-fp16", "carried"),
        ("native-fp16", "O2", "carried"),
        ("O0", "O1", "fresh"),
        ("native-bf16", "native-fp16", "fresh"),
        ("O2", "native-bf16", "dropped"),
        ("native-fp16", "O5", "dropped"),
        ("O2", "O3", "dropped"),
    ],
)
def test_a_checkpoint_resumes_under_another_precision_mode(tmp_path, caplog, source, target, expect):
    make_trainer(tmp_path, source, max_steps=4, precision_overrides={"init_loss_scale": 512.0} if source in ("O1", "O2") else None).fit()
    saved = final_state(tmp_path)
    with caplog.at_level(logging.INFO, logger="ampddp"):
        trainer = make_trainer(tmp_path, target, max_steps=6)
        trainer.fit()
    resumed_model = trainer.run.module.state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in resumed_model.values())
    if expect == "carried":
        assert "carried over" in caplog.text
        assert trainer.engine.state_dict()["scalers"][0]["skipped_steps"] >= saved["precision"][0]["skipped_steps"]
    elif expect == "fresh":
        assert "starts a fresh scaler" in caplog.text
    else:
        assert "dropping the loss scale" in caplog.text
    assert trainer.progress.global_step == 6


def world_worker(env, run_dir, steps):
    make_trainer(Path(run_dir), "O1", max_steps=steps, env=env).fit()
    return True


@pytest.mark.timeout(300)
def test_two_processes_resume_on_one_and_back(tmp_path, caplog):
    launch_local(world_worker, 2, (str(tmp_path), 3), device="cpu", timeout_s=120)
    assert final_state(tmp_path)["progress"]["global_step"] == 3
    single = detect_env({}, device="cpu")
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        make_trainer(tmp_path, "O1", max_steps=5, env=single).fit()
    state = final_state(tmp_path)
    assert state["progress"]["global_step"] == 5
    launch_local(world_worker, 2, (str(tmp_path), 7), device="cpu", timeout_s=120)
    assert final_state(tmp_path)["progress"]["global_step"] == 7


@pytest.mark.timeout(180)
def test_a_resume_with_more_ranks_derives_their_rng_and_says_so(tmp_path):
    make_trainer(tmp_path, "O0", max_steps=2).fit()
    messages = launch_local(more_ranks_worker, 2, (str(tmp_path),), device="cpu", timeout_s=120)
    assert messages[0] is False and messages[1] is True


def more_ranks_worker(env, run_dir):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ampddp").addHandler(handler)
    make_trainer(Path(run_dir), "O0", max_steps=3, env=env).fit()
    return any("derived it from the seed" in record.getMessage() for record in records)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_world_size_changes_skip_and_repeat_no_sample_within_the_epoch(before, after):
    data = NoisyDigits(23)
    batch = 2

    def shard(world, rank, start):
        sampler = ResumableSampler(data, DistEnv(rank=rank, world_size=world), seed=4)
        sampler.set_epoch(1, start=start)
        return list(sampler)

    consumed_batches = 3
    seen_before = [i for rank in range(before) for i in shard(before, rank, 0)[: consumed_batches * batch]]
    position = consumed_batches * batch * before
    seen_after = [i for rank in range(after) for i in shard(after, rank, position)]
    unique_after = set(seen_after)
    assert not set(seen_before) & unique_after
    assert set(seen_before) | unique_after == set(range(23))
    assert len(seen_after) - len(unique_after) < after, "only the final round may repeat (padding)"
