"""Exact distributed evaluation (every sample once, in order) and launcher failure reporting."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ampddp.distributed import (
    EvalShardSampler,
    LaunchError,
    ResumableSampler,
    eval_sampler,
    gather_in_order,
    launch_local,
    shard_bounds,
    sum_across_ranks,
)
from ampddp.distributed.env import detect_env
from ampddp.errors import NonFiniteGradientsError, PeerFailureError

SAMPLES = 11


def dataset():
    generator = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, 4, generator=generator), torch.arange(SAMPLES))


def predict(x):
    return (x * torch.tensor([1.0, -2.0, 3.0, 0.5])).sum(1)


def eval_worker(env):
    data = dataset()
    loader = DataLoader(data, batch_size=3, sampler=eval_sampler(data, env))
    predictions, indices = [], []
    for x, index in loader:
        predictions.append(predict(x))
        indices.append(index)
    gathered = gather_in_order(torch.cat(predictions))
    gathered_indices = gather_in_order(torch.cat(indices))
    padded = len(list(DistributedSampler(data, num_replicas=env.world_size, rank=env.rank, shuffle=False)))
    return gathered, gathered_indices, float(sum_across_ranks(len(loader.sampler))), padded


def test_evaluation_counts_each_sample_once_and_gathers_in_dataset_order():
    results = launch_local(eval_worker, 2, device="cpu", timeout_s=60)
    expected = predict(dataset().tensors[0])
    for gathered, indices, count, padded in results:
        assert count == SAMPLES
        assert indices.tolist() == list(range(SAMPLES))
        torch.testing.assert_close(gathered, expected)
        assert padded * 2 == SAMPLES + 1, "DistributedSampler pads: the reason for EvalShardSampler"


@pytest.mark.parametrize(("length", "world"), [(11, 2), (10, 3), (2, 4), (0, 2)])
def test_shards_cover_everything_once(length, world):
    covered = [i for rank in range(world) for i in range(*shard_bounds(length, rank, world))]
    assert covered == list(range(length))


def test_single_process_samplers():
    env = detect_env({}, device="cpu")
    data = dataset()
    assert list(eval_sampler(data, env)) == list(range(SAMPLES))
    order = list(ResumableSampler(data, env, seed=3))
    assert sorted(order) == list(range(SAMPLES)) and order != list(range(SAMPLES))  # every sample once, shuffled
    assert list(ResumableSampler(data, env, seed=3)) == order  # the order is a function of the seed alone
    assert list(ResumableSampler(data, env, seed=4)) != order
    assert len(EvalShardSampler(data, env)) == SAMPLES


def raising_worker(env):
    if env.rank == 1:
        raise ValueError("broken on purpose")
    return env.rank


def exiting_worker(env):
    if env.rank == 1:
        os._exit(7)
    time.sleep(30)


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(LaunchError, match=r"(?s)rank 1 of 2 failed.*ValueError: broken on purpose"):
        launch_local(raising_worker, 2, device="cpu", timeout_s=30)


def nonfinite_worker(env):
    if env.rank == 1:
        raise NonFiniteGradientsError("fc.weight is inf/NaN at step 2")
    return env.rank


def test_ampddp_errors_of_a_rank_keep_their_type_with_the_rank_in_front():
    with pytest.raises(NonFiniteGradientsError, match=r"^rank 1 of 2: fc.weight is inf/NaN at step 2$") as caught:
        launch_local(nonfinite_worker, 2, device="cpu", timeout_s=30)
    assert isinstance(caught.value.__cause__, LaunchError) and "Traceback" in str(caught.value.__cause__)


def test_a_rank_that_exits_early_is_reported_quickly():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 of 2 exited with code 7 before finishing") as caught:
        launch_local(exiting_worker, 2, device="cpu", timeout_s=30)
    assert isinstance(caught.value, PeerFailureError), "for the other ranks (and the CLI's exit status) a peer died"
    assert time.monotonic() - start < 25


def test_a_dead_rank_is_named_by_the_survivors_within_the_timeout():
    import subprocess
    import sys
    from pathlib import Path

    from ampddp.distributed import free_port

    script = str(Path(__file__).resolve().parents[1] / "dist_dead_peer_job.py")
    port = str(free_port())
    survivor = subprocess.Popen([sys.executable, script, "0", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dying = subprocess.Popen([sys.executable, script, "1", port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    output, _ = survivor.communicate(timeout=60)
    dying.wait(timeout=60)
    assert dying.returncode == 9
    assert survivor.returncode == 3, output
    assert "rank 1 stopped responding" in output and "rank 0 of 2" in output
    elapsed = float(output.split("after ")[1].split("s:")[0])
    assert elapsed < 10
