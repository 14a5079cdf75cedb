"""One voice per job: rank 0 prints, other ranks print only errors (with their rank); PeerWatch
relabels only errors that came from a collective."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ampddp.distributed.env import DistEnv
from ampddp.distributed.watch import PeerWatch, is_distributed_error
from ampddp.errors import CheckpointError, NonFiniteGradientsError, PeerFailureError
from ampddp.observe.console import rank_console

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SMALL = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "precision.mode=O0", "trainer.progress=lines",
         "trainer.log_every_steps=1", "distributed.nproc_per_node=2", "distributed.device=cpu", "optimizer.scheduler=step"]  # fmt: skip


def test_only_collective_errors_become_peer_failures():
    watch = PeerWatch(DistEnv(rank=0, world_size=2))
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1234: Connection reset by peer")
    with pytest.raises(PeerFailureError, match="rank 0 of 2: a collective failed"), watch.guard():
        raise gloo
    for error in (NonFiniteGradientsError("fc.weight is inf/NaN"), CheckpointError("disk full"), torch.OutOfMemoryError("out of memory"),
                  RuntimeError("mat1 and mat2 shapes cannot be multiplied")):  # fmt: skip
        assert not is_distributed_error(error)
        with pytest.raises(type(error)) as caught, watch.guard():
            raise error
        assert caught.value is error
    assert is_distributed_error(torch.distributed.DistBackendError("NCCL communicator was aborted"))


def _emit() -> None:
    logger = logging.getLogger("ampddp.test")
    logger.info("an info line")
    logger.warning("a warning line")
    warnings.warn("a python warning", UserWarning, stacklevel=1)
    logger.error("an error line")


@pytest.mark.parametrize("rank", [0, 1])
def test_other_ranks_print_only_errors_prefixed_with_their_rank(rank, capsys):
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []  # like a spawned worker: no handlers yet
    try:
        with rank_console(DistEnv(rank=rank, world_size=2)):
            _emit()
        assert root.handlers == [], "the handler added for the run is removed again"
    finally:
        root.handlers = saved
    err = capsys.readouterr().err.splitlines()
    if rank == 0:
        assert err[:2] == ["an info line", "a warning line"] and any("a python warning" in line for line in err)
        assert err[-1] == "an error line"
    else:
        assert err == ["[rank 1] an error line"]


@pytest.mark.parametrize("captured", [False, True])
def test_warning_capture_is_left_as_the_application_set_it(captured):
    original = warnings.showwarning
    logging.captureWarnings(captured)
    try:
        before = warnings.showwarning
        with rank_console(DistEnv(rank=0, world_size=1)):
            assert warnings.showwarning is not original, "warnings go to logging during the run"
        assert warnings.showwarning is before
    finally:
        logging.captureWarnings(False)
        warnings.showwarning = original


@pytest.mark.timeout(400)
def test_two_processes_print_one_summary_and_each_warning_once(tmp_path):
    def train(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={tmp_path}", *SMALL, *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)

    first = train("trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = train("trainer.max_steps=4", "optimizer.lr=0.01")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sum("with changed settings" in line for line in resumed.stderr.splitlines()) == 1, resumed.stderr[-3000:]
    assert not any(line.startswith("[rank 1]") for line in resumed.stderr.splitlines())
    assert json.loads(resumed.stdout[resumed.stdout.index("{") :])["steps"] == 4, "exactly one JSON summary on stdout"
