"""What a recipe's run is checked for before any part of it is built, before anything is written.

``check_recipe`` is the entry point (all a parent spawning workers checks); the run dir is probed
once the run is built (``RunDir.probe``, the only check that touches the filesystem).
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ampddp.checkpoint.safetensors_weights import check_key_map
from ampddp.choices import FLOAT16_MAX, FLOAT32_MAX, INT64_MAX
from ampddp.config import RunConfig, is_import_path
from ampddp.distributed.env import DistEnv, detect_env
from ampddp.distributed.parallel import Parallel
from ampddp.errors import ConfigError, shown
from ampddp.precision.choice import Precision
from ampddp.preemption import parse_signals
from ampddp.recipe.factories import (
    data_root,
    device_settings,
    loader_settings,
    model_compiler,
    parallel_from,
    precision_from,
    process_group_backend,
    refuse_kwargs,
    reporting_from,
)
from ampddp.recipe.path_checks import check_paths
from ampddp.recipe.reading import check_config
from ampddp.training.resume.kept_precision import kept_precision
from ampddp.zoo.data import find_classes

IMAGE_OPTIONS = (
    ("crop", "random-resized", ("cifar10", "imagefolder")),
    ("auto_augment", "none", ("cifar10", "imagefolder")),
    ("normalize", None, ("cifar10", "imagefolder")),
    ("decode_device", "cpu", ("imagefolder",)),
)
"""(data key, its default, the data sets that use it): a non-default value elsewhere is refused."""
UNCATCHABLE_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name))


def _check_data(config: RunConfig) -> None:
    """A built-in data set's kwargs and class folders (its data.root's layout: ``check_paths``), and
    the image options of any (a user's data set is checked where it is built)."""
    data = config.data
    if not is_import_path(data.name):
        refuse_kwargs("data", data.name, data.kwargs)
        if data.name == "imagefolder":
            find_classes(Path(data_root(config)) / "train")
    _check_image_options(config)


def _check_image_options(config: RunConfig) -> None:
    """The image pipeline's settings on the data sets they apply to; GPU decoding where it can run."""
    data = config.data
    name = "a data set named by import path" if is_import_path(data.name) else f"data.name={data.name}"
    for key, default, applies_to in IMAGE_OPTIONS:
        value = getattr(data, key)
        if value != default and data.name not in applies_to:
            raise ConfigError(f"data.{key}={value} applies to data.name={' or '.join(applies_to)}, not to {name}; remove data.{key}")
    if data.name in ("cifar10", "imagefolder") and data.channels != 3:
        raise ConfigError(f"data.channels={data.channels}: {data.name} images are RGB; set data.channels=3")
    if data.decode_device != "cuda":
        return
    if data.num_workers > 0:
        raise ConfigError(
            f"data.decode_device=cuda decodes in the training process, so it needs data.num_workers=0 "
            f"(found {data.num_workers}); or decode in the workers with data.decode_device=cpu"
        )
    if data.pin_memory:
        raise ConfigError("data.decode_device=cuda yields batches already on the GPU, which cannot be pinned; set data.pin_memory=false")
    if not torch.cuda.is_available() or config.distributed.device == "cpu":
        where = "distributed.device=cpu" if torch.cuda.is_available() else "CUDA is not available on this machine"
        raise ConfigError(f"data.decode_device=cuda decodes on the training GPU, but {where}; use data.decode_device=cpu")


def _check_stop_signals(names: list[str]) -> None:
    try:
        parsed = parse_signals(names)
    except ConfigError as error:
        raise ConfigError(f"trainer.stop_signals={names!r}: {error}") from None
    for name, sig in zip(names, parsed):
        if sig in UNCATCHABLE_SIGNALS or sig not in signal.valid_signals():
            raise ConfigError(
                f"trainer.stop_signals: {name} cannot be caught by a process, so it cannot trigger a checkpoint; "
                "valid: catchable signals such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT"
            )


def _check_schedule(config: RunConfig) -> None:
    opt, max_steps = config.optimizer, config.trainer.max_steps
    if max_steps is not None and opt.warmup_steps >= max_steps:
        raise ConfigError(
            f"optimizer.warmup_steps={opt.warmup_steps} is not below trainer.max_steps={max_steps}: the run would end in warmup; "
            "it must be smaller"
        )
    _check_growing_steps(config)


def _check_growing_steps(config: RunConfig) -> None:
    """A step schedule with gamma > 1 raises the learning rate at each decay: refused where its last
    epoch's rate would pass float32's largest (the optimizer's scalar overflows there)."""
    opt = config.optimizer
    if opt.scheduler != "step" or opt.gamma <= 1 or opt.lr == 0:
        return
    decays = (config.trainer.max_epochs - 1) // opt.step_size
    if math.log(opt.lr) + decays * math.log(opt.gamma) > math.log(FLOAT32_MAX):
        raise ConfigError(
            f"optimizer.gamma={opt.gamma:g} multiplies optimizer.lr={opt.lr:g} {decays} times over trainer.max_epochs="
            f"{config.trainer.max_epochs} (optimizer.step_size={opt.step_size}), past float32's largest ({FLOAT32_MAX:g}); "
            "lower gamma, lr or max_epochs"
        )


def _check_optimizer_numbers(config: RunConfig, precision: Precision) -> None:
    """optimizer.lr, weight_decay and every number in optimizer.kwargs (eps, betas, ...) within what the
    weights the optimizer steps hold: each becomes the scalar of an op on them, which a larger one
    overflows at the first step (``value cannot be converted to type float without overflow``)."""
    opt = config.optimizer
    largest, dtype = _stepped_range(precision)
    numbers = [("optimizer.lr", opt.lr), ("optimizer.weight_decay", opt.weight_decay), *_numbers_in("optimizer.kwargs", opt.kwargs)]
    for key, value in numbers:
        if isinstance(value, int) and abs(value) > INT64_MAX:
            raise ConfigError(f"{key}={shown(value)} is out of range; it must be an integer in [-{INT64_MAX}, {INT64_MAX}]")
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= largest):
            where = f" ({precision.mode} steps {dtype} weights)" if dtype != "float32" else ""
            raise ConfigError(f"{key}={value!r} is out of range; it must be a finite number in [-{largest:g}, {largest:g}]{where}")


def _stepped_range(precision: Precision) -> tuple[float, str]:
    """The largest value of the weights the optimizer steps, and their dtype: float16 where an opt level
    casts the model to it without fp32 master weights (O3), float32 otherwise."""
    if precision.spec.policy is None:
        return FLOAT32_MAX, "float32"
    policy = precision.spec.resolve_policy(**precision.overrides)
    if policy.cast_model_type == torch.float16 and not policy.master_weights:
        return FLOAT16_MAX, "float16"
    return FLOAT32_MAX, "float32"


def _numbers_in(key: str, value: Any) -> Iterator[tuple[str, float]]:
    """Every number in ``value`` (nested in lists and mappings), with its dotted key."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers_in(f"{key}.{name}", item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers_in(f"{key}[{index}]", item)


def _check_mesh(parallel: Parallel, env: DistEnv, nproc_per_node: int) -> None:
    """The strategy's mesh over the processes the run will have (a launcher's, or ``nproc_per_node`` spawned):
    sizes that do not divide the world are refused before any process starts."""
    if not env.distributed:
        env = dataclasses.replace(env, world_size=nproc_per_node, local_world_size=nproc_per_node)
    try:
        parallel.dims(env)
    except ConfigError as error:
        raise ConfigError(f"distributed: {error}") from None


def check_recipe(config: RunConfig) -> None:
    """What a run can be checked for before any part of it is built, and all a parent spawning
    workers checks before they exist: values and ranges, precision settings the device cannot run,
    dotted names, data paths and image options, the LR schedule and strategy settings, stop signals,
    the torch.compile backend, reporting, and that a checkpoint to resume from exists. Each built part
    is checked where it is built (``ampddp.recipe.build``); the run dir is probed (``RunDir.probe``)
    and locked after that, before the first write.
    """
    check_config(config)
    check_paths(config)
    loader_settings(config)
    device_settings(config)
    _check_schedule(config)
    parallel = parallel_from(config)  # the strategy and its settings, checked
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=process_group_backend(config), timeout_s=dist_cfg.timeout_s)
    _check_mesh(parallel, env, dist_cfg.nproc_per_node)
    resume = config.checkpoint.resume_from or config.checkpoint.resume
    precision = kept_precision(precision_from(config), config.trainer.run_dir, resume, env).resolved(env.device)
    _check_optimizer_numbers(config, precision)
    _check_data(config)
    _check_stop_signals(config.trainer.stop_signals)
    model_compiler(config)
    reporting_from(config)
    check_key_map(config.model.key_map)
