"""Recipe -> objects: the one place that maps a RunConfig's sections to the model, data sets,
optimizer, LR scheduler, op registrations, compile part and DDP settings of a run.

A model or data set may be a user's function named as ``package.module:function`` (recipes are
code: resolving one imports that module).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from ampddp.config import IMPORT_PATH_FORM, PrecisionConfig, RunConfig, is_import_path
from ampddp.distributed.env import HOST_AND_CUDA, seed_everything
from ampddp.distributed.fsdp2 import FSDPOptions
from ampddp.distributed.parallel import Parallel
from ampddp.distributed.pipeline import PPOptions
from ampddp.distributed.tensor_parallel import TPOptions
from ampddp.distributed.wrap import DDPOptions
from ampddp.errors import ConfigError, closest, spelled
from ampddp.observe.loggers import MlflowLogger, WandbLogger
from ampddp.observe.observer import Reporting
from ampddp.precision.casting import FP32, LOW, PROMOTE, OpRegistry
from ampddp.precision.choice import Precision
from ampddp.precision.modes import check_settings
from ampddp.recipe.schedule import LRSchedule, lr_scheduler
from ampddp.rundir.paths import expand_path
from ampddp.training.checkpoint_settings import CheckpointSettings
from ampddp.training.compile_model import ModelCompiler
from ampddp.training.device import DeviceSettings
from ampddp.training.loading import LoaderSettings
from ampddp.zoo.data import build_datasets
from ampddp.zoo.models import build_model

PRECISION_KEYS = frozenset(field.name for field in dataclasses.fields(PrecisionConfig))
"""The precision.* keys a recipe can set (of the settings a mode takes, these are the ones a recipe names)."""
REGISTRATION_KEYS = {"float_functions": FP32, "half_functions": LOW, "promote_functions": PROMOTE}
SHUFFLE, DROP_LAST = True, False
"""How ``train`` samples batches; a checkpoint to resume must have been written with the same."""
LAMB = "lamb"
"""optimizer.name for ``ampddp.apex.optimizers.FusedLAMB``; other names are torch.optim classes."""


def precision_overrides(config: RunConfig) -> dict[str, Any]:
    """The precision.* keys the user set, checked against what the chosen mode takes (the mode table's one check)."""
    precision = config.precision
    values = dataclasses.asdict(precision)
    set_keys = {k: v for k, v in values.items() if k not in ("mode", "impl", "fp32_islands", *REGISTRATION_KEYS) and v is not None}
    extras = [f"precision.{key}" for key in REGISTRATION_KEYS if getattr(precision, key)]
    extras += ["precision.fp32_islands"] if precision.fp32_islands is not None else []
    check_settings(precision.mode, set_keys, precision.impl, "precision.", extras, offered=PRECISION_KEYS)
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
    """precision.float_functions / half_functions / promote_functions as an OpRegistry."""
    registry = OpRegistry()
    for key, kind in REGISTRATION_KEYS.items():
        for dotted in getattr(config.precision, key):
            module, attribute = resolve_function(dotted, f"precision.{key}")
            registry.register(module, attribute, kind)
    return registry


def precision_from(config: RunConfig) -> Precision:
    """The precision section as the one object the trainer and ``prepare`` take."""
    precision = config.precision
    return Precision(
        precision.mode, precision.impl, precision_overrides(config), build_registry(config), fp32_islands=precision.fp32_islands
    )


def model_compiler(config: RunConfig) -> ModelCompiler | None:
    """trainer.compile / trainer.compile_backend as the trainer's compile part (None: eager); the
    backend is checked only when compiling (that check imports torch's compiler)."""
    return ModelCompiler.from_setting(config.trainer.compile, config.trainer.compile_backend, where="trainer.")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names (``key``: the setting, for messages)."""
    form = f"write it as {IMPORT_PATH_FORM}, e.g. mypkg.models:build"
    module_name, _, attribute = spec.partition(":")
    names = [*module_name.split("."), *attribute.split(".")]
    if not module_name or not attribute or not all(name.isidentifier() for name in names):
        raise ConfigError(f"{key}={spec!r} is not of the form {IMPORT_PATH_FORM}; {form}")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise ConfigError(f"{key}={spec!r}: no module named {error.name!r} (installed, or on PYTHONPATH?); {form}") from None
        raise ConfigError(f"{key}={spec!r}: importing {module_name} failed (ModuleNotFoundError: {_first_line(error)})") from None
    except Exception as error:  # the module itself failed while importing
        raise ConfigError(f"{key}={spec!r}: importing {module_name} failed ({type(error).__name__}: {_first_line(error)})") from None
    where = module_name
    for part in attribute.split("."):
        if not hasattr(target, part):
            hint = closest(part, [name for name in dir(target) if not name.startswith("_")])
            raise ConfigError(f"{key}={spec!r}: {where} has no attribute {part!r}{hint}; {form}")
        target, where = getattr(target, part), f"{where}.{part}"
    if not callable(target):
        raise ConfigError(f"{key}={spec!r} names a {type(target).__name__}, which is not callable; {form}")
    return target


def _call(key: str, spec: str, function: Callable[..., Any], **kwargs: Any) -> Any:
    """``function(**kwargs)``; a TypeError or ValueError (bad arguments) becomes a ConfigError naming the call."""
    try:
        return function(**kwargs)
    except (TypeError, ValueError) as error:
        arguments = ", ".join(f"{name}={value!r}" for name, value in kwargs.items())
        raise ConfigError(f"{key}={spec!r}: calling it with ({arguments}) failed ({type(error).__name__}: {_first_line(error)})") from error


def refuse_kwargs(section: str, name: str, kwargs: dict[str, Any]) -> None:
    """``section.kwargs`` are for a user's function: refused with a built-in ``section.name``."""
    if kwargs and not is_import_path(name):
        raise ConfigError(
            f"{section}.kwargs={kwargs!r} applies to a {'data set' if section == 'data' else section} named as {IMPORT_PATH_FORM}, "
            f"not to {section}.name={name}; "
            f"remove {section}.kwargs"
        )


def build_model_from(config: RunConfig) -> nn.Module:
    """model.name: a built-in or torchvision model, or a user's function called with
    ``num_classes=model.num_classes`` and ``model.kwargs``."""
    model_cfg, data = config.model, config.data
    refuse_kwargs("model", model_cfg.name, model_cfg.kwargs)
    if not is_import_path(model_cfg.name):
        return build_model(model_cfg.name, model_cfg.num_classes, data.channels, data.image_size)
    if "num_classes" in model_cfg.kwargs:
        raise ConfigError("model.kwargs sets num_classes; set model.num_classes instead (it is passed to the function)")
    build = load_callable(model_cfg.name, "model.name")
    model = _call("model.name", model_cfg.name, build, num_classes=model_cfg.num_classes, **model_cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name={model_cfg.name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_datasets_from(config: RunConfig, augment: bool) -> tuple[Dataset, Dataset | None]:
    """data.name: a built-in data set (``augment``: its training augmentation), or a user's function
    called with ``data.kwargs`` that returns ``(train_set, eval_set or None)``, map-style data sets.
    The user's function runs with python, numpy and torch seeded from ``trainer.seed``, so a split it
    draws at random is the same on every rank and on every resume."""
    data = config.data
    refuse_kwargs("data", data.name, data.kwargs)
    if not is_import_path(data.name):
        return build_datasets(
            data.name, data_root(config), data.image_size, data.channels, data.eval_fraction, config.trainer.seed, augment,
            auto_augment=data.auto_augment, normalize=data.normalize, decode_device=data.decode_device, crop=data.crop,
        )  # fmt: skip
    seed_everything(config.trainer.seed)
    result = _call("data.name", data.name, load_callable(data.name, "data.name"), **data.kwargs)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        found = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise ConfigError(f"data.name={data.name!r} returned {found}, expected a pair (train_set, eval_set or None)")
    train_set, eval_set = result
    for role, dataset in (("train_set", train_set), ("eval_set", eval_set)):
        if role == "eval_set" and dataset is None:
            continue
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(
                f"data.name={data.name!r}: its {role} is a {type(dataset).__name__}, not a map-style data set (__len__ and __getitem__)"
            )
    if len(train_set) == 0:
        raise ConfigError(f"data.name={data.name!r}: its train_set is empty")
    return train_set, eval_set


def optimizer_class(name: str) -> type[Optimizer]:
    """optimizer.name as a class: ``lamb`` (FusedLAMB) or a torch.optim class, case-insensitive
    (sgd, adam, adamw, RMSprop, torch.optim.NAdam, ...)."""
    if name.lower() == LAMB:
        from ampddp.apex.optimizers import FusedLAMB

        return FusedLAMB
    classes = {
        attribute: value
        for attribute, value in vars(torch.optim).items()
        if isinstance(value, type) and issubclass(value, Optimizer) and value is not Optimizer
    }
    by_lower = {attribute.lower(): value for attribute, value in classes.items()}
    short = name.removeprefix("torch.optim.").lower()
    if short in by_lower:
        return by_lower[short]
    spellings = {spelling.lower(): spelling for spelling in ("sgd", "adam", "adamw", LAMB, *classes)}
    near = difflib.get_close_matches(short, spellings, n=1, cutoff=0.5)
    hint = f" (did you mean {spellings[near[0]]!r}?)" if near else ""
    raise ConfigError(
        f"optimizer.name={name!r} is not valid{hint}; valid: sgd, adam, adamw, lamb, or a torch.optim class ({', '.join(sorted(classes))})"
    )


def optimizer_factory(config: RunConfig) -> Callable[[Iterable[nn.Parameter]], Optimizer]:
    """``make_optimizer(params)`` for the optimizer section: lr always, momentum for SGD, weight_decay
    where the class takes one, the fused / foreach flags when set, then optimizer.kwargs."""
    opt = config.optimizer
    cls = optimizer_class(opt.name)
    accepted = inspect.signature(cls).parameters
    settings: dict[str, Any] = {"lr": opt.lr}
    if issubclass(cls, torch.optim.SGD):
        settings["momentum"] = opt.momentum
    if "weight_decay" in accepted:
        settings["weight_decay"] = opt.weight_decay
    for flag in ("fused", "foreach"):
        value = getattr(opt, flag)
        if value is not None and flag not in accepted:
            raise ConfigError(f"optimizer.{flag}={spelled(value)}: {cls.__name__} has no {flag} flag; leave optimizer.{flag} unset (null)")
        if value is not None:
            settings[flag] = value
    owned = {"lr", "weight_decay", "fused", "foreach", *settings}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for key in opt.kwargs:
        if key == "params":
            raise ConfigError("optimizer.kwargs sets params; the model's parameters are passed")
        if key in owned:
            raise ConfigError(f"optimizer.kwargs sets {key}; set optimizer.{key} instead")
        if key not in accepted and not takes_any:
            valid = [name for name in accepted if name not in ("params", *owned)]
            raise ConfigError(
                f"optimizer.kwargs.{key} is not an argument of {cls.__name__}{closest(key, valid)}; valid: {', '.join(valid)}"
            )
    return _optimizer_maker(opt.name, functools.partial(cls, **settings, **opt.kwargs))


def _optimizer_maker(name: str, make: Callable[..., Optimizer]) -> Callable[[Iterable[nn.Parameter]], Optimizer]:
    """``make(params)``, where the optimizer class's refusal of its settings (``fused`` with
    ``foreach``, a fused kernel on the wrong device) is one line naming optimizer.name."""

    def make_optimizer(params: Iterable[nn.Parameter]) -> Optimizer:
        try:
            return make(params)
        except ConfigError:
            raise
        except (ValueError, TypeError, RuntimeError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"optimizer.name={name}: {reason}") from None

    return make_optimizer


def steps_per_epoch(config: RunConfig, train_samples: int, data_ranks: int) -> int:
    """Optimizer steps in one epoch of ``train_samples`` read by ``data_ranks`` data-parallel ranks."""
    return max(1, math.ceil(train_samples / (config.data.batch_size * data_ranks * config.trainer.grad_accum_steps)))


def scheduler_factory(config: RunConfig, epoch_steps: int) -> Callable[[Optimizer], LRScheduler | None]:
    """``make_scheduler(optimizer)`` for optimizer.scheduler / warmup_* / step_size (epochs) / gamma."""
    opt = config.optimizer
    schedule = LRSchedule(
        opt.scheduler, config.trainer.max_steps or config.trainer.max_epochs * epoch_steps, opt.warmup_steps,
        opt.warmup_start_factor, opt.step_size * epoch_steps, opt.gamma,
    )  # fmt: skip
    return functools.partial(lr_scheduler, schedule=schedule)


def ddp_options(config: RunConfig) -> DDPOptions:
    """distributed.find_unused_parameters / static_graph / gradient_as_bucket_view / bucket_cap_mb / comm_hook."""
    dist_cfg = config.distributed
    return DDPOptions(
        find_unused_parameters=dist_cfg.find_unused_parameters, static_graph=dist_cfg.static_graph,
        gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view, bucket_cap_mb=dist_cfg.bucket_cap_mb, comm_hook=dist_cfg.comm_hook,
    )  # fmt: skip


def process_group_backend(config: RunConfig) -> str:
    """distributed.backend, where ``auto`` with FSDP2's CPU offload asks for gloo beside NCCL: the
    offloaded shards are host tensors, and the collectives on them need a host backend."""
    dist_cfg = config.distributed
    return HOST_AND_CUDA if dist_cfg.backend == "auto" and dist_cfg.fsdp_cpu_offload else dist_cfg.backend


def fsdp_options(config: RunConfig) -> FSDPOptions:
    """distributed.fsdp_blocks / fsdp_reshard_after_forward / fsdp_reduce_in_fp32 / fsdp_activation_checkpointing /
    fsdp_cpu_offload / fsdp_shard_size / fsdp_build_on_meta."""
    dist_cfg = config.distributed
    return FSDPOptions(
        blocks=tuple(dist_cfg.fsdp_blocks), reshard_after_forward=dist_cfg.fsdp_reshard_after_forward,
        reduce_in_fp32=dist_cfg.fsdp_reduce_in_fp32, activation_checkpointing=dist_cfg.fsdp_activation_checkpointing,
        cpu_offload=dist_cfg.fsdp_cpu_offload, shard_size=dist_cfg.fsdp_shard_size, build_on_meta=dist_cfg.fsdp_build_on_meta,
    )  # fmt: skip


def tp_options(config: RunConfig) -> TPOptions:
    """distributed.tp_size / tp_plan (a table, or a package.module:function, imported here) / sequence_parallel /
    loss_parallel."""
    dist_cfg = config.distributed
    plan = dist_cfg.tp_plan
    if isinstance(plan, str):
        if not is_import_path(plan):
            raise ConfigError(f"distributed.tp_plan={plan!r} is not valid; give a table "
                              "{module name: colwise | rowwise | sequence | vocab | replicate}, "
                              f"a {IMPORT_PATH_FORM} that parallelizes the model, or null (the model's own plan)")  # fmt: skip
        plan = load_callable(plan, "distributed.tp_plan")
    try:
        return TPOptions(
            size=dist_cfg.tp_size, plan=plan, sequence_parallel=dist_cfg.sequence_parallel, loss_parallel=dist_cfg.loss_parallel
        )
    except ConfigError as error:
        raise ConfigError(f"distributed.{error}") from None


def pp_options(config: RunConfig) -> PPOptions:
    """distributed.pp_size / pp_schedule / pp_microbatches / pp_split (a package.module:function, imported here) /
    pp_stages_per_rank."""
    dist_cfg = config.distributed
    split = dist_cfg.pp_split
    if isinstance(split, str):
        if not is_import_path(split):
            raise ConfigError(f"distributed.pp_split={split!r} is not valid; give the module names of each stage (a list per "
                              f"stage), a {IMPORT_PATH_FORM} (model, stage, stages) that returns the stage's module, or null "
                              "(the model's own pipeline_stage)")  # fmt: skip
        split = load_callable(split, "distributed.pp_split")
    try:
        return PPOptions(size=dist_cfg.pp_size, schedule=dist_cfg.pp_schedule, microbatches=dist_cfg.pp_microbatches, split=split,
                         stages_per_rank=dist_cfg.pp_stages_per_rank)  # fmt: skip
    except ConfigError as error:
        raise ConfigError(f"distributed.{error}") from None


def parallel_from(config: RunConfig) -> Parallel:
    """The distributed section's strategy, sync-BN, torch DDP, FSDP2, tensor- and pipeline-parallel settings as one object (a
    setting with a strategy that does not take it is refused naming the recipe key)."""
    dist_cfg = config.distributed
    return Parallel(strategy=dist_cfg.strategy, sync_bn=dist_cfg.sync_bn, ddp=ddp_options(config), fsdp=fsdp_options(config),
                    tp=tp_options(config), pp=pp_options(config), where="distributed.")  # fmt: skip


def loader_settings(config: RunConfig) -> LoaderSettings:
    """data.num_workers / pin_memory / persistent_workers / prefetch_factor (checked together); batches
    decoded on the GPU (data.decode_device=cuda) are not pinned."""
    data = config.data
    pin_memory = False if data.decode_device == "cuda" and data.pin_memory is None else data.pin_memory
    return LoaderSettings(data.num_workers, pin_memory, data.persistent_workers, data.prefetch_factor)


def device_settings(config: RunConfig) -> DeviceSettings:
    """trainer.channels_last / cudnn_benchmark / allow_tf32."""
    trainer = config.trainer
    return DeviceSettings(trainer.channels_last, trainer.cudnn_benchmark, trainer.allow_tf32)


def checkpoint_settings(config: RunConfig) -> CheckpointSettings:
    """trainer.run_dir and the checkpoint section (keep_last, resume / resume_from, init_from); the whole
    recipe rides along, saved with every checkpoint and compared on resume."""
    checkpoint = config.checkpoint
    return CheckpointSettings(
        run_dir=config.trainer.run_dir, keep_last=checkpoint.keep_last, resume=checkpoint.resume_from or checkpoint.resume,
        init_from=checkpoint.init_from, config=config.to_dict(), layout=checkpoint.layout,
    )  # fmt: skip


def reporting_from(config: RunConfig) -> Reporting:
    """trainer.progress and the observe section (trainer.tensorboard=true lists tensorboard too)."""
    observe = config.observe
    names = [*observe.loggers, *(["tensorboard"] if config.trainer.tensorboard and "tensorboard" not in observe.loggers else [])]
    configured = {
        "wandb": lambda: WandbLogger(project=observe.wandb_project, entity=observe.wandb_entity, mode=observe.wandb_mode),
        "mlflow": lambda: MlflowLogger(tracking_uri=observe.mlflow_tracking_uri, experiment=observe.mlflow_experiment),
    }
    loggers = tuple(configured[name]() if name in configured else name for name in names)
    return Reporting(progress=config.trainer.progress, loggers=loggers, plots=observe.plots)


def data_root(config: RunConfig) -> str | None:
    """data.root with ``~`` and ``$VARS`` expanded now (the config keeps it as written; see DataConfig.root)."""
    root = config.data.root
    return None if root is None else expand_path(root, "data.root")
