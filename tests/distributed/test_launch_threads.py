"""ampddp's spawn launcher splits the machine's cores between its processes unless the user chose
(``OMP_NUM_THREADS``), as torchrun does: torch's default threads in every process oversubscribe
the cores (measured: 2 processes on 2 cores several times slower)."""

from __future__ import annotations

import os

import pytest
import torch

from ampddp.distributed import launch_local
from ampddp.distributed.launch import threads_per_process


def threads_worker(env):
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


@pytest.mark.timeout(200)
def test_each_process_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    expected = max(1, cores // 2)
    assert threads_per_process(2) == expected
    results = launch_local(threads_worker, 2, timeout_s=60, job_timeout_s=150)
    assert results == [(expected, str(expected))] * 2


@pytest.mark.timeout(200)
def test_the_users_omp_num_threads_stands(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads_per_process(2) is None
    results = launch_local(threads_worker, 2, timeout_s=60, job_timeout_s=150)
    assert results == [(1, "1")] * 2


def test_a_worker_error_that_already_names_its_rank_is_not_prefixed_twice():
    import pickle

    from ampddp.distributed.launch import _worker_error
    from ampddp.errors import PeerFailureError

    named = _worker_error(0, 2, pickle.dumps(PeerFailureError("rank 0 of 2: a collective failed")), "trace")
    plain = _worker_error(1, 2, pickle.dumps(PeerFailureError("a collective failed")), "trace")
    assert isinstance(named, PeerFailureError) and str(named) == "rank 0 of 2: a collective failed"
    assert str(plain) == "rank 1 of 2: a collective failed"
