"""Every key and file name of an ampddp checkpoint, in one place.

A checkpoint is a directory ``<run_dir>/checkpoints/step-<N>/`` holding

- ``shared.pt`` (written by rank 0): ``FORMAT``, ``VERSIONS``, ``CONFIG``, ``MODEL`` (fp32 state dict;
  master values under O2/O5), ``OPTIMIZER``, ``PRECISION`` (mode, policy, loss scalers),
  ``SCHEDULER``, ``PROGRESS``, ``SAMPLER``, ``WORLD_SIZE``, ``MESH`` (the strategy and the sizes of the
  mesh's dimensions, e.g. ``{"strategy": "fsdp2", "pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}``;
  None where the run had no mesh of its own; absent before it was recorded), ``TRACKED_RUNS``;
- ``rank-<r>.pt`` (written by rank r): ``RNG`` (python, numpy, torch CPU and CUDA generator states);
- in a sharded checkpoint (format 2, ``SHARDED_FORMAT_VERSION``), DCP's ``__<r>_<n>.distcp`` (rank
  r's shards of the model and optimizer tensors) and ``.metadata`` (written by rank 0);
- ``COMPLETE`` (JSON, written last by rank 0): only a directory with it is a checkpoint. It is the
  manifest: ``{"step", "world_size", "time", "checksum": "xxh3_128", "files": {name: {"size": bytes,
  "xxh3_128": hex}}, "run": {"progress", "config_sha256", "ampddp"}}``, every file of every rank;
  markers written before checksums list the names only (``"files": [name, ...]``) and load
  unverified; ``run`` (the run's progress, a digest of its settings and the ampddp version) is
  absent from markers written before it.

The newest step folder with ``COMPLETE`` is the latest checkpoint; ``<run_dir>/abandoned/`` receives
the step folders newer than a checkpoint resumed explicitly (``resume_from``) and bad ones
overwritten. Files hold only tensors and plain containers, numbers and strings, so they load with
``torch.load(weights_only=True)``.
"""

from ampddp.rundir.run_dir import ABANDONED_DIR as ABANDONED_DIR
from ampddp.rundir.run_dir import CHECKPOINTS_DIR as CHECKPOINTS_DIR

FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
"""A sharded checkpoint (``checkpoint.sharded``): its model and optimizer tensors are in DCP's files
(``__<rank>_<n>.distcp``, ``.metadata``) beside ``shared.pt``, whose ``MODEL`` is None, whose
``OPTIMIZER`` keeps everything but the tensors and whose ``SHARDS`` records each tensor's shape and
dtype. An ampddp that reads format 1 only refuses it by its version."""
FORMATS = (FORMAT_VERSION, SHARDED_FORMAT_VERSION)
SHARDS = "shards"

FORMAT = "format_version"
VERSIONS = "versions"
CONFIG = "config"
MODEL = "model"
OPTIMIZER = "optimizer"
PRECISION = "precision"
SCHEDULER = "scheduler"
PROGRESS = "progress"
SAMPLER = "sampler"
WORLD_SIZE = "world_size"
MESH = "mesh"
TRACKED_RUNS = "tracked_runs"
"""The experiment trackers' run ids by logger name (``{"wandb": "3fk2x9ab"}``); checkpoints written
before it existed lack it, and a run resumed from one starts fresh tracked runs."""
RNG = "rng"
RANK = "rank"

RUN_PRECISION_MODE = "precision_mode"
"""In a manifest's run facts: the concrete mode the run trained in (``auto`` resolved), which a
resumed ``auto`` run keeps; manifests written before it lack it."""

SHARED_FILE = "shared.pt"
RANK_FILE = "rank-{rank:05d}.pt"
COMPLETE_FILE = "COMPLETE"
STEP_DIR = "step-{step:09d}"
STEP_DIR_PREFIX = "step-"

METADATA_FILE = ".metadata"
"""DCP's metadata file in a sharded checkpoint's step folder (written by rank 0)."""


def is_sharded_file(name: str) -> bool:
    """Whether ``name`` is one of DCP's files of a sharded checkpoint."""
    return name == METADATA_FILE or (name.startswith("__") and name.endswith(".distcp"))
