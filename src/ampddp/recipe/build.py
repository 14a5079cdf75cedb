"""One build of a recipe's run, in order: data -> model -> strategy and engine -> optimizer and
scheduler -> resume plan.

Each part is built once and checked where it is used, so the engine, optimizer and scheduler a
checkpoint to resume from is checked against are the ones that train. Nothing is written here:
``ampddp.recipe.run`` probes and locks the run dir after the build, before the first write.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from ampddp.checkpoint.safetensors_weights import SafetensorsWeights, is_safetensors_source
from ampddp.config import RunConfig, is_import_path
from ampddp.distributed.env import DistEnv
from ampddp.distributed.meta_init import ModelBuild
from ampddp.distributed.parallel import Parallel
from ampddp.errors import CheckpointError, ConfigError
from ampddp.preemption import DEFAULT_STOP_SIGNALS, StopSignals
from ampddp.recipe.factories import (
    DROP_LAST,
    SHUFFLE,
    build_datasets_from,
    build_model_from,
    checkpoint_settings,
    data_root,
    device_settings,
    loader_settings,
    model_compiler,
    optimizer_factory,
    parallel_from,
    precision_from,
    reporting_from,
    scheduler_factory,
    steps_per_epoch,
)
from ampddp.rundir.run_dir import RunDir
from ampddp.trainer import Trainer
from ampddp.training.callbacks import Callback
from ampddp.training.model_build import built_model
from ampddp.training.settings import LoopSettings
from ampddp.zoo.data import find_classes

DATASET_CLASSES = {"digits": 10, "cifar10": 10}


def build_run(config: RunConfig, env: DistEnv, stop_signals: tuple[str, ...] | StopSignals = DEFAULT_STOP_SIGNALS,
              run_dir: RunDir | None = None, callbacks: Sequence[Callback] = ()) -> Trainer:  # fmt: skip
    """The run ``config`` describes on ``env``, built and checked, ready to ``fit``; the checkpoint it
    resumes from (if any) read and checked against it, nothing changed or written yet. ``run_dir``:
    trainer.run_dir as the value the caller probes and locks (made here when None); ``callbacks``:
    the caller's, after the run's own reporting."""
    data, trainer_cfg = config.data, config.trainer
    train_set, eval_set = build_datasets_from(config, augment=data.augment)
    parallel = parallel_from(config)
    model = checked_model(config, parallel)
    epoch_steps = steps_per_epoch(config, len(train_set), parallel.dims(env).dp_size)
    loop = LoopSettings(
        batch_size=data.batch_size, grad_accum_steps=trainer_cfg.grad_accum_steps, clip_grad_norm=trainer_cfg.clip_grad_norm,
        max_epochs=trainer_cfg.max_epochs, max_steps=trainer_cfg.max_steps, seed=trainer_cfg.seed, shuffle=SHUFFLE,
        drop_last=DROP_LAST, checkpoint_every=config.checkpoint.every_steps, eval_every=trainer_cfg.eval_every_steps,
        log_every=trainer_cfg.log_every_steps, max_nonfinite_losses=trainer_cfg.max_nonfinite_losses,
    )  # fmt: skip
    trainer = Trainer(
        model, optimizer_factory(config), train_set, eval_set=eval_set, env=env,
        precision=precision_from(config), parallel=parallel, compile=model_compiler(config),
        loading=loader_settings(config), device=device_settings(config), make_scheduler=scheduler_factory(config, epoch_steps),
        run_dir=run_dir or RunDir(config.trainer.run_dir, "trainer.run_dir"), report=reporting_from(config),
        checkpoints=dataclasses.replace(checkpoint_settings(config), run_dir=None, init_from=None),
        stop_signals=stop_signals, loop=loop, callbacks=callbacks,
    )  # fmt: skip
    _plan_resume(config, trainer)
    return trainer


def checked_model(config: RunConfig, parallel: Parallel) -> ModelBuild:
    """The model, seeded as training seeds it and built as the strategy builds it (FSDP2: on the meta
    device, unless checkpoint.init_from's weights are loaded into it whole); on a built-in data set,
    one tiny forward pass first (on the meta device for a meta build): a size or channel mismatch fails
    here, not at step 1. On a user's data set the inputs are unknown: it is only built."""
    model_cfg, data = config.model, config.data
    torch.manual_seed(config.trainer.seed)
    built = _built_from_weights(config, parallel)
    if is_import_path(data.name):
        return built
    classes = DATASET_CLASSES.get(data.name)
    if data.name == "imagefolder" and data.root is not None:
        classes = len(find_classes(Path(data_root(config)) / "train"))
    if classes is not None and model_cfg.num_classes < classes:
        raise ConfigError(
            f"model.num_classes={model_cfg.num_classes} is too small for data.name={data.name}, which has {classes} classes; "
            f"it must be >= {classes}"
        )
    _check_forward(config, built)
    return built


def _check_forward(config: RunConfig, built: ModelBuild) -> None:
    """One forward of two zero images (a meta build: a meta copy of it, on meta images), its output
    shape checked against model.num_classes."""
    model_cfg, data = config.model, config.data
    probe = built.module if built.init is None else copy.deepcopy(built.module).to("meta")
    shape = (2, data.channels, data.image_size, data.image_size)
    try:
        with torch.no_grad():
            outputs = probe.eval()(torch.zeros(shape, device="meta" if built.init is not None else "cpu"))
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = "its forward must take one image batch" if isinstance(error, TypeError) else "try a larger data.image_size"
        raise ConfigError(
            f"model.name={model_cfg.name} cannot take data.channels={data.channels} x data.image_size={data.image_size} images "
            f"({reason[:200]}); {hint}"
        ) from None
    built.module.train()
    if not isinstance(outputs, torch.Tensor) or tuple(outputs.shape) != (2, model_cfg.num_classes):
        found = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ConfigError(f"model.name={model_cfg.name} returns outputs of shape {found}, expected (batch, model.num_classes)")


def _built_from_weights(config: RunConfig, parallel: Parallel) -> ModelBuild:
    """The model as the strategy builds it, starting from checkpoint.init_from's weights: safetensors
    (renamed by model.key_map) checked now and read into a meta build's shards as they are made; any
    other checkpoint loaded into the model built whole."""
    init_from, key_map = config.checkpoint.init_from, config.model.key_map
    if key_map and (init_from is None or not is_safetensors_source(init_from)):
        raise ConfigError(
            "model.key_map renames the tensors of safetensors weights; set checkpoint.init_from to a *.safetensors file or folder"
        )
    try:
        source = SafetensorsWeights(init_from, key_map) if init_from is not None and is_safetensors_source(init_from) else init_from
        return built_model(lambda: build_model_from(config), parallel, source)
    except CheckpointError as error:
        raise CheckpointError(f"checkpoint.init_from: {error}") from None


def _plan_resume(config: RunConfig, trainer: Trainer) -> None:
    """The checkpoint the run continues from, read and checked against the parts that train."""
    try:
        trainer.plan_resume()
    except CheckpointError as error:
        if config.checkpoint.resume_from is None:
            raise
        raise CheckpointError(f"checkpoint.resume_from: {error}") from None
