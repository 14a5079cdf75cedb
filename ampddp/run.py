"""Assemble a training run from a RunConfig: the one place that maps config sections to objects."""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import torch

from ampddp.config import RunConfig
from ampddp.data import build_datasets
from ampddp.distributed.env import DistEnv, detect_env, setup_distributed, shutdown_distributed
from ampddp.distributed.launch import launch_local
from ampddp.distributed.watch import PeerWatch
from ampddp.errors import ConfigError
from ampddp.models import build_model
from ampddp.observe import RunObserver
from ampddp.precision.engine import NATIVE_MODES
from ampddp.precision.factory import build_engine
from ampddp.precision.registry import FP32, LOW, PROMOTE, OpRegistry
from ampddp.preemption import StopSignals, parse_signals
from ampddp.trainer import Trainer

NATIVE_KEYS = ("loss_scale", "init_loss_scale", "growth_factor", "backoff_factor", "growth_interval")
REGISTRATION_KEYS = {"float_functions": FP32, "half_functions": LOW, "promote_functions": PROMOTE}


def precision_overrides(config: RunConfig) -> dict[str, Any]:
    """The precision.* keys the user set, checked against what the chosen mode accepts."""
    values = dataclasses.asdict(config.precision)
    set_keys = {k: v for k, v in values.items() if k not in ("mode", "impl", *REGISTRATION_KEYS) and v is not None}
    if config.precision.mode in NATIVE_MODES:
        for key in set_keys:
            if key not in NATIVE_KEYS:
                raise ConfigError(
                    f"precision.{key} applies to the O0-O5 opt levels, not to {config.precision.mode}; valid here: {', '.join(NATIVE_KEYS)}"
                )
    return set_keys


def resolve_function(dotted: str) -> tuple[Any, str]:
    """'torch.nn.functional.softplus' -> (torch.nn.functional, 'softplus')."""
    module_name, _, attribute = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        parent, _, inner = module_name.rpartition(".")
        try:
            module = getattr(importlib.import_module(parent), inner)
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(
                f"cannot resolve {dotted!r}: no module {module_name!r}; write it as module.function, e.g. torch.nn.functional.softplus"
            ) from None
    if not attribute or not hasattr(module, attribute):
        raise ConfigError(f"cannot resolve {dotted!r}: {module_name} has no attribute {attribute!r}")
    return module, attribute


def build_registry(config: RunConfig) -> OpRegistry:
    registry = OpRegistry()
    for key, kind in REGISTRATION_KEYS.items():
        for dotted in getattr(config.precision, key):
            module, attribute = resolve_function(dotted)
            registry.register(module, attribute, kind)
    return registry


def validate(config: RunConfig) -> None:
    """Everything that can be checked without training: raise ConfigError before any work starts."""
    build_engine(config.precision.mode, impl=config.precision.impl, **precision_overrides(config))
    build_registry(config)
    build_model(config.model.name, config.model.num_classes, config.data.channels, config.data.image_size)
    if config.data.name != "digits" and config.data.root is None:
        raise ConfigError(f"data.name={config.data.name} needs data.root (ampddp never downloads data)")
    for key in ("max_epochs", "grad_accum_steps", "log_every_steps", "max_nonfinite_losses"):
        if getattr(config.trainer, key) < 1:
            raise ConfigError(f"trainer.{key}={getattr(config.trainer, key)} is not valid; it must be >= 1")
    parse_signals(config.trainer.stop_signals)
    if config.trainer.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ConfigError("trainer.tensorboard=true needs the tensorboard package: pip install 'ampddp[tensorboard]'") from None
    if config.distributed.nproc_per_node < 1:
        raise ConfigError(f"distributed.nproc_per_node={config.distributed.nproc_per_node} is not valid; it must be >= 1")


def _scheduler_factory(config: RunConfig, steps_per_epoch: int) -> Any:
    total = config.trainer.max_steps or config.trainer.max_epochs * steps_per_epoch
    if config.optimizer.scheduler == "cosine":
        return lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    if config.optimizer.scheduler == "step":
        return lambda optimizer: torch.optim.lr_scheduler.StepLR(
            optimizer, config.optimizer.step_size * steps_per_epoch, config.optimizer.gamma
        )
    return None


def _optimizer_factory(config: RunConfig) -> Any:
    opt = config.optimizer
    if opt.name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
    return lambda params: torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)


def train(config: RunConfig, env: DistEnv) -> dict[str, Any]:
    """Run training in this process (one rank of ``env``); returns the summary.

    Stop signals are caught from the start, so one that arrives while data and model are being set
    up still ends in a checkpoint, and one that arrives after training lets the run finish normally.
    """
    with StopSignals(config.trainer.stop_signals) as stop:
        return _train(config, env, stop)


def _train(config: RunConfig, env: DistEnv, stop: StopSignals) -> dict[str, Any]:
    data, trainer_cfg = config.data, config.trainer
    train_set, eval_set = build_datasets(
        data.name, data.root, data.image_size, data.channels, data.eval_fraction, trainer_cfg.seed, data.augment
    )
    torch.manual_seed(trainer_cfg.seed)
    model = build_model(config.model.name, config.model.num_classes, data.channels, data.image_size)
    steps_per_epoch = max(1, math.ceil(len(train_set) / (data.batch_size * env.world_size * trainer_cfg.grad_accum_steps)))
    observer = RunObserver(
        trainer_cfg.run_dir, env, progress=trainer_cfg.progress,
        tensorboard=trainer_cfg.tensorboard, total_steps=trainer_cfg.max_steps or trainer_cfg.max_epochs * steps_per_epoch,
    )  # fmt: skip
    trainer = Trainer(
        model, _optimizer_factory(config), train_set, eval_set=eval_set, env=env,
        precision=config.precision.mode, impl=config.precision.impl, precision_overrides=precision_overrides(config),
        registry=build_registry(config), sync_bn=config.distributed.sync_bn, strategy=config.distributed.strategy,
        batch_size=data.batch_size, grad_accum_steps=trainer_cfg.grad_accum_steps, clip_grad_norm=trainer_cfg.clip_grad_norm,
        make_scheduler=_scheduler_factory(config, steps_per_epoch), max_epochs=trainer_cfg.max_epochs, max_steps=trainer_cfg.max_steps,
        seed=trainer_cfg.seed, run_dir=trainer_cfg.run_dir, checkpoint_every=config.checkpoint.every_steps,
        keep_last=config.checkpoint.keep_last, resume=config.checkpoint.resume_from or config.checkpoint.resume,
        init_from=config.checkpoint.init_from, config=config.to_dict(), eval_every=trainer_cfg.eval_every_steps,
        log_every=trainer_cfg.log_every_steps, max_nonfinite_losses=trainer_cfg.max_nonfinite_losses, observer=observer,
        stop_signals=stop,
    )  # fmt: skip
    with PeerWatch(env) as watch, watch.guard():
        return trainer.fit()["summary"]


def _spawned(env: DistEnv, config: RunConfig) -> dict[str, Any]:
    return train(config, env)


def launch(config: RunConfig) -> dict[str, Any]:
    """Train under whatever launcher started us, or spawn ``nproc_per_node`` local processes."""
    validate(config)
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=dist_cfg.backend, timeout_s=dist_cfg.timeout_s)
    if dist_cfg.nproc_per_node > 1 and env.launcher == "none":
        results = launch_local(
            _spawned, dist_cfg.nproc_per_node, (config,), device=dist_cfg.device, backend=dist_cfg.backend, timeout_s=dist_cfg.timeout_s
        )
        return results[0]
    env = setup_distributed(device=dist_cfg.device, backend=dist_cfg.backend, timeout_s=dist_cfg.timeout_s)
    try:
        return train(config, env)
    finally:
        shutdown_distributed()
