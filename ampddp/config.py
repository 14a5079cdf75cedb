"""Typed run configuration: one dataclass per section, loaded from YAML plus dotted ``key=value``.

Every key is checked before any work starts: an unknown key names the closest valid one, a wrong
type names the expected type, a bad choice lists the valid ones. The classes that do the work get
plain arguments from here, never this object.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ampddp.compile_model import COMPILE_CHOICES, DEFAULT_BACKEND
from ampddp.data import AUTO_AUGMENTS, DECODE_DEVICES, NORMALIZATIONS
from ampddp.distributed.sync_bn import SYNC_BN_CHOICES
from ampddp.distributed.wrap import COMM_HOOKS, STRATEGIES
from ampddp.errors import ConfigError, choice_error, closest, spelled
from ampddp.precision.engine import IMPLS, PRECISION_MODES

IMPORT_PATH_FORM = "package.module:function"
"""How a recipe names a user's function: the module to import, a colon, the callable in it."""


def _choices(*values: str | bool, import_path: bool = False) -> dict[str, Any]:
    """Metadata: the valid values; ``import_path``: a ``package.module:function`` is valid too."""
    return {"choices": values, "import_path": import_path}


def is_import_path(value: object) -> bool:
    """A setting that names a user's function (``package.module:function``) rather than a built-in."""
    return isinstance(value, str) and ":" in value


@dataclass(frozen=True)
class Bounds:
    """The range a number must lie in; ``low_open`` / ``high_open`` exclude the end point."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        def number(x: float | None) -> str:
            return str(int(x)) if x is not None and float(x).is_integer() else f"{x:g}"

        if self.high is None:
            return f"{'>' if self.low_open else '>='} {number(self.low)}"
        return f"in {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}{')' if self.high_open else ']'}"


def _at_least(low: float) -> dict[str, Bounds]:
    return {"bounds": Bounds(low)}


def _above(low: float) -> dict[str, Bounds]:
    return {"bounds": Bounds(low, low_open=True)}


def _between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> dict[str, Bounds]:
    return {"bounds": Bounds(low, high, low_open, high_open)}


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
    loss_scale: float | str | None = field(default=None, metadata=_above(0))
    """A fixed scale, or "dynamic"; None keeps the mode's default."""
    cast_model_outputs: str | None = None
    min_loss_scale: float | None = field(default=None, metadata=_above(0))
    max_loss_scale: float | None = field(default=None, metadata=_above(0))
    init_loss_scale: float | None = field(default=None, metadata=_above(0))
    growth_factor: float | None = field(default=None, metadata=_above(1))
    backoff_factor: float | None = field(default=None, metadata=_between(0, 1, low_open=True, high_open=True))
    growth_interval: int | None = field(default=None, metadata=_at_least(1))
    hysteresis: int | None = field(default=None, metadata=_at_least(1))
    verbosity: int | None = field(default=None, metadata=_at_least(0))
    float_functions: list[str] = field(default_factory=list)
    """Dotted names run in fp32 under O1/O4, e.g. torch.nn.functional.softplus (register_float_function)."""
    half_functions: list[str] = field(default_factory=list)
    promote_functions: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    name: str = "small_cnn"
    """A built-in (mlp, small_cnn), any torchvision classification model (resnet18, ...), or a user's
    function as package.module:function, called with num_classes= and model.kwargs, returning an nn.Module."""
    num_classes: int = field(default=10, metadata=_at_least(1))
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a model named as package.module:function."""


@dataclass
class DataConfig:
    name: str = field(default="digits", metadata=_choices("digits", "cifar10", "imagefolder", import_path=True))
    """digits: scikit-learn's handwritten digits (no download); cifar10 / imagefolder: from data.root; or a
    user's function as package.module:function, called with data.kwargs, returning (train_set, eval_set or None).
    root, image_size, channels, augment and eval_fraction apply to the built-in datasets; auto_augment and
    normalize to cifar10 and imagefolder; decode_device to imagefolder."""
    root: str | None = None
    """Directory of cifar10 (the extracted cifar-10-batches-py) or of an imagefolder (train/<class>/ and val/<class>/)."""
    image_size: int = field(default=32, metadata=_at_least(1))
    channels: int = field(default=3, metadata=_at_least(1))
    batch_size: int = field(default=64, metadata=_at_least(1))
    """Per process."""
    augment: bool = True
    """Training augmentation of the built-in sets; false: training images get the evaluation transform."""
    eval_fraction: float = field(default=0.25, metadata=_between(0, 1, low_open=True, high_open=True))
    """digits only: share held out for evaluation."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a data set named as package.module:function."""
    num_workers: int = field(default=0, metadata=_at_least(0))
    """Worker processes loading (decoding, augmenting) batches per training process; 0 loads on the training
    thread. Batches, and so the trained model, are identical for every value (each sample's augmentation is
    seeded from trainer.seed, its epoch and its index)."""
    pin_memory: bool | None = None
    """Page-locked host batches for asynchronous copies to the GPU; null: on when training on CUDA."""
    persistent_workers: bool | None = None
    """Keep the workers between epochs; null: on when num_workers > 0. Needs num_workers > 0."""
    prefetch_factor: int | None = field(default=None, metadata=_at_least(1))
    """Batches each worker loads ahead; null: torch's default (2). Needs num_workers > 0."""
    auto_augment: str = field(default="none", metadata=_choices(*AUTO_AUGMENTS))
    """cifar10 / imagefolder training, after the crop and flip: none, trivial (TrivialAugmentWide) or
    randaugment (RandAugment). Off with augment: false."""
    normalize: str | None = field(default=None, metadata=_choices(*NORMALIZATIONS))
    """cifar10 / imagefolder: imagenet (ImageNet's mean and std) or computed (per channel, measured on the
    training split only, and applied to both splits); null: imagenet for imagefolder, computed for cifar10."""
    decode_device: str = field(default="cpu", metadata=_choices(*DECODE_DEVICES))
    """imagefolder: cpu (decoded where the sample is loaded: in the workers when num_workers > 0) or cuda
    (JPEGs decoded with nvjpeg on the training GPU, in the training process: needs num_workers=0; the batches
    are on the GPU already, so they are not pinned)."""


@dataclass
class OptimizerConfig:
    name: str = "sgd"
    """sgd, adam, adamw, lamb (ampddp.apex.optimizers.FusedLAMB) or any torch.optim class by name (RMSprop, torch.optim.NAdam)."""
    lr: float = field(default=0.1, metadata=_at_least(0))
    momentum: float = field(default=0.9, metadata=_between(0, 1, high_open=True))
    """sgd only (others: optimizer.kwargs)."""
    weight_decay: float = field(default=5e-4, metadata=_at_least(0))
    """Passed to every optimizer that takes a weight_decay."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The optimizer's other keyword arguments, e.g. {betas: [0.9, 0.95], eps: 1.0e-8}."""
    fused: bool | None = None
    """Use the optimizer's fused kernel (true / false); null keeps torch's default. Refused where the class has no such flag."""
    foreach: bool | None = None
    """Use the optimizer's multi-tensor (foreach) path (true / false); null keeps torch's default."""
    scheduler: str = field(default="cosine", metadata=_choices("none", "cosine", "step", "linear"))
    """The LR schedule after warmup: constant, cosine to 0, step decay, or linear to 0 at the last step."""
    step_size: int = field(default=30, metadata=_at_least(1))
    """step scheduler: epochs between decays."""
    gamma: float = field(default=0.1, metadata=_above(0))
    warmup_steps: int = field(default=0, metadata=_at_least(0))
    """Optimizer steps of linear warmup from warmup_start_factor x lr up to lr; the schedule then runs over the remaining steps."""
    warmup_start_factor: float = field(default=0.1, metadata=_between(0, 1, low_open=True))
    """The share of lr the warmup starts at."""


@dataclass
class TrainerConfig:
    max_epochs: int = field(default=10, metadata=_at_least(1))
    max_steps: int | None = field(default=None, metadata=_at_least(1))
    seed: int = field(default=0, metadata=_between(0, 2**32 - 1))
    run_dir: str = "runs/default"
    grad_accum_steps: int = field(default=1, metadata=_at_least(1))
    clip_grad_norm: float | None = field(default=None, metadata=_above(0))
    eval_every_steps: int | None = field(default=None, metadata=_at_least(1))
    """Also evaluate every K optimizer steps (always at each epoch's end)."""
    log_every_steps: int = field(default=10, metadata=_at_least(1))
    progress: str = field(default="auto", metadata=_choices("auto", "bar", "lines", "off"))
    """auto: a bar on a terminal, periodic lines otherwise."""
    tensorboard: bool = False
    max_nonfinite_losses: int = field(default=10, metadata=_at_least(1))
    """Consecutive non-finite losses after which training stops with an error."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make every rank finish its step, checkpoint, and exit with status 75."""
    compile: bool | str = field(default=False, metadata=_choices(*COMPILE_CHOICES))
    """torch.compile the model after the precision set-up: false, true (mode default) or a torch.compile mode.
    The first step pays the compile time; checkpoints are the same as eager ones."""
    compile_backend: str = DEFAULT_BACKEND
    """torch.compile's backend when trainer.compile is on: inductor, or e.g. aot_eager (compiles fast, no code generation)."""
    channels_last: bool = False
    """Model and 4-D image batches in channels-last memory format (faster convolutions on tensor cores)."""
    cudnn_benchmark: bool = False
    """Let cuDNN time its convolution algorithms at the first step of each shape and keep the fastest
    (faster on GPUs with fixed input sizes; the chosen algorithms may differ from run to run)."""
    allow_tf32: bool | None = None
    """TF32 for fp32 matmuls and convolutions on Ampere and newer GPUs (O0's fp32 at tensor-core speed): true /
    false for both; null keeps torch's defaults (convolutions yes, matmuls no)."""


@dataclass
class CheckpointConfig:
    every_steps: int | None = field(default=None, metadata=_at_least(1))
    keep_last: int | None = field(default=3, metadata=_at_least(1))
    resume: str = field(default="auto", metadata=_choices("auto", "never"))
    """auto: continue from the latest complete checkpoint in trainer.run_dir."""
    resume_from: str | None = None
    """A checkpoint folder or run dir to resume from instead (overrides resume)."""
    init_from: str | None = None
    """Weights to start from: an ampddp checkpoint, an apex-era dict or a plain state dict file."""
    allow_changes: bool = False
    """Resume even when the model, data set, split (eval_fraction, seed) or image size changed."""


@dataclass
class DistributedConfig:
    strategy: str = field(default="ddp", metadata=_choices(*STRATEGIES))
    sync_bn: str = field(default="off", metadata=_choices(*SYNC_BN_CHOICES))
    """off, or BatchNorm synchronised across ranks: auto (torch's on CUDA, portable elsewhere), torch, apex, portable."""
    nproc_per_node: int = field(default=1, metadata=_at_least(1))
    """Spawn this many local processes when not already started by torchrun/SLURM."""
    backend: str = field(default="auto", metadata=_choices("auto", "nccl", "gloo"))
    device: str = field(default="auto", metadata=_choices("auto", "cuda", "cpu"))
    timeout_s: float = field(default=600.0, metadata=_above(0))
    find_unused_parameters: bool = False
    """torch DDP: find parameters that got no gradient each step (models with unused branches; slower)."""
    static_graph: bool = False
    """torch DDP: the used parameters and the graph are the same every step (DDP optimises for it)."""
    gradient_as_bucket_view: bool = False
    """torch DDP: gradients are views into the all-reduce buckets (saves a gradient-sized copy)."""
    bucket_cap_mb: float | None = field(default=None, metadata=_above(0))
    """torch DDP: all-reduce bucket size in MiB; null keeps torch's default (25)."""
    comm_hook: str = field(default="none", metadata=_choices(*COMM_HOOKS))
    """torch DDP: all-reduce gradients compressed to fp16 or bf16 (half the traffic), or none."""


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


# PyYAML implements YAML 1.1, whose float pattern wants a dot and a signed exponent: `1e-3` and `1E6`
# would stay strings. Recipes and overrides read floats in every notation Python writes them.
_FLOAT_TAG = "tag:yaml.org,2002:float"
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+)"""
    r"""|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"""
)


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with Python's float notations (``1e-3``, ``1E6``, ``.5``, ``-2.5e-4``)."""


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(
            f"duplicate key {key!r} on lines {first} and {second}; each key may appear once (YAML would silently keep the last)"
        )


def _refuse_duplicates(node: yaml.Node, where: str = "") -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                name = f"{where}.{key_node.value}" if where else key_node.value
                line = key_node.start_mark.line + 1
                if name in seen:
                    raise _DuplicateKey(name, seen[name], line)
                seen[name] = line
                _refuse_duplicates(value_node, name)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicates(item, where)


def parse_yaml(text: str) -> Any:
    """One YAML document with Python float notations; raises yaml.YAMLError or _DuplicateKey."""
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _allowed_types(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(arg for member in typing.get_args(annotation) for arg in _allowed_types(member))
    return (annotation,)


def _check_number(key: str, value: float, bounds: Bounds | None) -> float:
    if isinstance(value, float) and not math.isfinite(value):
        rule = f" {bounds.describe()}" if bounds else ""
        raise ConfigError(f"{key}={value!r} is not valid; it must be a finite number{rule}")
    if bounds is not None and not bounds.admits(value):
        kind = "a finite number" if isinstance(value, float) else "an integer"
        raise ConfigError(f"{key}={value!r} is out of range; it must be {kind} {bounds.describe()}")
    return value


def _as_float(value: str) -> float | None:
    """A quoted number or a bare inf / nan in a float setting: read as the float it spells."""
    try:
        return float(value.replace("_", ""))
    except ValueError:
        return None


def _coerce(key: str, value: Any, annotation: Any, metadata: typing.Mapping[str, Any]) -> Any:
    allowed = _allowed_types(annotation)
    choices, bounds = metadata.get("choices"), metadata.get("bounds")
    if isinstance(value, bool) and choices and value is False and "off" in choices:
        value = "off"  # YAML reads a bare `off` as false
    if value is None and type(None) in allowed:
        return None
    if float in allowed and isinstance(value, str) and _as_float(value) is not None:
        value = _as_float(value)
    for kind in allowed:
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _check_number(key, float(value), bounds)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return _check_number(key, value, bounds)
        if kind in (str, bool) and isinstance(value, kind):
            break
        if typing.get_origin(kind) is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        if typing.get_origin(kind) is dict and isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
    else:
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {' or '.join(map(_type_name, allowed))}")
    if choices and value not in choices:
        if metadata.get("import_path") and is_import_path(value):
            return value
        error = choice_error(key, value, choices)
        raise ConfigError(f"{error}, or {IMPORT_PATH_FORM}") if metadata.get("import_path") else error
    return value


def _type_name(kind: Any) -> str:
    if kind is type(None):
        return "null"
    if typing.get_origin(kind) is list:
        return "a list of strings"
    if typing.get_origin(kind) is dict:
        return "a mapping of names to values"
    return kind.__name__


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {section}.{key}{closest(str(key), fields)}; valid keys in {section}: {', '.join(fields)}")
        kwargs[key] = _coerce(f"{section}.{key}", value, hints[key], fields[key].metadata)
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
            value = parse_yaml(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        except _DuplicateKey as error:
            raise ConfigError(f"override {item!r}: {error}") from None
        nested.setdefault(section, {})[name] = value
    return nested


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe's sections as plain dicts; ConfigError names the file and what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such recipe file")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the recipe ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); save the recipe as UTF-8"
        ) from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(error)})") from None
    except _DuplicateKey as error:
        raise ConfigError(f"{path}: {error}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections (precision, model, data, ...), found {type(raw).__name__}")
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"{path}: unknown section {section!r}{closest(str(section), SECTIONS)}; valid sections: {', '.join(SECTIONS)}"
            )
        if values is not None and not isinstance(values, dict):
            keys = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
            raise ConfigError(
                f"{path}: section {section!r} must be a mapping of key: value lines, found {type(values).__name__} {values!r}; "
                f"valid keys in {section}: {keys}"
            )
    return {section: dict(values or {}) for section, values in raw.items()}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a recipe (YAML) and apply overrides; raise ConfigError on the first bad key or value."""
    raw = read_recipe(path) if path is not None else {}
    for section, values in parse_overrides(overrides or []).items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}{closest(str(section), SECTIONS)}; valid sections: {', '.join(SECTIONS)}")
        raw[section] = {**raw.get(section, {}), **values}
    return RunConfig(**{section: _build(section, SECTIONS[section], values) for section, values in raw.items()})


def describe_keys() -> str:
    """Every key with its default, for ``ampddp train --help``."""
    lines = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            choices = f.metadata.get("choices")
            hint = f" {{{', '.join(map(spelled, choices))}}}" if choices else ""
            lines.append(f"  {section}.{f.name} = {default!r}{hint}")
    return "\n".join(lines)


def check_config(config: RunConfig) -> None:
    """Check every value of a RunConfig again, for one built in code (``load_config`` checks as it reads)."""
    for section, cls in SECTIONS.items():
        values = getattr(config, section)
        if not isinstance(values, cls):
            raise ConfigError(f"section {section!r} must be a {cls.__name__}, found {type(values).__name__}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _coerce(f"{section}.{f.name}", getattr(values, f.name), hints[f.name], f.metadata)
