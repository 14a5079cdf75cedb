"""Loader workers and the job's stop signals: an evaluation's workers are stopped with it, even one
that hangs, and a SIGTERM to the process group while workers start neither kills them nor is lost.

Run as a script (``python test_loader_signals.py KIND METHOD``), this file is the process that gets
the signal: it prints what it saw as one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from ampddp.distributed.data import ResumableSampler
from ampddp.distributed.env import detect_env
from ampddp.training.batches import BatchAdapter
from ampddp.training.evaluator import Evaluator
from ampddp.training.loading import DataLoading, InputTimer, LoaderSettings, loader_pass, start_worker

ROOT = Path(__file__).resolve().parents[2]


class Stalling(Dataset):
    """The first item comes at once; every later one hangs (as a read from a dead file system does)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index > 0:
            time.sleep(600)
        return torch.zeros(2), torch.tensor(0)


def failing_loss(outputs: torch.Tensor, batch: object) -> torch.Tensor:
    raise RuntimeError("the loss failed")


@pytest.fixture
def no_children_left() -> Iterator[None]:
    """A failing test must not leave a hung worker behind for the rest of the session."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join()


@pytest.mark.timeout(120)
def test_an_evaluation_cut_short_stops_its_workers_even_one_that_hangs(no_children_left):
    env = detect_env({}, device="cpu")
    loading = DataLoading(LoaderSettings(num_workers=1), env.device, seed=0)
    evaluator = Evaluator(Stalling(), 1, env, loss_fn=failing_loss, metrics=None, batches=BatchAdapter(), loading=loading)
    with pytest.raises(RuntimeError, match="the loss failed"):
        evaluator.evaluate(nn.Linear(2, 2), contextlib.nullcontext)
    assert multiprocessing.active_children() == []  # the hung worker ignored torch's SIGTERM: it was killed


class Pids(Dataset):
    """Each item is the pid of the process that made it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(os.getpid())


RECEIVED: list[int] = []
"""The SIGTERMs this process's handler saw."""


class Signalling(ResumableSampler):
    """Sends SIGTERM to the process group when its first index is asked for: from ``iter(loader)``,
    right after it started the workers."""

    sent: dict[str, object] | None = None

    def __iter__(self) -> Iterator[int]:
        for position, index in enumerate(super().__iter__()):
            if position == 0:
                os.killpg(os.getpgrp(), signal.SIGTERM)
                Signalling.sent = {"pending": signal.SIGTERM in signal.sigpending(), "handled": len(RECEIVED)}
            yield index


def slow_start(worker_id: int) -> None:
    """``start_worker`` half a second late: the window from a worker's fork to it, widened."""
    time.sleep(0.5)
    start_worker(worker_id)


def signalled_pass(kind: str, method: str) -> dict[str, object]:
    """One pass over a training or evaluation loader whose start is hit by the group's SIGTERM."""
    torch.multiprocessing.set_start_method(method, force=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: RECEIVED.append(signum))
    env = detect_env({}, device="cpu")
    loading = DataLoading(LoaderSettings(num_workers=2), env.device, seed=0)
    sampler = Signalling(Pids(), env, shuffle=False)
    if kind == "train":
        loader = loading.train_loader(Pids(), sampler, batch_size=1)
        loader.worker_init_fn = slow_start
        batches = list(InputTimer().batches(loader))
        loading.close()
    else:
        loader = loading.eval_loader(Pids(), sampler, batch_size=1)
        loader.worker_init_fn = slow_start
        batches = list(loader_pass(loader))
    pids = {int(batch) for batch in batches}
    return {"sent": Signalling.sent, "received": len(RECEIVED), "batches": len(batches), "workers": len(pids - {os.getpid()}),
            "children_left": len(multiprocessing.active_children())}  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "method"), [("train", "fork"), ("eval", "fork"), ("eval", "spawn")])
def test_a_sigterm_to_the_group_as_workers_start_reaches_the_trainer_once_and_spares_the_workers(kind, method):
    command = [sys.executable, __file__, kind, method]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    try:
        out, err = process.communicate(timeout=150)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err[-3000:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["sent"] == {"pending": True, "handled": 0}  # held while iter() started the workers
    assert seen["received"] == 1  # then delivered, once
    assert seen["batches"] == 8 and seen["workers"] == 2 and seen["children_left"] == 0  # no worker died of it


if __name__ == "__main__":
    print(json.dumps(signalled_pass(sys.argv[1], sys.argv[2])))
