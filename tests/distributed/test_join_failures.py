"""Joining the process group is bounded by distributed.timeout_s on every rank and each failure is one
sentence (ampddp.distributed.join): a peer that never arrives, nothing listening, a program on
MASTER_PORT that never answers (the watchdog), ranks that disagree on WORLD_SIZE or share a RANK."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ampddp.distributed import free_port
from ampddp.distributed.env import DistEnv
from ampddp.distributed.join import CLAIM_KEY, GRACE_S, INTRODUCTION_KEY, introduce, join_process_group
from ampddp.errors import EXIT_PEER_FAILURE, ConfigError, RendezvousError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def place(rank: int, world_size: int, port: int, timeout_s: float = 2.0) -> DistEnv:
    return DistEnv(rank=rank, world_size=world_size, backend="gloo", timeout_s=timeout_s, init_method=f"tcp://127.0.0.1:{port}",
                   master_addr="127.0.0.1", master_port=port, launcher="tcp")  # fmt: skip


def test_rank_0_names_the_ranks_that_never_arrived_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 0 of 3: rank\(s\) 1, 2 never arrived within distributed.timeout_s=2 s"):
        join_process_group(place(0, 3, free_port()))
    assert time.monotonic() - started < 2 + GRACE_S
    assert not dist.is_initialized()


def test_a_rank_that_finds_nothing_listening_says_so_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 1 of 2: no rendezvous at 127.0.0.1:\d+ .* nothing listens there: rank 0 did not"):
        join_process_group(place(1, 2, free_port()))
    assert time.monotonic() - started < 2 + GRACE_S


def test_rank_0_refuses_a_master_port_another_program_holds_at_once():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=f"rank 0 of 2: cannot listen on MASTER_PORT={port}: another program uses that port"):
            join_process_group(place(0, 2, port))


def test_a_listener_that_never_answers_ends_the_rank_in_one_line_from_the_watchdog():
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        code = (f"from ampddp.distributed.env import setup_distributed; setup_distributed(rank=1, world_size=2, device='cpu', "
                f"init_method='tcp://127.0.0.1:{mute.getsockname()[1]}', timeout_s=1)")  # fmt: skip
        started = time.monotonic()
        env = {**os.environ, "PYTHONPATH": SRC}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert time.monotonic() - started < 1 + GRACE_S + 20  # the interpreter's start and torch's import included
    assert done.returncode == EXIT_PEER_FAILURE, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampddp: error: rank 1 of 2: connecting to rank 0's rendezvous at 127.0.0.1:"), lines
    assert "does not answer as rank 0's store" in lines[0]


def test_ranks_that_disagree_on_world_size_are_refused_at_once_naming_both():
    port = free_port()
    errors: dict[int, BaseException] = {}

    def join(rank: int, world_size: int) -> None:
        try:
            join_process_group(place(rank, world_size, port, timeout_s=20))
        except BaseException as error:
            errors[rank] = error

    started = time.monotonic()
    threads = [threading.Thread(target=join, args=args) for args in ((0, 2), (1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert time.monotonic() - started < 10, "a disagreement waited for the timeout"
    assert isinstance(errors[0], ConfigError) and isinstance(errors[1], ConfigError), errors
    assert str(errors[0]).startswith("rank 0 of 2 was started with WORLD_SIZE=2, but rank 1 (pid ")
    assert str(errors[1]).startswith("rank 1 of 3 was started with WORLD_SIZE=3, but rank 0 (pid ")
    assert not dist.is_initialized()


def test_two_processes_claiming_one_rank_are_refused():
    store = dist.HashStore()
    store.add(CLAIM_KEY.format(rank=1), 1)
    store.set(INTRODUCTION_KEY.format(rank=1), '{"world_size": 2, "host": "a", "pid": 1}')
    with pytest.raises(ConfigError, match="rank 1 of 2: another process already joined as RANK=1; start every process with its own RANK"):
        introduce(store, place(1, 2, 1), time.monotonic() + 5)
