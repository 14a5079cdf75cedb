"""DDP wrappers built before a set-up changed their model's parameter dtypes keep reducing gradients.

apex's documented order is ``amp.initialize`` and then DDP, but libraries wrap first and pass
``ddp.module`` to ``initialize`` later (mmengine's ApexOptimWrapper). An opt level that casts the model
(O2/O3/O5) changes each parameter's dtype in place, which leaves the wrapper hooked to accumulators
that no longer exist: without a rebuild no gradient is all-reduced and ranks train apart silently.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.torch_compat import rebuild_ddp_reducer

logger = logging.getLogger("ampddp.distributed")


def param_dtypes(models: Sequence[nn.Module]) -> list[torch.dtype]:
    """Every parameter's dtype, in order: compared before and after a set-up to see whether it cast."""
    return [param.dtype for model in models for param in model.parameters()]


def wrappers_around(models: Sequence[nn.Module]) -> list[DistributedDataParallel]:
    """The DDP wrappers (torch's and subclasses: apex's, mmengine's) whose ``module`` is one of ``models``.

    A wrapper keeps no mark on the module it wraps, so this scans the live objects once; it runs only
    when a process group is up (no DDP can exist otherwise).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    wanted = {id(model) for model in models}
    return [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), DistributedDataParallel) and id(obj.__dict__.get("_modules", {}).get("module")) in wanted
    ]


def rehook_wrappers_after_cast(models: Sequence[nn.Module]) -> int:
    """Rebuild the reducer of every DDP wrapper around ``models``; returns how many were rebuilt."""
    wrappers = wrappers_around(models)
    for wrapper in wrappers:
        rebuild_ddp_reducer(wrapper)
    if wrappers:
        logger.info("re-hooked %d DistributedDataParallel wrapper(s) built before the model's parameters changed dtype", len(wrappers))
    return len(wrappers)
