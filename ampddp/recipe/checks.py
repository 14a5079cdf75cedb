"""Everything a recipe's run can be checked for without training, before anything is written.

``validate`` is the entry point; ``check_run_dir`` is its last check (the only one that touches
the filesystem).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ampddp.checkpoint import keys
from ampddp.checkpoint.restore import check_model_state, check_optimizer_state, check_sampler_state, initial_weights, restore_precision
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore, find_checkpoint, resume_candidates, resume_source
from ampddp.config import RunConfig, is_import_path
from ampddp.distributed.env import detect_env
from ampddp.errors import CheckpointError, ConfigError
from ampddp.observe.progress import Progress, finished
from ampddp.precision.engine import PrecisionEngine
from ampddp.preemption import parse_signals
from ampddp.prepare import engine_for
from ampddp.recipe.factories import (
    DROP_LAST,
    SHUFFLE,
    build_datasets_from,
    build_model_from,
    data_root,
    device_settings,
    loader_settings,
    model_compiler,
    optimizer_factory,
    parallel_from,
    precision_from,
    process_group_backend,
    refuse_kwargs,
    reporting_from,
    scheduler_factory,
    steps_per_epoch,
)
from ampddp.recipe.reading import check_config
from ampddp.rundir.paths import refuse_tilde_folder
from ampddp.training.resume import check_resume_settings, plan_schedule
from ampddp.training.resume.kept_precision import kept_precision
from ampddp.zoo.data import CIFAR_LAYOUT, IMAGEFOLDER_LAYOUT, find_classes

DATASET_CLASSES = {"digits": 10, "cifar10": 10}
IMAGE_OPTIONS = (
    ("crop", "random-resized", ("cifar10", "imagefolder")),
    ("auto_augment", "none", ("cifar10", "imagefolder")),
    ("normalize", None, ("cifar10", "imagefolder")),
    ("decode_device", "cpu", ("imagefolder",)),
)
"""(data key, its default, the data sets that use it): a non-default value elsewhere is refused."""
UNCATCHABLE_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name))
_PROBE = ".ampddp-write-probe-{pid}"
_PROBE_BYTES = 64 * 1024


@dataclass
class Built:
    """What ``validate`` built to check it, for training in the same process: a run is built once.

    ``datasets`` (train, eval) are built with the training augmentation, so an image folder is
    scanned and a CIFAR split loaded and measured once; None when no check needed them. ``model`` is
    built as training builds it (after ``torch.manual_seed(trainer.seed)``), and the checks only read
    it (a forward in eval mode without gradients, optimizers that never step), so it is the model
    training would build. Training builds whatever is None; spawned workers build their own."""

    datasets: tuple[Dataset, Dataset | None] | None = None
    model: nn.Module | None = None


class _Datasets:
    """The run's data sets, built on first use and then kept (several checks need the training set)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.built: tuple[Dataset, Dataset | None] | None = None

    def train_set(self) -> Dataset:
        if self.built is None:
            self.built = build_datasets_from(self.config, augment=self.config.data.augment)
        return self.built[0]


def _check_model(config: RunConfig) -> nn.Module:
    """Build the model and, on a built-in data set, run one tiny forward pass: a size or channel
    mismatch fails here, not at step 1. On a user's data set the inputs are unknown: it is only built."""
    model_cfg, data = config.model, config.data
    torch.manual_seed(config.trainer.seed)  # as training seeds it: this model is the one that trains
    model = build_model_from(config)
    if is_import_path(data.name):
        return model
    classes = DATASET_CLASSES.get(data.name)
    if data.name == "imagefolder" and data.root is not None:
        classes = len(find_classes(Path(data_root(config)) / "train"))
    if classes is not None and model_cfg.num_classes < classes:
        raise ConfigError(
            f"model.num_classes={model_cfg.num_classes} is too small for data.name={data.name}, which has {classes} classes; "
            f"it must be >= {classes}"
        )
    shape = (2, data.channels, data.image_size, data.image_size)
    try:
        with torch.no_grad():
            outputs = model.eval()(torch.zeros(shape))
    except (RuntimeError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = "its forward must take one image batch" if isinstance(error, TypeError) else "try a larger data.image_size"
        raise ConfigError(
            f"model.name={model_cfg.name} cannot take data.channels={data.channels} x data.image_size={data.image_size} images "
            f"({reason[:200]}); {hint}"
        ) from None
    model.train()
    if not isinstance(outputs, torch.Tensor) or tuple(outputs.shape) != (2, model_cfg.num_classes):
        found = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ConfigError(f"model.name={model_cfg.name} returns outputs of shape {found}, expected (batch, model.num_classes)")
    return model


def _check_data(config: RunConfig, datasets: _Datasets) -> None:
    """A user's data set is built; a built-in one's data.root is checked (and built only if a later
    check needs its size)."""
    data = config.data
    if is_import_path(data.name):
        _check_image_options(config)
        datasets.train_set()
        return
    refuse_kwargs("data", data.name, data.kwargs)
    _check_data_root(config)
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


def _check_data_root(config: RunConfig) -> None:
    data = config.data
    if data.name == "digits":
        return
    layout = CIFAR_LAYOUT if data.name == "cifar10" else IMAGEFOLDER_LAYOUT
    if data.root is None:
        raise ConfigError(f"data.name={data.name} needs data.root (ampddp never downloads data); expected layout: {layout}")
    root = Path(data_root(config))
    if not root.is_dir():
        raise ConfigError(f"data.root={data.root}: no such directory; {data.name} expects {layout}")
    if data.name == "cifar10" and not (root / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"data.root={data.root}: no cifar-10-batches-py folder inside; expected {CIFAR_LAYOUT} (ampddp never downloads)")
    for split in ("train", "val") if data.name == "imagefolder" else ():
        if not (root / split).is_dir():
            raise ConfigError(f"data.root={data.root}: missing {split}/ folder; expected {IMAGEFOLDER_LAYOUT}")
    if data.name == "imagefolder":
        find_classes(root / "train")


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


def _check_optimizer(config: RunConfig, model: nn.Module) -> None:
    try:
        optimizer_factory(config)(model.parameters())
    except (ValueError, TypeError, RuntimeError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"optimizer.name={config.optimizer.name}: {str(error).strip().splitlines()[0]}") from None


def _entry_error(where: str, shared: dict[str, Any], key: str, expected: str) -> CheckpointError:
    found = "missing" if key not in shared else f"a {type(shared[key]).__name__}"
    return CheckpointError(f"{where}: not a complete ampddp checkpoint: its {key!r} entry is {found}, expected {expected}")


def _peek(ref: CheckpointRef, name: str = keys.SHARED_FILE) -> dict[str, Any]:
    """One file of a checkpoint, verified against its manifest and memory-mapped (its tensor data is
    not read), as the trainer will load it; a CheckpointError names what is wrong."""
    return ref.load_file(name)


def _check_resumable(ref: CheckpointRef, config: RunConfig, model: nn.Module, engine: PrecisionEngine, rank: int) -> None:
    """Everything ``Trainer.load_checkpoint`` will read, read and checked now, against throwaway copies."""
    where = str(ref.shared_file)
    shared = _peek(ref)
    if shared.get(keys.FORMAT) != keys.FORMAT_VERSION:
        CheckpointStore.load_shared(ref)  # raises the unsupported-format error
    for key in (keys.MODEL, keys.OPTIMIZER, keys.PRECISION, keys.PROGRESS, keys.SAMPLER):
        if not isinstance(shared.get(key), dict):
            raise _entry_error(where, shared, key, "a dict")
    if isinstance(shared.get(keys.WORLD_SIZE), bool) or not isinstance(shared.get(keys.WORLD_SIZE), int):
        raise _entry_error(where, shared, keys.WORLD_SIZE, "an int")
    if shared.get(keys.SCHEDULER) is not None and not isinstance(shared[keys.SCHEDULER], dict):
        raise _entry_error(where, shared, keys.SCHEDULER, "a dict or None")
    check_model_state(shared[keys.MODEL], model, where)
    check_optimizer_state(shared[keys.OPTIMIZER], optimizer_factory(config)(model.parameters()), where)
    check_sampler_state(shared[keys.SAMPLER], {"seed": config.trainer.seed, "shuffle": SHUFFLE, "drop_last": DROP_LAST}, where)
    try:
        restore_precision(engine, shared[keys.PRECISION], where)
    except ConfigError as error:
        raise CheckpointError(f"{where}: its precision state does not fit precision.mode={config.precision.mode}: {error}") from None
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as error:
        raise CheckpointError(f"{where}: its {keys.PRECISION!r} entry is malformed ({type(error).__name__}: {error})") from None
    try:
        Progress().load_state_dict(shared[keys.PROGRESS])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: its {keys.PROGRESS!r} entry is malformed ({error})") from None
    rank_file = ref.rank_file(rank)
    if rank_file.is_file() and not isinstance(_peek(ref, rank_file.name).get(keys.RNG), dict):
        raise CheckpointError(f"{rank_file}: not a complete ampddp checkpoint: no {keys.RNG!r} state")


def _check_checkpoints(config: RunConfig, model: nn.Module, engine: PrecisionEngine, rank: int) -> None:
    """init_from, and a resume_from step folder, checked as the trainer will use them, before anything is written.

    A resume_from run dir and resume=auto choose among several checkpoints (skipping ones that do
    not verify): that choice, and its errors, stay with the trainer.
    """
    ckpt = config.checkpoint
    if ckpt.init_from is not None:
        try:
            check_model_state(initial_weights(ckpt.init_from), model, str(ckpt.init_from))
        except CheckpointError as error:
            raise CheckpointError(f"checkpoint.init_from: {error}") from None
    if ckpt.resume_from is not None:
        source = resume_source(ckpt.resume_from)
        if not source.path.exists():
            raise CheckpointError(f"checkpoint.resume_from={ckpt.resume_from}: no such checkpoint or run directory")
        if source.step is not None:
            try:
                _check_resumable(find_checkpoint(source.path), config, model, engine, rank)
            except CheckpointError as error:
                raise CheckpointError(f"checkpoint.resume_from: {error}") from None


def _write_probe(directory: Path) -> None:
    """Create, fill, fsync and remove a small file: a read-only or full filesystem fails here."""
    probe = directory / _PROBE.format(pid=os.getpid())
    descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(descriptor, b"\0" * _PROBE_BYTES)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
        probe.unlink(missing_ok=True)


def check_run_dir(run_dir: str) -> None:
    """``run_dir`` is (or can be created as) a writable directory with free space.

    Folders created for the check are removed again when it fails, so a refused run leaves nothing.
    """
    refuse_tilde_folder(run_dir, "trainer.run_dir")
    path = Path(run_dir)
    missing = []
    existing = path
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "a broken link" if existing.is_symlink() else "not a directory"
        where = "is" if existing == path else f"lies under {existing}, which is"
        raise ConfigError(f"trainer.run_dir={run_dir} {where} {kind}; give a directory (existing or to be created)")
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:  # another rank of this job made it a moment ago
                if not folder.is_dir():
                    raise
                continue
            created.append(folder)
        _write_probe(path)
    except OSError as error:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                break
        reason = error.strerror or str(error)
        raise ConfigError(f"trainer.run_dir={run_dir} is not writable ({reason}); give a writable directory with free space") from None


def validate(config: RunConfig) -> Built:
    """Everything that can be checked without training: raise before any work starts or anything is
    written. Returns what it built, for training in this process (``Built``).

    Values and ranges, precision settings, dotted function names, user functions named by import
    path, model and data shapes, data paths, the optimizer, LR schedule and DDP settings, stop
    signals, the torch.compile backend, checkpoints to start from, the device, and last the
    run_dir's writability (the only check that touches the filesystem).
    """
    check_config(config)
    loader_settings(config)
    device_settings(config)
    _check_schedule(config)
    parallel = parallel_from(config)
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=process_group_backend(config), timeout_s=dist_cfg.timeout_s)
    resume = config.checkpoint.resume_from or config.checkpoint.resume
    engine = engine_for(kept_precision(precision_from(config), config.trainer.run_dir, resume, env).resolved(env.device), parallel)
    datasets = _Datasets(config)
    _check_data(config, datasets)
    model = _check_model(config)
    _check_stop_signals(config.trainer.stop_signals)
    model_compiler(config)
    reporting_from(config)
    _check_optimizer(config, model)
    _check_checkpoints(config, model, engine, env.rank)
    launched = dist_cfg.nproc_per_node if env.launcher == "none" and dist_cfg.nproc_per_node > 1 else env.world_size
    refusal = parallel.plan.processes_refusal(launched)
    if refusal is not None:
        raise ConfigError(refusal)
    _check_epoch_schedule(config, launched, datasets)
    _check_resume_settings(config, model, launched, datasets)
    check_run_dir(config.trainer.run_dir)
    return Built(datasets.built, model)


def _check_epoch_schedule(config: RunConfig, world_size: int, datasets: _Datasets) -> None:
    """A warmup within a horizon given in epochs (the steps follow from the data set's size)."""
    if config.optimizer.warmup_steps == 0 or config.trainer.max_steps is not None:
        return  # no warmup, or checked against max_steps already
    scheduler_factory(config, steps_per_epoch(config, len(datasets.train_set()), world_size))


def _check_resume_settings(config: RunConfig, model: nn.Module, world_size: int, datasets: _Datasets) -> None:
    """The checkpoint this run will resume from (the newest complete one; the trainer verifies it
    and falls back past a bad one) against this run's settings: a run-defining change or a schedule
    that cannot be extended is refused now, before the run writes anything."""
    found = _resume_candidate(config)
    if found is None:
        return
    ref, shared = found
    check_resume_settings(shared.get(keys.CONFIG), config.to_dict(), str(ref.path))
    saved_optimizer, progress = shared.get(keys.OPTIMIZER), shared.get(keys.PROGRESS)
    if not isinstance(saved_optimizer, dict) or not isinstance(saved_optimizer.get("param_groups"), list) or not isinstance(progress, dict):
        return  # malformed: the trainer's verified load names what is wrong
    optimizer = optimizer_factory(config)(model.parameters())
    scheduler = scheduler_factory(config, steps_per_epoch(config, len(datasets.train_set()), world_size))(optimizer)
    saved = Progress()
    try:
        saved.load_state_dict(progress)
        if finished(saved, config.trainer.max_steps, config.trainer.max_epochs):
            return  # the trainer reports it complete and changes nothing
        applied = saved.global_step - saved.skipped_steps
        plan_schedule(optimizer, scheduler, saved_optimizer, shared.get(keys.SCHEDULER), applied, str(ref.path))
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return  # malformed state: the trainer's verified load names what is wrong


def _resume_candidate(config: RunConfig) -> tuple[CheckpointRef, dict[str, Any]] | None:
    """The newest complete checkpoint this run would resume from whose shared file reads, with its
    entries (memory-mapped). Ones that do not read are passed over here as the trainer passes over
    them (it verifies every file and reports them)."""
    ckpt = config.checkpoint
    candidates = resume_candidates(config.trainer.run_dir, ckpt.resume_from or ckpt.resume)
    for ref in candidates:
        try:
            return ref, _peek(ref)
        except CheckpointError:
            continue
    return None
