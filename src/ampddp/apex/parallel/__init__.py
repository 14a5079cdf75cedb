"""apex.parallel on native torch: DistributedDataParallel, Reducer, SyncBatchNorm, LARC and helpers.

apex deleted ``apex.parallel`` in May 2025, yet apex-era scripts still do
``from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model`` and
``from apex.parallel.LARC import LARC``. These are apex's names and signatures for ampddp's apex-style DDP and SyncBatchNorm
(``ampddp.distributed.apex_ddp`` / ``apex_sync_bn``, built on torch's DistributedDataParallel and
ampddp's portable SyncBatchNorm), so they run on CPU/gloo as well as CUDA.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ampddp.apex._names import unknown_name
from ampddp.apex.parallel.LARC import LARC
from ampddp.distributed.apex_ddp import DistributedDataParallel, Reducer
from ampddp.distributed.apex_sync_bn import SyncBatchNorm, convert_syncbn_model
from ampddp.errors import ConfigError

ReduceOp = dist.ReduceOp

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]

REPLACEMENTS = {
    "multiproc": "torchrun --nproc_per_node=N script.py (or ampddp.distributed.launch_local); apex's multiproc launcher is not provided",
    "sync_batchnorm_kernel": "apex.parallel.SyncBatchNorm (its autograd function is internal)",
    "optimized_sync_batchnorm_kernel": "apex.parallel.SyncBatchNorm (its autograd function is internal)",
    "SyncBatchnormFunction": "apex.parallel.SyncBatchNorm (its autograd function is internal)",
}


def create_syncbn_process_group(group_size: int) -> Any:
    """Split the world into groups of ``group_size`` consecutive ranks; return this rank's group.

    Every rank must call it (each group is created collectively). ``group_size=0`` means the whole
    world and returns ``None`` (the default group), as in apex. ``group_size`` must divide the
    world size.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 0:
        raise ConfigError(f"group_size={group_size!r} is not valid; it must be an integer >= 0 (0: the whole world)")
    if group_size == 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "create_syncbn_process_group needs torch.distributed initialized: call torch.distributed.init_process_group first"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % group_size != 0:
        raise ConfigError(
            f"create_syncbn_process_group(group_size={group_size}): the world size {world_size} is not divisible by {group_size}; "
            f"use a group_size that divides {world_size}, or 0 for the whole world"
        )
    mine = None
    for start in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
