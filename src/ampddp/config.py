"""The typed run configuration: one dataclass per recipe section, each key with its type, default,
valid choices or range, and a docstring saying what it does.

This module is the schema only; ``ampddp.recipe.reading`` reads YAML and dotted ``key=value``
overrides into it and checks every value. The classes that do the work get plain arguments from
a RunConfig, never the object itself.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from ampddp.choices import (
    AUTO_AUGMENTS,
    CHECKPOINT_LAYOUTS,
    COMM_HOOKS,
    COMPILE_CHOICES,
    CROPS,
    DECODE_DEVICES,
    DEFAULT_BACKEND,
    FLOAT32_MAX,
    FP8_RECIPES,
    IMPLS,
    LOGGER_NAMES,
    MAX_BUCKET_MB,
    MAX_PREFETCH,
    MAX_PROCESSES,
    MAX_TIMEOUT_S,
    NORMALIZATIONS,
    PP_SCHEDULES,
    PRECISION_CHOICES,
    STRATEGIES,
    SYNC_BN_CHOICES,
)
from ampddp.preemption import DEFAULT_STOP_SIGNALS

IMPORT_PATH_FORM = "package.module:function"
"""How a recipe names a user's function: the module to import, a colon, the callable in it."""


def _choices(*values: str | bool, import_path: bool = False) -> dict[str, Any]:
    """Metadata: the valid values; ``import_path``: a ``package.module:function`` is valid too."""
    return {"choices": values, "import_path": import_path}


PATH_SETTING = {"path": True}
"""Metadata of a setting that names a file or folder: ``~`` and ``$VARS`` in it are expanded."""


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
            if isinstance(x, int) or (x is not None and float(x).is_integer() and abs(x) < 1e16):
                return str(int(x))
            return f"{x:g}"

        if self.high is None:
            return f"{'>' if self.low_open else '>='} {number(self.low)}"
        return f"in {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}{')' if self.high_open else ']'}"


def _at_least(low: float) -> dict[str, Bounds]:
    return {"bounds": Bounds(low)}


def _above(low: float) -> dict[str, Bounds]:
    return {"bounds": Bounds(low, low_open=True)}


def _between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> dict[str, Bounds]:
    return {"bounds": Bounds(low, high, low_open, high_open)}


LOSS_SCALE = _between(0, FLOAT32_MAX, low_open=True)
"""A loss scale's range: above 0, and a float32 (the scaled loss and the unscaling factor are fp32)."""
OPTIMIZER_FLOAT = _between(0, FLOAT32_MAX)
"""The range of a learning rate or weight decay: each becomes the scalar of an op on the fp32 weights."""


@dataclass
class PrecisionConfig:
    mode: str = field(default="auto", metadata=_choices(*PRECISION_CHOICES))
    """auto (the fastest numerically safe mode of the device: native-bf16 where bf16 is native, native-fp16 on GPUs before
    compute capability 8.0, else O0), O0-O5 (apex opt levels), O6 (O4 with fp8 matmuls, torchao) or native-fp16 /
    native-bf16 (torch.autocast + GradScaler)."""
    impl: str = field(default="builtin", metadata=_choices(*IMPLS))
    """builtin (ampddp on native torch) or apex (delegate to an installed apex.amp, O-levels only)."""
    cast_model_type: str | None = None
    """apex override: the dtype the model's params are cast to (float16, bfloat16, float32); null: the mode's."""
    patch_torch_functions: bool | None = None
    """apex override: cast ops per apex's lists (the O1/O4 mechanism); only O1/O4 take true; null: the mode's."""
    keep_batchnorm_fp32: bool | str | None = None
    """apex override: BatchNorm params and stats in fp32 over low-precision params (O2/O5 default true); null: the mode's."""
    fp32_islands: bool | None = None
    """With distributed.strategy fsdp2 or hsdp, O2/O5: run apex's fp32-list ops (softmax, norms, losses) in fp32
    over the low-precision params (null: on); false: apex's pure O2/O5. Refused elsewhere."""
    master_weights: bool | None = None
    """apex override: fp32 master weights the optimizer steps, copied to the low-precision params; null: the mode's."""
    loss_scale: float | str | None = field(default=None, metadata=LOSS_SCALE)
    """A fixed scale, or "dynamic"; None keeps the mode's default."""
    cast_model_outputs: str | None = None
    """apex override: cast the model's floating outputs to this dtype (e.g. float32); null: left as computed."""
    min_loss_scale: float | None = field(default=None, metadata=LOSS_SCALE)
    """The dynamic loss scale never backs off below this; null: no floor."""
    max_loss_scale: float | None = field(default=None, metadata=LOSS_SCALE)
    """The dynamic loss scale never grows above this (apex: 2**24); null: the mode's."""
    init_loss_scale: float | None = field(default=None, metadata=LOSS_SCALE)
    """The dynamic loss scale to start from (apex: 2**16); null: the mode's."""
    growth_factor: float | None = field(default=None, metadata=_between(1, FLOAT32_MAX, low_open=True))
    """Multiplies the loss scale after growth_interval steps without overflow (2); null: the mode's."""
    backoff_factor: float | None = field(default=None, metadata=_between(0, 1, low_open=True, high_open=True))
    """Multiplies the loss scale at an overflow (0.5); null: the mode's."""
    growth_interval: int | None = field(default=None, metadata=_at_least(1))
    """Steps without overflow before the loss scale grows (apex: 2000); null: the mode's."""
    hysteresis: int | None = field(default=None, metadata=_at_least(1))
    """Overflows tolerated (steps skipped) before the loss scale backs off (1); null: the mode's."""
    verbosity: int | None = field(default=None, metadata=_at_least(0))
    """apex's verbosity: 0 silences the loss-scale messages; null: 1."""
    fp8_recipe: str | None = field(default=None, metadata=_choices(*FP8_RECIPES))
    """O6: fp8 scaling of the eligible linear layers: rowwise (default), tensorwise, rowwise_with_gw_hp."""
    fp8_filter: list[str] | None = None
    """O6: name patterns (fnmatch) of linear layers kept out of fp8, e.g. [head, "blocks.*.mlp.*"];
    null: the first and the last linear layer; [] converts every eligible one."""
    fp8_min_size: int | None = field(default=None, metadata=_at_least(1))
    """O6: the smallest dim of a linear layer run in fp8; null: the sizes where fp8 paid off on an H100."""
    float_functions: list[str] = field(default_factory=list)
    """Dotted names run in fp32 under O1/O4, e.g. torch.nn.functional.softplus (register_float_function)."""
    half_functions: list[str] = field(default_factory=list)
    """Dotted names run in the low-precision dtype under O1/O4 (register_half_function)."""
    promote_functions: list[str] = field(default_factory=list)
    """Dotted names run in the widest dtype of their inputs under O1/O4 (register_promote_function)."""


@dataclass
class ModelConfig:
    name: str = "small_cnn"
    """A built-in (mlp, small_cnn), any torchvision classification model (resnet18, ...), or a user's
    function as package.module:function, called with num_classes= and model.kwargs, returning an nn.Module."""
    num_classes: int = field(default=10, metadata=_at_least(1))
    """Classes the model predicts (the data set's labels must lie in 0..num_classes-1); the vocabulary for a GPT."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a model named as package.module:function."""
    key_map: dict[str, str | None] = field(default_factory=dict)
    """Renames for the tensors of safetensors weights given as checkpoint.init_from: {regular expression: new
    name}, the first pattern matching a whole name wins (its groups as \\1), null drops the tensor;
    e.g. {'transformer\\.h\\.(\\d+)\\.(.*)': 'blocks.\\1.\\2'}."""


@dataclass
class DataConfig:
    name: str = field(default="digits", metadata=_choices("digits", "cifar10", "imagefolder", import_path=True))
    """digits: scikit-learn's handwritten digits (no download); cifar10 / imagefolder: from data.root; or a
    user's function as package.module:function, called with data.kwargs, returning (train_set, eval_set or None).
    root, image_size, channels, augment and eval_fraction apply to the built-in datasets; crop, auto_augment and
    normalize to cifar10 and imagefolder; decode_device to imagefolder."""
    root: str | None = None
    """Directory of cifar10 (the extracted cifar-10-batches-py) or of an imagefolder (train/<class>/ and val/<class>/).
    ``~`` and ``$VARS`` are expanded when the data is read, not in the config a checkpoint keeps: a
    requeued job whose $SLURM_TMPDIR moved resumes as the same run."""
    image_size: int = field(default=32, metadata=_at_least(1))
    """Side in pixels of the images the built-in data sets give the model."""
    channels: int = field(default=3, metadata=_at_least(1))
    """Image channels of the built-in data sets."""
    batch_size: int = field(default=64, metadata=_at_least(1))
    """Per process."""
    augment: bool = True
    """Training augmentation of the built-in sets; false: training images get the evaluation transform."""
    eval_fraction: float = field(default=0.25, metadata=_between(0, 1, low_open=True, high_open=True))
    """digits only: share held out for evaluation."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a data set named as package.module:function."""
    num_workers: int = field(default=0, metadata=_between(0, MAX_PROCESSES))
    """Worker processes loading (decoding, augmenting) batches per training process; 0 loads on the training
    thread. Batches, and so the trained model, are identical for every value (each sample's augmentation is
    seeded from trainer.seed, its epoch and its index)."""
    pin_memory: bool | None = None
    """Page-locked host batches for asynchronous copies to the GPU; null: on when training on CUDA."""
    persistent_workers: bool | None = None
    """Keep the workers between epochs; null: on when num_workers > 0. Needs num_workers > 0."""
    prefetch_factor: int | None = field(default=None, metadata=_between(1, MAX_PREFETCH))
    """Batches each worker loads ahead; null: torch's default (2). Needs num_workers > 0."""
    crop: str = field(default="random-resized", metadata=_choices(*CROPS))
    """cifar10 / imagefolder training crop: random-resized (RandomResizedCrop; evaluation resizes to
    image_size / 0.875 and center-crops, ImageNet practice) or padded (a random image_size crop of the image
    zero-padded by image_size / 8: CIFAR practice; evaluation sees the whole image)."""
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
    lr: float = field(default=0.1, metadata=OPTIMIZER_FLOAT)
    """The peak learning rate (after warmup, before the schedule decays it)."""
    momentum: float = field(default=0.9, metadata=_between(0, 1, high_open=True))
    """sgd only (others: optimizer.kwargs)."""
    weight_decay: float = field(default=5e-4, metadata=OPTIMIZER_FLOAT)
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
    gamma: float = field(default=0.1, metadata=_between(0, FLOAT32_MAX, low_open=True))
    """step scheduler: the factor the LR is multiplied by at each decay."""
    warmup_steps: int = field(default=0, metadata=_at_least(0))
    """Optimizer steps of linear warmup from warmup_start_factor x lr up to lr; the schedule then runs over the remaining steps."""
    warmup_start_factor: float = field(default=0.1, metadata=_between(0, 1, low_open=True))
    """The share of lr the warmup starts at."""


@dataclass
class TrainerConfig:
    max_epochs: int = field(default=10, metadata=_at_least(1))
    """Passes over the training set; the run ends at whichever of max_epochs and max_steps comes first."""
    max_steps: int | None = field(default=None, metadata=_at_least(1))
    """Optimizer steps to train (skipped ones included); null: max_epochs alone ends the run."""
    seed: int = field(default=0, metadata=_between(0, 2**32 - 1))
    """Seeds the model's initialisation, the data order and augmentation, and dropout: the same seed, the same run."""
    run_dir: str = field(default="runs/default", metadata=PATH_SETTING)
    """Where the run writes everything: checkpoints, metrics.jsonl, summary.json, plots, loggers' files."""
    grad_accum_steps: int = field(default=1, metadata=_at_least(1))
    """Micro-batches whose gradients add up to one optimizer step (effective batch: batch_size x this x processes)."""
    clip_grad_norm: float | None = field(default=None, metadata=_between(0, FLOAT32_MAX, low_open=True))
    """Clip the global gradient norm to this (of the unscaled fp32 gradients); null: no clipping."""
    eval_every_steps: int | None = field(default=None, metadata=_at_least(1))
    """Also evaluate every K optimizer steps (always at each epoch's end)."""
    log_every_steps: int = field(default=10, metadata=_at_least(1))
    """A record (metrics.jsonl, loggers, a progress line) every K optimizer steps, and at every skipped step."""
    progress: str = field(default="auto", metadata=_choices("auto", "bar", "lines", "off"))
    """auto: a bar on a terminal, periodic lines otherwise."""
    tensorboard: bool = False
    """The same as listing tensorboard in observe.loggers."""
    max_nonfinite_losses: int = field(default=10, metadata=_at_least(1))
    """Consecutive non-finite losses after which training stops with an error."""
    stop_signals: list[str] = field(default_factory=lambda: list(DEFAULT_STOP_SIGNALS))
    """Signals that make every rank finish its step, checkpoint, and exit with status 75 (130 for SIGINT);
    before training begins they end the run at once."""
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
    """Also checkpoint every K optimizer steps (always at the end and when a stop signal arrives); null: only then."""
    keep_last: int | None = field(default=3, metadata=_at_least(1))
    """Complete checkpoints kept (older ones are removed once a newer one verifies); null: all."""
    resume: str = field(default="auto", metadata=_choices("auto", "never"))
    """auto: continue from the latest complete checkpoint in trainer.run_dir."""
    resume_from: str | None = field(default=None, metadata=PATH_SETTING)
    """A checkpoint folder or run dir to resume from instead (overrides resume)."""
    init_from: str | None = field(default=None, metadata=PATH_SETTING)
    """Weights to start from: an ampddp checkpoint (a file, a step folder or a run dir: its newest checkpoint
    that verifies), an apex-era dict, a plain state dict file, or safetensors (ampddp export's file, or a folder
    of them such as Hugging Face's with its index; under fsdp2/hsdp each rank reads only its shards' slices)."""
    allow_changes: bool = False
    """Resume even when the model, data set, split (eval_fraction, seed) or image size changed."""
    layout: str = field(default="auto", metadata=_choices(*CHECKPOINT_LAYOUTS))
    """whole (one file of whole tensors), sharded (every rank writes its own shards), or auto: sharded under fsdp2."""


@dataclass
class DistributedConfig:
    strategy: str = field(default="ddp", metadata=_choices(*STRATEGIES))
    """How several processes train: ddp (torch DDP), apex-ddp, fsdp2 (sharded params, grads and optimizer state), hsdp
    (fsdp2 sharded within each node, replicated across nodes), dp, none."""
    sync_bn: str = field(default="off", metadata=_choices(*SYNC_BN_CHOICES))
    """off, or BatchNorm synchronised across ranks: auto (torch's on CUDA, portable elsewhere), torch, apex, portable."""
    nproc_per_node: int = field(default=1, metadata=_between(1, MAX_PROCESSES))
    """Spawn this many local processes when not already started by torchrun/SLURM."""
    backend: str = field(default="auto", metadata=_choices("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl"))
    """auto (nccl on GPUs, gloo on CPU; on GPUs with fsdp_cpu_offload both: cpu:gloo,cuda:nccl), nccl, gloo, or both."""
    device: str = field(default="auto", metadata=_choices("auto", "cuda", "cpu"))
    """auto: CUDA when present, else the CPU."""
    timeout_s: float = field(default=600.0, metadata=_between(0, MAX_TIMEOUT_S, low_open=True))
    """Seconds a collective waits for the other ranks before the run stops with a peer failure."""
    find_unused_parameters: bool = False
    """torch DDP: find parameters that got no gradient each step (models with unused branches; slower)."""
    static_graph: bool = False
    """torch DDP: the used parameters and the graph are the same every step (DDP optimises for it)."""
    gradient_as_bucket_view: bool = False
    """torch DDP: gradients are views into the all-reduce buckets (saves a gradient-sized copy)."""
    bucket_cap_mb: float | None = field(default=None, metadata=_between(0, MAX_BUCKET_MB, low_open=True))
    """torch DDP: all-reduce bucket size in MiB; null keeps torch's default (25)."""
    comm_hook: str = field(default="none", metadata=_choices(*COMM_HOOKS))
    """torch DDP: all-reduce gradients compressed to fp16 or bf16 (half the traffic), or none."""
    fsdp_blocks: list[str] = field(default_factory=list)
    """fsdp2: class names of the modules sharded as one unit each (e.g. [Block]); empty: the model's repeated layers."""
    fsdp_reshard_after_forward: bool = True
    """fsdp2: free a block's gathered params after its forward (less memory) or keep them for the backward (faster)."""
    fsdp_reduce_in_fp32: bool = True
    """fsdp2: reduce gradients in fp32 (false: in the compute dtype, half the traffic)."""
    fsdp_activation_checkpointing: bool = False
    """fsdp2: recompute each block's activations in the backward instead of keeping them (less memory, ~1/3 more compute)."""
    fsdp_cpu_offload: bool = False
    """fsdp2: keep the sharded params, their gradients and the optimizer state in CPU memory; the optimizer steps there."""
    fsdp_shard_size: int | None = field(default=None, metadata=_at_least(1))
    """hsdp: the ranks each replica of the model is sharded over (null: a node's, LOCAL_WORLD_SIZE); the
    world size must be a multiple of it. All-gathers stay inside a group; gradients are all-reduced across them."""
    fsdp_build_on_meta: bool = True
    """fsdp2/hsdp: build the model on the meta device and give each rank only its shards of the weights an eager
    build makes (no rank holds the whole model); false: build it whole on each rank, then shard it."""
    tp_size: int = field(default=1, metadata=_between(1, MAX_PROCESSES))
    """Tensor parallelism: the processes each layer's weights and compute are split over (the innermost mesh
    dimension; they read the same batches). With strategy none (tensor parallelism alone: as many processes),
    fsdp2 or hsdp (sharded data parallelism over the rest); 1: none."""
    tp_plan: dict[str, str] | str | None = None
    """How layers split: null (the model's own plan: ampddp.zoo.models:gpt has one), a table {module name:
    colwise | rowwise | sequence | vocab | replicate} ('*' for one level of names, e.g. {"blocks.*.mlp.0": colwise};
    vocab: the output head, its logits left split for loss_parallel; replicate: whole on every rank), or a
    package.module:function(model, tp_mesh) that parallelizes the model itself."""
    sequence_parallel: bool = True
    """With tensor parallelism and the model's own plan: split the activations between split layers by sequence
    position (norms on their slice; less memory); the sequence length must divide by tp_size."""
    loss_parallel: bool = False
    """With tensor parallelism: keep the logits split by vocabulary and compute the cross-entropy on each rank's
    slice (torch's loss_parallel; no rank holds the whole batch x sequence x vocabulary logits). The model's own
    plan is asked to split them (ampddp.zoo.models:gpt does); a tp_plan table marks its head vocab."""
    pp_size: int = field(default=1, metadata=_between(1, MAX_PROCESSES))
    """Pipeline parallelism: the stages the model's layers are split into (the outermost mesh dimension), with strategy
    none (a process per stage and tensor-parallel rank), ddp (each stage replicated over its data ranks: run as hsdp with
    fsdp_shard_size 1), fsdp2 (each stage sharded over its data ranks) or hsdp; 1: none.
    The model's own split (ampddp.zoo.models:gpt splits its blocks evenly) or pp_split; the parameters keep the whole
    model's names (checkpoints read as the whole model's)."""
    pp_schedule: str = field(default="1F1B", metadata=_choices(*PP_SCHEDULES))
    """The order micro-batches go through the stages: 1F1B (a micro-batch's backward as soon as it can: activations of at
    most pp_size micro-batches held), GPipe (every forward, then every backward); Interleaved1F1B, InterleavedZeroBubble
    (pp_stages_per_rank stages on each rank, looped: a smaller idle share), ZBVZeroBubble (2 stages per rank in a V, the
    backward split into its input and weight parts to fill the idle time)."""
    pp_microbatches: int | None = field(default=None, metadata=_at_least(1))
    """The micro-batches each batch (data.batch_size, per data-parallel rank) is cut into: more shrink the pipeline's idle
    share ((pp_size-1)/(microbatches+pp_size-1)); null: pp_size. Fewer than pp_size go through the stages one by one."""
    pp_stages_per_rank: int | None = field(default=None, metadata=_at_least(1))
    """The stages each rank holds: null is the schedule's own (1 for GPipe and 1F1B, 2 for the looped schedules;
    ZBVZeroBubble takes exactly 2). The model is cut into pp_size x pp_stages_per_rank stages."""
    pp_split: list[list[str]] | str | None = None
    """How the model is cut into stages: null (the model's own pipeline_stage(stage, stages)), the module names of each
    stage (a list per stage, e.g. [[embed, layers.0, layers.1], [layers.2, layers.3, head]]: for a model written as
    torchtitan's, its layers in an nn.ModuleDict and its forward skipping a removed module), or a
    package.module:function(model, stage, stages) returning the stage's module (the whole model's names kept)."""


@dataclass
class ObserveConfig:
    """Where the run's records go besides the console, metrics.jsonl and summary.json (rank 0 only)."""

    loggers: list[str] = field(default_factory=list, metadata=_choices(*LOGGER_NAMES))
    """Any of tensorboard, csv (<run_dir>/csv/<kind>.csv), wandb, mlflow; several at once. W&B and MLflow
    continue the same tracked run after a resume (their run ids are saved with the checkpoints)."""
    plots: bool = True
    """loss.png, eval_<metric>.png and loss_scale.png in the run dir at the end (needs matplotlib)."""
    wandb_project: str = "ampddp"
    """The W&B project the run logs to."""
    wandb_entity: str | None = None
    """The W&B entity (user or team); null: W&B's default."""
    wandb_mode: str | None = field(default=None, metadata=_choices("online", "offline", "disabled"))
    """null: W&B's own choice (WANDB_MODE, else online); offline writes <run_dir>/wandb for `wandb sync`."""
    mlflow_tracking_uri: str | None = None
    """An MLflow server or store; null: MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db."""
    mlflow_experiment: str = "ampddp"
    """The MLflow experiment the run logs to (created when missing)."""


@dataclass
class RunConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)}


KEY_ALIASES: dict[str, dict[str, str]] = {
    "precision": {"opt_level": "mode", "amp": "mode", "dtype": "mode"},
    "data": {"batch": "batch_size", "data_dir": "root", "dataset": "name", "img_size": "image_size"},
    "optimizer": {"learning_rate": "lr", "lr_scheduler": "scheduler", "warmup": "warmup_steps", "optimizer": "name"},
    "trainer": {
        "epochs": "max_epochs", "num_epochs": "max_epochs", "steps": "max_steps", "num_steps": "max_steps",
        "output_dir": "run_dir", "out_dir": "run_dir", "gradient_accumulation_steps": "grad_accum_steps",
        "accumulate_grad_batches": "grad_accum_steps", "max_grad_norm": "clip_grad_norm", "gradient_clip_val": "clip_grad_norm",
    },
    "checkpoint": {"save_steps": "every_steps", "resume_from_checkpoint": "resume_from", "save_total_limit": "keep_last"},
    "distributed": {"nproc": "nproc_per_node", "world_size": "nproc_per_node"},
}  # fmt: skip
"""Names other trainers (HF Trainer, Lightning, timm) give a setting, by section: an unknown key near
one of them is answered with ampddp's name for it."""
