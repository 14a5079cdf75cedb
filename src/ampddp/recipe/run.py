"""Run a recipe: check it, then train in this process or spawn ``nproc_per_node`` local ones.

A run goes, in each training process: its values checked (``ampddp.recipe.checks``), then built once
in order and its resume planned (``ampddp.recipe.build``), then its run dir probed and locked, then
the first write. What each config section becomes lives in ``ampddp.recipe.factories``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

from ampddp.config import RunConfig
from ampddp.distributed.data import gather_objects
from ampddp.distributed.env import DistEnv, detect_env, init_one_rank_group, setup_distributed, shutdown_distributed
from ampddp.distributed.launch import launch_local
from ampddp.distributed.strategies import strategy_class
from ampddp.distributed.watch import PeerWatch
from ampddp.errors import ConfigError
from ampddp.observe.console import notes_held_until_done, rank_console
from ampddp.observe.run_log import RunLog
from ampddp.preemption import EarlySignals, StopSignals
from ampddp.recipe.build import build_run
from ampddp.recipe.checks import check_recipe
from ampddp.recipe.factories import process_group_backend
from ampddp.recipe.rank_agreement import check_ranks_agree
from ampddp.rundir.run_dir import RunDir
from ampddp.training.callbacks import Callback
from ampddp.training.progress import Progress

__all__ = ["check_recipe", "launch", "train"]


def train(config: RunConfig, env: DistEnv, early: EarlySignals | None = None, *, claim: ExitStack | None = None) -> dict[str, Any]:
    """Build and train the run in this process (one rank of ``env``); returns the summary.

    Stop signals are caught from the start, so one that arrives while data and model are being set
    up still ends in a checkpoint, and one that arrives after training lets the run finish normally.
    ``early``: the command line's catcher, whose signals (and one already received) this run takes over.
    ``claim``: where the run dir's claim (probe and lock, taken once the run is built) is held until
    it closes; None: it is not claimed here (a spawning parent holds it). What the build says is
    printed once the run dir is claimed: a run refused on the way says only its error.
    """
    with StopSignals(config.trainer.stop_signals, early=early) as stop, rank_console(env), ExitStack() as logged:
        place = RunDir(config.trainer.run_dir, "trainer.run_dir")  # one value: the run writes, probes and locks it
        with notes_held_until_done():
            log = logged.enter_context(RunLog(env))  # inside: it keeps every record as it comes, the held notes too
            trainer = build_run(config, env, stop, place, callbacks=[LogOpensWithTraining(log, place)])
            if claim is not None:
                claim.enter_context(claimed_run_dir(place, env))
        with PeerWatch(env, where=trainer.phase.where) as watch, watch.guard():
            return trainer.fit()["summary"]


class LogOpensWithTraining(Callback):
    """The run's log file opens when training starts (or resumes), with the run's first record: a
    finished run started again changes nothing in its run dir, its log included."""

    def __init__(self, log: RunLog, place: RunDir) -> None:
        self.log, self.place = log, place

    def on_start(self, progress: Progress) -> None:
        self.log.open(self.place)


def _spawned(env: DistEnv, config: RunConfig) -> dict[str, Any]:
    """A spawned rank: it joins the run dir's lock its launcher took, so no second run enters while it lives."""
    with RunDir(config.trainer.run_dir, "trainer.run_dir").lock(joining=True):
        return train(config, env)


def launch(config: RunConfig, early: EarlySignals | None = None) -> dict[str, Any]:
    """Train under whatever launcher started us, or spawn ``nproc_per_node`` local processes.

    ``early`` holds the stop signals through the checks (see ``train``); a parent of spawned
    workers takes them over and forwards them, including one that came before the workers existed.

    The main process (rank 0, or the parent of spawned workers, which checks the values and claims the
    run dir before they exist, and builds nothing) holds the run_dir lock until the run ends.
    """
    check_recipe(config)
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=process_group_backend(config), timeout_s=dist_cfg.timeout_s)
    if dist_cfg.nproc_per_node > 1 and env.launcher == "none":
        with (
            claimed_run_dir(RunDir(config.trainer.run_dir, "trainer.run_dir"), env),
            StopSignals(config.trainer.stop_signals, early=early) as stop,
        ):
            results = launch_local(
                _spawned, dist_cfg.nproc_per_node, (config,), device=dist_cfg.device, backend=process_group_backend(config),
                timeout_s=dist_cfg.timeout_s, forward_signals=stop,
            )  # fmt: skip
        return results[0]
    with ExitStack() as claim, _joined(config) as env:  # the claim closes last: the lock outlives the process group
        return train(config, env, early, claim=claim)


@contextlib.contextmanager
def _joined(config: RunConfig) -> Iterator[DistEnv]:
    """This process in the run's process group (its ranks' recipes agreeing), left on every path."""
    dist_cfg = config.distributed
    env = setup_distributed(device=dist_cfg.device, backend=process_group_backend(config), timeout_s=dist_cfg.timeout_s)
    try:
        if strategy_class(dist_cfg.strategy).needs_process_group:
            init_one_rank_group(env, process_group_backend(config))  # FSDP2 on one process: a mesh of one rank
        check_ranks_agree(config, env)
        yield env
    finally:
        shutdown_distributed()


@contextlib.contextmanager
def claimed_run_dir(run_dir: RunDir, env: DistEnv) -> Iterator[None]:
    """``run_dir`` probed for writing on every rank, the run admitted by rank 0's lock and joined by
    every other rank's (one run per run_dir while any of its ranks lives), until leaving, on every path.

    Every rank learns from one exchange whether every probe passed and rank 0 got the lock, so when
    another run holds it (or a rank cannot write there) all ranks raise at once, instead of the
    others waiting ``timeout_s`` in a collective for a rank that has left.
    """
    with contextlib.ExitStack() as held:
        refusal: BaseException | None = None
        doing = "write into the run_dir"
        try:
            run_dir.probe()
            if env.is_main:
                doing = "take the run_dir lock"
                held.enter_context(run_dir.lock())
        except BaseException as error:  # any failure: the other ranks must hear of it, not wait
            refusal = error
        said = gather_objects(None if refusal is None else (doing, str(refusal) or type(refusal).__name__), env)
        if refusal is not None:
            raise refusal
        for rank, refused in enumerate(said):
            if refused is not None:
                raise ConfigError(f"rank {rank} could not {refused[0]}, so rank {env.rank} stops too: {refused[1]}")
        if not env.is_main:
            held.enter_context(run_dir.lock(joining=True))
        yield
