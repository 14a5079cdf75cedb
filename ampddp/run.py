"""Assemble a training run from a RunConfig: the one place that maps config sections to objects."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampddp.checkpoint import keys
from ampddp.checkpoint.changes import check_resume_settings
from ampddp.checkpoint.files import load_safely
from ampddp.checkpoint.restore import check_model_state, check_optimizer_state, check_sampler_state, initial_weights, restore_precision
from ampddp.checkpoint.schedule_plan import plan_schedule
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore, find_checkpoint
from ampddp.compile_model import ModelCompiler
from ampddp.config import RunConfig, check_config
from ampddp.console import rank_console
from ampddp.data import CIFAR_LAYOUT, IMAGEFOLDER_LAYOUT, build_datasets
from ampddp.distributed.env import DistEnv, detect_env, setup_distributed, shutdown_distributed
from ampddp.distributed.launch import launch_local
from ampddp.distributed.watch import PeerWatch
from ampddp.errors import CheckpointError, ConfigError
from ampddp.models import build_model
from ampddp.observe import RunObserver
from ampddp.precision.engine import NATIVE_MODES, PrecisionEngine
from ampddp.precision.factory import build_engine
from ampddp.precision.registry import FP32, LOW, PROMOTE, OpRegistry
from ampddp.preemption import EarlySignals, StopSignals, parse_signals
from ampddp.progress import Progress, finished
from ampddp.run_lock import RunDirLock
from ampddp.trainer import Trainer

NATIVE_KEYS = ("loss_scale", "init_loss_scale", "growth_factor", "backoff_factor", "growth_interval")
REGISTRATION_KEYS = {"float_functions": FP32, "half_functions": LOW, "promote_functions": PROMOTE}
DATASET_CLASSES = {"digits": 10, "cifar10": 10}
SHUFFLE, DROP_LAST = True, False
"""How ``train`` samples batches; a checkpoint to resume must have been written with the same."""
UNCATCHABLE_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name))
_PROBE = ".ampddp-write-probe-{pid}"
_PROBE_BYTES = 64 * 1024


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


def resolve_function(dotted: str, key: str = "a function name") -> tuple[Any, str]:
    """'torch.nn.functional.softplus' -> (torch.nn.functional, 'softplus'); the name must be a callable.

    The longest importable prefix is imported (recipes are code: this runs that module's import),
    the rest is looked up attribute by attribute, so 'torch.Tensor.add' works too.
    """
    example = "write it as module.function, e.g. torch.nn.functional.softplus"
    parts = dotted.split(".") if isinstance(dotted, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise ConfigError(f"{key} entry {dotted!r} is not a dotted name of a function; {example}")
    owner: Any = None
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        except Exception as error:  # the module itself failed while importing
            raise ConfigError(f"{key} entry {dotted!r}: importing {module_name} failed ({type(error).__name__}: {error})") from None
        for part in parts[split:-1]:
            if not hasattr(owner, part):
                raise ConfigError(f"cannot resolve {dotted!r} in {key}: {module_name} has no attribute {part!r}")
            owner, module_name = getattr(owner, part), f"{module_name}.{part}"
        break
    else:
        raise ConfigError(f"cannot resolve {dotted!r} in {key}: no module {parts[0]!r}; {example}")
    attribute = parts[-1]
    if not hasattr(owner, attribute):
        raise ConfigError(f"cannot resolve {dotted!r} in {key}: {module_name} has no attribute {attribute!r}")
    target = getattr(owner, attribute)
    if not callable(target):
        raise ConfigError(f"{key} entry {dotted!r} is a {type(target).__name__}, not a function; {example}")
    return owner, attribute


def build_registry(config: RunConfig) -> OpRegistry:
    registry = OpRegistry()
    for key, kind in REGISTRATION_KEYS.items():
        for dotted in getattr(config.precision, key):
            module, attribute = resolve_function(dotted, f"precision.{key}")
            registry.register(module, attribute, kind)
    return registry


def _check_model(config: RunConfig) -> nn.Module:
    """Build the model and run one tiny forward pass: a size or channel mismatch fails here, not at step 1."""
    model_cfg, data = config.model, config.data
    model = build_model(model_cfg.name, model_cfg.num_classes, data.channels, data.image_size)
    classes = DATASET_CLASSES.get(data.name)
    if data.name == "imagefolder" and data.root is not None and (Path(data.root) / "train").is_dir():
        classes = sum(1 for entry in (Path(data.root) / "train").iterdir() if entry.is_dir()) or None
    if classes is not None and model_cfg.num_classes < classes:
        raise ConfigError(
            f"model.num_classes={model_cfg.num_classes} is too small for data.name={data.name}, which has {classes} classes; "
            f"it must be >= {classes}"
        )
    shape = (2, data.channels, data.image_size, data.image_size)
    try:
        with torch.no_grad():
            outputs = model.eval()(torch.zeros(shape))
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"model.name={model_cfg.name} cannot take data.channels={data.channels} x data.image_size={data.image_size} images "
            f"({reason[:200]}); try a larger data.image_size"
        ) from None
    model.train()
    if not isinstance(outputs, torch.Tensor) or tuple(outputs.shape) != (2, model_cfg.num_classes):
        found = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ConfigError(f"model.name={model_cfg.name} returns outputs of shape {found}, expected (batch, model.num_classes)")
    return model


def _check_data_root(config: RunConfig) -> None:
    data = config.data
    if data.name == "digits":
        return
    layout = CIFAR_LAYOUT if data.name == "cifar10" else IMAGEFOLDER_LAYOUT
    if data.root is None:
        raise ConfigError(f"data.name={data.name} needs data.root (ampddp never downloads data); expected layout: {layout}")
    root = Path(data.root)
    if not root.is_dir():
        raise ConfigError(f"data.root={data.root}: no such directory; {data.name} expects {layout}")
    if data.name == "cifar10" and not (root / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"data.root={data.root}: no cifar-10-batches-py folder inside; expected {CIFAR_LAYOUT} (ampddp never downloads)")
    for split in ("train", "val") if data.name == "imagefolder" else ():
        if not (root / split).is_dir():
            raise ConfigError(f"data.root={data.root}: missing {split}/ folder; expected {IMAGEFOLDER_LAYOUT}")


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


def model_compiler(config: RunConfig) -> ModelCompiler | None:
    """trainer.compile / trainer.compile_backend as the trainer's compile part (None: eager); the
    backend is checked only when compiling (that check imports torch's compiler)."""
    return ModelCompiler.from_setting(config.trainer.compile, config.trainer.compile_backend, where="trainer.")


def _entry_error(where: str, shared: dict[str, Any], key: str, expected: str) -> CheckpointError:
    found = "missing" if key not in shared else f"a {type(shared[key]).__name__}"
    return CheckpointError(f"{where}: not a complete ampddp checkpoint: its {key!r} entry is {found}, expected {expected}")


def _peek(path: Path) -> dict[str, Any]:
    """A checkpoint file's structure without reading its tensor data (memory-mapped); a file that
    does not load that way goes through ``load_safely``, whose error names what is wrong."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # any failure: load_safely raises the CheckpointError that explains it
        state = None
    return state if isinstance(state, dict) else load_safely(path)


def _check_resumable(ref: CheckpointRef, config: RunConfig, model: nn.Module, engine: PrecisionEngine, rank: int) -> None:
    """Everything ``Trainer.load_checkpoint`` will read, read and checked now, against throwaway copies."""
    where = str(ref.shared_file)
    shared = _peek(ref.shared_file)
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
    check_optimizer_state(shared[keys.OPTIMIZER], _optimizer_factory(config)(model.parameters()), where)
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
    if rank_file.is_file() and not isinstance(_peek(rank_file).get(keys.RNG), dict):
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
        path = Path(ckpt.resume_from)
        folder = path.parent if path.is_file() else path
        if not folder.exists():
            raise CheckpointError(f"checkpoint.resume_from={ckpt.resume_from}: no such checkpoint or run directory")
        if folder.name.startswith(keys.STEP_DIR_PREFIX):
            try:
                _check_resumable(find_checkpoint(folder), config, model, engine, rank)
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


def validate(config: RunConfig) -> None:
    """Everything that can be checked without training: raise before any work starts or anything is written.

    Values and ranges, precision settings, dotted function names, model and data shapes, data
    paths, stop signals, the torch.compile backend, checkpoints to start from, the device, and
    last the run_dir's writability (the only check that touches the filesystem).
    """
    check_config(config)
    engine = build_engine(config.precision.mode, impl=config.precision.impl, **precision_overrides(config))
    build_registry(config)
    _check_data_root(config)
    model = _check_model(config)
    _check_stop_signals(config.trainer.stop_signals)
    model_compiler(config)
    if config.trainer.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ConfigError("trainer.tensorboard=true needs the tensorboard package: pip install 'ampddp[tensorboard]'") from None
    try:
        _optimizer_factory(config)(model.parameters())
    except ValueError as error:
        raise ConfigError(f"optimizer.name={config.optimizer.name}: {error}") from None
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=dist_cfg.backend, timeout_s=dist_cfg.timeout_s)
    _check_checkpoints(config, model, engine, env.rank)
    launched = dist_cfg.nproc_per_node if env.launcher == "none" and dist_cfg.nproc_per_node > 1 else env.world_size
    _check_resume_settings(config, model, launched)
    check_run_dir(config.trainer.run_dir)


def _steps_per_epoch(config: RunConfig, train_samples: int, world_size: int) -> int:
    return max(1, math.ceil(train_samples / (config.data.batch_size * world_size * config.trainer.grad_accum_steps)))


def _check_resume_settings(config: RunConfig, model: nn.Module, world_size: int) -> None:
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
    data = config.data
    train_set, _ = build_datasets(data.name, data.root, data.image_size, data.channels, data.eval_fraction, config.trainer.seed, False)
    optimizer = _optimizer_factory(config)(model.parameters())
    make_scheduler = _scheduler_factory(config, _steps_per_epoch(config, len(train_set), world_size))
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
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
    if ckpt.resume_from is not None:
        path = Path(ckpt.resume_from)
        folder = path.parent if path.is_file() else path
        if folder.name.startswith(keys.STEP_DIR_PREFIX):
            candidates = [find_checkpoint(folder)]
        else:
            run_dir = folder.parent if folder.name == keys.CHECKPOINTS_DIR else folder
            candidates = CheckpointStore(run_dir, keep_last=None).complete()[::-1]
    elif ckpt.resume == "auto":
        candidates = CheckpointStore(config.trainer.run_dir, keep_last=None).complete()[::-1]
    else:
        return None
    for ref in candidates:
        try:
            return ref, _peek(ref.shared_file)
        except CheckpointError:
            continue
    return None


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


def train(config: RunConfig, env: DistEnv, early: EarlySignals | None = None) -> dict[str, Any]:
    """Run training in this process (one rank of ``env``); returns the summary.

    Stop signals are caught from the start, so one that arrives while data and model are being set
    up still ends in a checkpoint, and one that arrives after training lets the run finish normally.
    ``early``: the command line's catcher, whose signals (and one already received) this run takes over.
    """
    with StopSignals(config.trainer.stop_signals, early=early) as stop:
        return _train(config, env, stop)


def _train(config: RunConfig, env: DistEnv, stop: StopSignals) -> dict[str, Any]:
    with rank_console(env):
        return _build_and_fit(config, env, stop)


def _build_and_fit(config: RunConfig, env: DistEnv, stop: StopSignals) -> dict[str, Any]:
    data, trainer_cfg = config.data, config.trainer
    train_set, eval_set = build_datasets(
        data.name, data.root, data.image_size, data.channels, data.eval_fraction, trainer_cfg.seed, data.augment
    )
    torch.manual_seed(trainer_cfg.seed)
    model = build_model(config.model.name, config.model.num_classes, data.channels, data.image_size)
    steps_per_epoch = _steps_per_epoch(config, len(train_set), env.world_size)
    observer = RunObserver(
        trainer_cfg.run_dir, env, progress=trainer_cfg.progress,
        tensorboard=trainer_cfg.tensorboard, total_steps=trainer_cfg.max_steps or trainer_cfg.max_epochs * steps_per_epoch,
    )  # fmt: skip
    trainer = Trainer(
        model, _optimizer_factory(config), train_set, eval_set=eval_set, env=env,
        precision=config.precision.mode, impl=config.precision.impl, precision_overrides=precision_overrides(config),
        registry=build_registry(config), sync_bn=config.distributed.sync_bn, strategy=config.distributed.strategy,
        compile=model_compiler(config),
        batch_size=data.batch_size, grad_accum_steps=trainer_cfg.grad_accum_steps, clip_grad_norm=trainer_cfg.clip_grad_norm,
        make_scheduler=_scheduler_factory(config, steps_per_epoch), max_epochs=trainer_cfg.max_epochs, max_steps=trainer_cfg.max_steps,
        seed=trainer_cfg.seed, shuffle=SHUFFLE, drop_last=DROP_LAST, run_dir=trainer_cfg.run_dir,
        checkpoint_every=config.checkpoint.every_steps,
        keep_last=config.checkpoint.keep_last, resume=config.checkpoint.resume_from or config.checkpoint.resume,
        init_from=config.checkpoint.init_from, config=config.to_dict(), eval_every=trainer_cfg.eval_every_steps,
        log_every=trainer_cfg.log_every_steps, max_nonfinite_losses=trainer_cfg.max_nonfinite_losses, observer=observer,
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

    The main process (rank 0, or the parent of spawned workers) holds the run_dir lock throughout.
    """
    validate(config)
    dist_cfg = config.distributed
    env = detect_env(device=dist_cfg.device, backend=dist_cfg.backend, timeout_s=dist_cfg.timeout_s)
    with RunDirLock(config.trainer.run_dir) if env.is_main else contextlib.nullcontext():  # one writer per run_dir
        if dist_cfg.nproc_per_node > 1 and env.launcher == "none":
            with StopSignals(config.trainer.stop_signals, early=early) as stop:
                results = launch_local(
                    _spawned, dist_cfg.nproc_per_node, (config,), device=dist_cfg.device, backend=dist_cfg.backend,
                    timeout_s=dist_cfg.timeout_s, forward_signals=stop,
                )  # fmt: skip
            return results[0]
        env = setup_distributed(device=dist_cfg.device, backend=dist_cfg.backend, timeout_s=dist_cfg.timeout_s)
        try:
            return train(config, env, early)
        finally:
            shutdown_distributed()
