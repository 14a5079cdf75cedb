"""Typed run configuration: one dataclass per section, loaded from YAML plus dotted ``key=value``.

Every key is checked before any work starts: an unknown key names the closest valid one, a wrong
type names the expected type, a bad choice lists the valid ones. The classes that do the work get
plain arguments from here, never this object.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ampddp.distributed.wrap import STRATEGIES
from ampddp.errors import ConfigError, closest
from ampddp.precision.engine import IMPLS, PRECISION_MODES


def _choices(*values: str) -> dict[str, tuple[str, ...]]:
    return {"choices": values}


@dataclass
class PrecisionConfig:
    mode: str = field(default="O1", metadata=_choices(*PRECISION_MODES))
    """O0-O5 (apex opt levels) or native-fp16 / native-bf16 (torch.autocast + GradScaler)."""
    impl: str = field(default="builtin", metadata=_choices(*IMPLS))
    """builtin (ampddp on native torch) or apex (delegate to an installed apex.amp, O-levels only)."""
    cast_model_type: str | None = None
    patch_torch_functions: bool | None = None
    keep_batchnorm_fp32: bool | str | None = None
    master_weights: bool | None = None
    loss_scale: float | str | None = None
    """A fixed scale, or "dynamic"; None keeps the mode's default."""
    cast_model_outputs: str | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    init_loss_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    hysteresis: int | None = None
    verbosity: int | None = None
    float_functions: list[str] = field(default_factory=list)
    """Dotted names run in fp32 under O1/O4, e.g. torch.nn.functional.softplus (register_float_function)."""
    half_functions: list[str] = field(default_factory=list)
    promote_functions: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    name: str = "small_cnn"
    """A built-in (mlp, small_cnn) or any torchvision classification model (resnet18, ...)."""
    num_classes: int = 10


@dataclass
class DataConfig:
    name: str = field(default="digits", metadata=_choices("digits", "cifar10", "imagefolder"))
    """digits: scikit-learn's handwritten digits (no download); cifar10 / imagefolder: from data.root."""
    root: str | None = None
    """Directory of cifar10 (the extracted cifar-10-batches-py) or of an imagefolder (train/ and val/)."""
    image_size: int = 32
    channels: int = 3
    batch_size: int = 64
    """Per process."""
    augment: bool = True
    eval_fraction: float = 0.25
    """digits only: share held out for evaluation."""


@dataclass
class OptimizerConfig:
    name: str = field(default="sgd", metadata=_choices("sgd", "adamw"))
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    scheduler: str = field(default="cosine", metadata=_choices("none", "cosine", "step"))
    step_size: int = 30
    """step scheduler: epochs between decays."""
    gamma: float = 0.1


@dataclass
class TrainerConfig:
    max_epochs: int = 10
    max_steps: int | None = None
    seed: int = 0
    run_dir: str = "runs/default"
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    eval_every_steps: int | None = None
    """Also evaluate every K optimizer steps (always at each epoch's end)."""
    log_every_steps: int = 10
    progress: str = field(default="auto", metadata=_choices("auto", "bar", "lines", "off"))
    """auto: a bar on a terminal, periodic lines otherwise."""
    tensorboard: bool = False
    max_nonfinite_losses: int = 10
    """Consecutive non-finite losses after which training stops with an error."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make every rank finish its step, checkpoint, and exit with status 75."""


@dataclass
class CheckpointConfig:
    every_steps: int | None = None
    keep_last: int | None = 3
    resume: str = field(default="auto", metadata=_choices("auto", "never"))
    """auto: continue from the latest complete checkpoint in trainer.run_dir."""
    resume_from: str | None = None
    """A checkpoint folder or run dir to resume from instead (overrides resume)."""
    init_from: str | None = None
    """Weights to start from: an ampddp checkpoint, an apex-era dict or a plain state dict file."""


@dataclass
class DistributedConfig:
    strategy: str = field(default="ddp", metadata=_choices(*STRATEGIES))
    sync_bn: str = field(default="off", metadata=_choices("off", "auto", "torch", "apex", "portable"))
    nproc_per_node: int = 1
    """Spawn this many local processes when not already started by torchrun/SLURM."""
    backend: str = field(default="auto", metadata=_choices("auto", "nccl", "gloo"))
    device: str = field(default="auto", metadata=_choices("auto", "cuda", "cpu"))
    timeout_s: float = 600.0


@dataclass
class RunConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)}


def _allowed_types(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(arg for member in typing.get_args(annotation) for arg in _allowed_types(member))
    return (annotation,)


def _coerce(key: str, value: Any, annotation: Any, choices: tuple[str, ...] | None) -> Any:
    allowed = _allowed_types(annotation)
    if isinstance(value, bool) and choices and value is False and "off" in choices:
        value = "off"  # YAML reads a bare `off` as false
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, bool) and isinstance(value, kind):
            break
        if typing.get_origin(kind) is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    else:
        names = " or ".join(
            "null" if k is type(None) else "a list of strings" if typing.get_origin(k) is list else k.__name__ for k in allowed
        )
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {names}")
    if choices and value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid{closest(str(value), choices)}; valid choices: {', '.join(choices)}")
    return value


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {section}.{key}{closest(key, fields)}; valid keys in {section}: {', '.join(fields)}")
        kwargs[key] = _coerce(f"{section}.{key}", value, hints[key], fields[key].metadata.get("choices"))
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """``["precision.mode=O2", "trainer.max_steps=5"]`` -> nested dict (values parsed as YAML)."""
    nested: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r} is not of the form section.key=value (e.g. precision.mode=O2)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        nested.setdefault(section, {})[name] = value
    return nested


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a recipe (YAML) and apply overrides; raise ConfigError on the first bad key or value."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such recipe file")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a recipe is a mapping of sections (precision, model, data, ...), found {type(raw).__name__}")
    for section, values in parse_overrides(overrides or []).items():
        existing = raw.get(section)
        raw[section] = {**(existing if isinstance(existing, dict) else {}), **values}
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}{closest(str(section), SECTIONS)}; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"section {section!r} must be a mapping of keys, found {values!r}")
        sections[section] = _build(section, SECTIONS[section], values)
    return RunConfig(**sections)


def describe_keys() -> str:
    """Every key with its default, for ``ampddp train --help``."""
    lines = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            choices = f.metadata.get("choices")
            hint = f" {{{', '.join(choices)}}}" if choices else ""
            lines.append(f"  {section}.{f.name} = {default!r}{hint}")
    return "\n".join(lines)
