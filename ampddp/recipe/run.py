"""Run a recipe: validate it, then train in this process or spawn ``nproc_per_node`` local ones.

What each config section becomes lives in ``ampddp.recipe.factories``; what is checked before
anything is written, in ``ampddp.recipe.checks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ampddp.config import RunConfig
from ampddp.distributed.data import broadcast_from_main
from ampddp.distributed.env import DistEnv, detect_env, setup_distributed, shutdown_distributed
from ampddp.distributed.launch import launch_local
from ampddp.distributed.watch import PeerWatch
from ampddp.errors import ConfigError
from ampddp.observe.console import rank_console
from ampddp.preemption import EarlySignals, StopSignals
from ampddp.recipe.checks import Built, validate
from ampddp.recipe.factories import (
    DROP_LAST,
    SHUFFLE,
    build_datasets_from,
    build_model_from,
    checkpoint_settings,
    device_settings,
    loader_settings,
    model_compiler,
    optimizer_factory,
    parallel_from,
    precision_from,
    process_group_backend,
    reporting_from,
    scheduler_factory,
    steps_per_epoch,
)
from ampddp.recipe.rank_agreement import check_ranks_agree
from ampddp.rundir.lock import RunDirLock
from ampddp.trainer import Trainer

__all__ = ["launch", "train", "validate"]


def train(config: RunConfig, env: DistEnv, early: EarlySignals | None = None, built: Built | None = None) -> dict[str, Any]:
    """Run training in this process (one rank of ``env``); returns the summary. ``built``: what
    ``validate`` built in this process (used as it is; the rest is built here).

    Stop signals are caught from the start, so one that arrives while data and model are being set
    up still ends in a checkpoint, and one that arrives after training lets the run finish normally.
    ``early``: the command line's catcher, whose signals (and one already received) this run takes over.
    """
    with StopSignals(config.trainer.stop_signals, early=early) as stop:
        return _train(config, env, stop, built or Built())


def _train(config: RunConfig, env: DistEnv, stop: StopSignals, built: Built) -> dict[str, Any]:
    with rank_console(env):
        return _build_and_fit(config, env, stop, built)


def _build_and_fit(config: RunConfig, env: DistEnv, stop: StopSignals, built: Built) -> dict[str, Any]:
    data, trainer_cfg = config.data, config.trainer
    train_set, eval_set = built.datasets if built.datasets is not None else build_datasets_from(config, augment=data.augment)
    torch.manual_seed(trainer_cfg.seed)
    model = built.model if built.model is not None else build_model_from(config)
    epoch_steps = steps_per_epoch(config, len(train_set), env.world_size)
    trainer = Trainer(
        model, optimizer_factory(config), train_set, eval_set=eval_set, env=env,
        precision=precision_from(config), parallel=parallel_from(config), compile=model_compiler(config), loading=loader_settings(config),
        device=device_settings(config),
        batch_size=data.batch_size, grad_accum_steps=trainer_cfg.grad_accum_steps, clip_grad_norm=trainer_cfg.clip_grad_norm,
        make_scheduler=scheduler_factory(config, epoch_steps), max_epochs=trainer_cfg.max_epochs, max_steps=trainer_cfg.max_steps,
        seed=trainer_cfg.seed, shuffle=SHUFFLE, drop_last=DROP_LAST, checkpoint_every=config.checkpoint.every_steps,
        checkpoints=checkpoint_settings(config), eval_every=trainer_cfg.eval_every_steps,
        log_every=trainer_cfg.log_every_steps, max_nonfinite_losses=trainer_cfg.max_nonfinite_losses, report=reporting_from(config),
        stop_signals=stop,
    )  # fmt: skip
    with PeerWatch(env) as watch, watch.guard():
        return trainer.fit()["summary"]


def _spawned(env: DistEnv, config: RunConfig) -> dict[str, Any]:
    return train(config, env)


def launch(config: RunConfig, early: EarlySignals | None = None) -> dict[str, Any]:
    """Train under whatever launcher started us, or spawn ``nproc_per_node`` local processes.

    ``early`` holds the stop signals through ``validate`` (see ``train``); a parent of spawned
    workers takes them over and forwards them, including one that came before the workers existed.

    The main process (rank 0, or the parent of spawned workers) holds the run_dir lock throughout;
    under a launcher every rank stops with a ConfigError when rank 0 cannot take it.
    """
    built = validate(config)
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=process_group_backend(config), timeout_s=dist_cfg.timeout_s)
    if dist_cfg.nproc_per_node > 1 and env.launcher == "none":
        del built  # each spawned worker builds its own run; this process only waits for them
        with RunDirLock(config.trainer.run_dir), StopSignals(config.trainer.stop_signals, early=early) as stop:
            results = launch_local(
                _spawned, dist_cfg.nproc_per_node, (config,), device=dist_cfg.device, backend=process_group_backend(config),
                timeout_s=dist_cfg.timeout_s, forward_signals=stop,
            )  # fmt: skip
        return results[0]
    with _joined_and_locked(config) as env:
        return train(config, env, early, built)


@contextlib.contextmanager
def _joined_and_locked(config: RunConfig) -> Iterator[DistEnv]:
    """Join the process group, with rank 0 holding the run_dir lock (one writer per run_dir) until
    the group is shut down on leaving, on every path.

    Every rank learns from one broadcast whether rank 0 got the lock, so when another run holds it
    all ranks raise ConfigError at once, instead of the others waiting ``timeout_s`` in a collective
    for a rank 0 that has left.
    """
    dist_cfg, run_dir = config.distributed, config.trainer.run_dir
    env = setup_distributed(device=dist_cfg.device, backend=process_group_backend(config), timeout_s=dist_cfg.timeout_s)
    with contextlib.ExitStack() as held:  # closed last: the lock outlives the process group
        try:
            refusal: BaseException | None = None
            if env.is_main:
                try:
                    held.enter_context(RunDirLock(run_dir))
                except BaseException as error:  # any failure: the other ranks must hear of it, not wait
                    refusal = error
            refused = broadcast_from_main(None if refusal is None else str(refusal) or type(refusal).__name__, env)
            if refusal is not None:
                raise refusal
            if refused is not None:
                raise ConfigError(f"rank 0 could not take the run_dir lock, so rank {env.rank} stops too: {refused}")
            check_ranks_agree(config, env)
            yield env
        finally:
            shutdown_distributed()
