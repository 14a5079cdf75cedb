"""The names a recipe may choose from, and the largest numbers it may give, in a module that imports
nothing heavy.

``ampddp --help`` and recipe checks list these choices; keeping them here (not beside the torch code
that implements each) lets the command line answer without importing torch. The implementing
modules import their names from here, so each list exists once.

The bounds at the end are the largest numbers ampddp hands to torch and to the operating system: a
recipe key or a library setting past one is refused in one line, naming it and its range, before
anything runs. Past them a run ended in a traceback at its first step (``optimizer.lr=1e308``: "value
cannot be converted to type float without overflow"; ``data.batch_size=10**30``: islice's "Stop
argument ... must be ... <= sys.maxsize"), or never started (``data.num_workers=10**30``: a DataLoader
starting workers forever).
"""

from __future__ import annotations

OPT_LEVEL_NAMES = ("O0", "O1", "O2", "O3", "O4", "O5", "O6")
NATIVE_MODE_NAMES = ("native-fp16", "native-bf16")
PRECISION_MODES = (*OPT_LEVEL_NAMES, *NATIVE_MODE_NAMES)
AUTO_PRECISION = "auto"
"""The fastest numerically safe mode of the device the run lands on (``ampddp.precision.auto``)."""
PRECISION_CHOICES = (AUTO_PRECISION, *PRECISION_MODES)
IMPLS = ("builtin", "apex")
FP8_RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")
"""O6's fp8 scaling (torchao's recipes): a scale per row (default), one per tensor (fastest), or per
row with the weight gradient in high precision. O6 keeps fp32 weights: bf16 weights with rowwise
scaling produced NaNs in torchao (pytorch/ao#3171)."""

STRATEGIES = ("ddp", "apex-ddp", "fsdp2", "hsdp", "dp", "none")
"""How a model is spread over processes: torch DDP, apex's DDP, FSDP2 sharding (``fully_shard``),
nn.DataParallel (one process), or not at all."""
TP_STYLES = ("colwise", "rowwise", "sequence", "vocab", "replicate")
"""How a tensor-parallel plan splits a layer: by output columns, by input rows (partial sums reduced), its
activations by sequence position (norms), an output head by vocabulary columns whose logits stay split for the
vocabulary-parallel loss (``loss_parallel``), or not at all (whole on every rank, its parameters replicated DTensors)."""
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""The orders micro-batches go through a pipeline's stages (torch.distributed.pipelining's schedules by their names)."""
COMM_HOOKS = ("none", "fp16", "bf16")
"""DDP communication hooks: none (all-reduce in the gradients' dtype) or compress to fp16 / bf16."""
SYNC_BN_IMPLS = ("auto", "torch", "apex", "portable")
SYNC_BN_CHOICES = ("off", *SYNC_BN_IMPLS)
"""``distributed.sync_bn`` / ``Parallel(sync_bn=...)``: off, or the implementation BatchNorm layers become."""

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes; ``trainer.compile: true`` means ``default``."""
COMPILE_CHOICES: tuple[bool | str, ...] = (False, True, *COMPILE_MODES)
DEFAULT_BACKEND = "inductor"

AUTO_AUGMENTS = ("none", "trivial", "randaugment")
CROPS = ("random-resized", "padded")
"""Training crops: random-resized (ImageNet's RandomResizedCrop, eval at image_size / 0.875 then
center crop) or padded (CIFAR's random crop of a zero-padded image, eval on the whole image)."""
NORMALIZATIONS = ("imagenet", "computed")
DECODE_DEVICES = ("cpu", "cuda")

CHECKPOINT_LAYOUTS = ("auto", "whole", "sharded")
"""checkpoint.layout: whole tensors in one shared file, each rank writing its own shards, or auto
(sharded when FSDP2 shards the model)."""

EXPORT_DTYPE_NAMES = ("saved", "fp32", "bf16", "fp16")
"""``ampddp export --dtype``: the floating tensors as the checkpoint holds them, or cast to one dtype."""

LOGGER_NAMES = ("tensorboard", "csv", "wandb", "mlflow")
"""observe.loggers: where a run's records go besides metrics.jsonl (``ampddp.observe.loggers``)."""

LOG_LEVEL_VARIABLE = "AMPDDP_LOG_LEVEL"
"""The environment variable that, set to ``DEBUG``, logs ampddp's debug records too (every setting
of a precision set-up, ...) on every process of a run: ``ampddp train --verbose`` sets it, so the
ranks it starts follow (kept here, beside the recipe's names, so the command line reads it without torch)."""

INT64_MAX = 2**63 - 1
"""The largest count (batch size, steps, epochs, sizes, classes): torch and the C library read counts as int64."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a learning rate, weight decay or loss scale becomes an fp32 tensor or the scalar of
an fp32 op, which a larger one overflows."""
FLOAT16_MAX = 65504.0
"""The largest float16: the bound of what steps fp16 weights directly (O3: no fp32 master weights)."""
MAX_PROCESSES = 1024
"""The most processes one training process starts of a kind (data loader workers; local ranks)."""
MAX_PREFETCH = 1024
"""The most batches a loader worker loads ahead: torch queues prefetch_factor x num_workers batches
before the first one comes back."""
MAX_TIMEOUT_S = 1e9
"""The longest collective timeout in seconds (31 years): torch keeps it in int64 nanoseconds, which
overflow past 9.2e9 s, and a collective then times out at once."""
MAX_BUCKET_MB = 2**40
"""The largest DDP bucket in MiB: torch keeps its size in int64 bytes (2**63)."""

CIFAR_LAYOUT = "ROOT/cifar-10-batches-py/ (the extracted python version of CIFAR-10)"
"""What data.root holds for data.name=cifar10 (ampddp never downloads)."""
IMAGEFOLDER_LAYOUT = "ROOT/train/<class>/<image> and ROOT/val/<class>/<image>"
"""What data.root holds for data.name=imagefolder."""
