"""apex.parallel on native torch: DistributedDataParallel, Reducer, SyncBatchNorm, LARC and helpers.

apex deleted ``apex.parallel`` in May 2025, yet apex-era scripts still do
``from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model`` and
``from apex.parallel.LARC import LARC``. These are apex's names and signatures built on torch's
DistributedDataParallel and ampddp's portable SyncBatchNorm, so they run on CPU/gloo as well as CUDA.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ampddp.apex._names import unknown_name
from ampddp.apex.parallel.distributed import DistributedDataParallel, Reducer
from ampddp.apex.parallel.LARC import LARC
from ampddp.apex.parallel.sync_batchnorm import SyncBatchNorm
from ampddp.distributed.sync_bn import replace_batchnorms
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


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm (``_BatchNorm``; InstanceNorm is left alone) with :class:`SyncBatchNorm`.

    The new layers hold the old ones' weight and bias Parameters themselves (so an optimizer built
    before the conversion still steps them), running statistics, ``num_batches_tracked`` and
    training flag. Returns the converted module (the same object unless ``module`` is a BatchNorm).
    """

    def build(bn: _BatchNorm) -> SyncBatchNorm:
        return SyncBatchNorm(
            bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group, channel_last=channel_last
        )

    return replace_batchnorms(module, build, SyncBatchNorm)


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
