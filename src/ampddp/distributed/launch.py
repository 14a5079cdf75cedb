"""Local launcher: N processes on this machine, a free port picked for them, results returned.

For users without torchrun (and for tests). Every worker gets a ready DistEnv; a worker that raises
or dies makes ``launch_local`` raise an error naming that rank instead of hanging the others.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.multiprocessing as mp

from ampddp.choices import MAX_PROCESSES
from ampddp.distributed.env import DEFAULT_TIMEOUT_S, setup_distributed, shutdown_distributed
from ampddp.distributed.lifeline import end_with_parent
from ampddp.errors import AmpUsageError, CheckpointError, ConfigError, NonFiniteGradientsError, OutOfMemoryError, PeerFailureError
from ampddp.preemption import StopRequested, StopSignals, blocked_signals, ignored_by_nohup, parse_signals

logger = logging.getLogger("ampddp.distributed")
THREADS_ENV = "OMP_NUM_THREADS"


class LaunchError(RuntimeError):
    """A launched worker failed; the message names the rank and carries its traceback."""


class RankExitedError(LaunchError, PeerFailureError):
    """A rank's process ended (killed, or exited) before returning its result: for the ranks
    left, and for the CLI's exit status, another rank died."""


USER_FACING_ERRORS = (
    ConfigError,
    CheckpointError,
    NonFiniteGradientsError,
    AmpUsageError,
    PeerFailureError,
    OutOfMemoryError,
    StopRequested,
)
"""Errors re-raised in the launching process with their own type (one line and exit status in the CLI)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def threads_per_process(nprocs: int) -> int | None:
    """CPU threads for each of ``nprocs`` local processes: this process's cores split between them
    (torch's default in every process would oversubscribe the cores several times over), or None
    when the user set ``OMP_NUM_THREADS`` (theirs stands, as under torchrun)."""
    if os.environ.get(THREADS_ENV):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // nprocs)
    if nprocs > 1:
        message = "each of the %d processes uses %d CPU thread(s) (%d cores split between them; set %s to choose)"
        logger.info(message, nprocs, threads, cores, THREADS_ENV)
    return threads


def _worker(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    init_method: str,
    options: dict,
    results: Any,
    args: tuple,
    threads: int | None,
    launcher_pid: int,
) -> None:
    end_with_parent(launcher_pid)  # first: a launcher killed while this worker imports leaves no orphan
    if threads is not None:
        os.environ[THREADS_ENV] = str(threads)  # for what this worker starts (DataLoader workers, subprocesses)
        torch.set_num_threads(threads)
    try:
        env = setup_distributed(rank=rank, world_size=nprocs, init_method=init_method, **options)
        # Plain pickle copies tensors into the message; torch's shared-memory handles would die with us.
        results.put((rank, "ok", pickle.dumps(fn(env, *args))))
    except BaseException as error:
        # ampddp's own errors travel as themselves, so the caller reports them as one line with
        # their exit status; anything else comes back as the worker's traceback.
        own = (pickle.dumps(error) if isinstance(error, USER_FACING_ERRORS) else None, traceback.format_exc())
        results.put((rank, "error", own))
    finally:
        shutdown_distributed()


def launch_local(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    device: str = "auto",
    backend: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    host: str = "127.0.0.1",
    job_timeout_s: float | None = None,
    forward_signals: tuple[str, ...] | StopSignals = (),
) -> list[Any]:
    """Run ``fn(env, *args)`` (env: a DistEnv) in ``nprocs`` spawned processes; return their results by rank.

    ``fn`` must be importable by name (a module-level function), as with ``mp.spawn``. ``timeout_s``
    bounds each collective inside the workers; ``job_timeout_s`` (default: none) bounds the whole job.
    The workers end with this process, however it ends (``ampddp.distributed.lifeline``).
    Signals named in ``forward_signals`` that reach this process are passed on to every worker. The
    workers start with them blocked, so one forwarded while a worker still imports waits (pending)
    until its ``StopSignals`` unblocks it instead of killing it; ``fn`` should enter one for them.
    Given the parent's active ``StopSignals``, a signal before the workers exist ends the launch at once.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or not 1 <= nprocs <= MAX_PROCESSES:
        raise ConfigError(f"nprocs={nprocs!r} is not valid; it must be an integer in [1, {MAX_PROCESSES}]")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    init_method = f"tcp://{host}:{free_port(host)}"
    options = {"device": device, "backend": backend, "timeout_s": timeout_s}
    threads = threads_per_process(nprocs)
    processes = [
        context.Process(target=_worker, args=(fn, rank, nprocs, init_method, options, results, args, threads, os.getpid()), daemon=False)
        for rank in range(nprocs)
    ]
    signals = _forwarded(forward_signals)

    def forward(signum: int, frame: FrameType | None) -> None:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    forwarded: dict[signal.Signals, Any] = {}
    try:
        with blocked_signals(signals):  # the workers start with them blocked; one that comes meanwhile is forwarded after
            for process in processes:
                process.start()
            forwarded = {sig: signal.signal(sig, forward) for sig in signals}
        return _collect(processes, results, nprocs, job_timeout_s)
    finally:
        for sig, previous in forwarded.items():
            signal.signal(sig, previous)
        for process in processes:
            if process.is_alive():
                process.kill()
            if process.pid is not None:  # a start that failed leaves the rest unstarted
                process.join()


def _forwarded(forward_signals: tuple[str, ...] | StopSignals) -> tuple[signal.Signals, ...]:
    """The signals a launch passes on to its workers: none off the main thread (no handler can be set
    there), and not a SIGHUP ``nohup`` asked to ignore."""
    if threading.current_thread() is not threading.main_thread():
        return ()
    named = forward_signals.signals if isinstance(forward_signals, StopSignals) else parse_signals(forward_signals)
    return tuple(sig for sig in named if not ignored_by_nohup(sig))


def _worker_error(rank: int, nprocs: int, pickled: bytes | None, trace: str) -> Exception:
    """The error a worker raised: ampddp's own error types keep their type (and so their exit
    status in the CLI), with the rank in front; anything else is a LaunchError with the traceback."""
    if pickled is not None:
        error = pickle.loads(pickled)
        where = f"rank {rank} of {nprocs}"
        copy = type(error)(str(error) if str(error).startswith(f"{where}:") else f"{where}: {error}")  # said once
        copy.__cause__ = LaunchError(trace)
        return copy
    return LaunchError(f"rank {rank} of {nprocs} failed:\n{trace}")


def _how_it_ended(exitcode: int) -> str:
    """'exited with code 7', or 'was killed by SIGKILL' for a negative multiprocessing exit code."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"


def _collect(processes: list, results: Any, nprocs: int, job_timeout_s: float | None) -> list[Any]:
    outcome: dict[int, Any] = {}
    deadline = None if job_timeout_s is None else time.monotonic() + job_timeout_s
    while len(outcome) < nprocs:
        while not results.empty():
            rank, status, value = results.get()
            if status == "error":
                raise _worker_error(rank, nprocs, *value)
            outcome[rank] = pickle.loads(value)
        for rank, process in enumerate(processes):
            if rank not in outcome and process.exitcode is not None and results.empty():
                raise RankExitedError(f"rank {rank} of {nprocs} {_how_it_ended(process.exitcode)} before finishing")
        if deadline is not None and time.monotonic() > deadline:
            missing = sorted(set(range(nprocs)) - set(outcome))
            raise LaunchError(f"ranks {missing} of {nprocs} did not finish within job_timeout_s={job_timeout_s:.0f}s")
        time.sleep(0.01)
    return [outcome[rank] for rank in range(nprocs)]
