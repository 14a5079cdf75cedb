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

from ampddp.errors import AmpUsageError
from ampddp.torch_compat import rebuild_ddp_reducer

logger = logging.getLogger("ampddp.distributed")


def param_dtypes(models: Sequence[nn.Module]) -> list[torch.dtype]:
    """Every parameter's dtype, in order: compared before and after a set-up to see whether it cast."""
    return [param.dtype for model in models for param in model.parameters()]


def wrappers_around(models: Sequence[nn.Module]) -> list[nn.Module]:
    """The wrapper modules (DDP and subclasses: apex's, mmengine's; DeepSpeed's engine) whose ``module``
    is one of ``models``.

    A wrapper keeps no mark on the module it wraps, so this scans the live objects once; it runs only
    when a process group is up (no data-parallel wrapper can exist otherwise).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    wanted = {id(model) for model in models}
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):
            children = obj.__dict__.get("_modules") or {}
            if "module" in children and id(children["module"]) in wanted:
                found.append(obj)
    return found


def is_deepspeed_engine(wrapper: nn.Module) -> bool:
    return any(cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed.") for cls in type(wrapper).__mro__)


def refuse_model_grad_reduction_with_masters(models: Sequence[nn.Module]) -> None:
    """DeepSpeed's ``"amp"`` section all-reduces the *model's* gradients after ``scale_loss``; with fp32
    masters (O2/O5) the optimizer steps the masters' gradients, taken before that reduction, so ranks
    would train apart silently (with apex too). Refused before anything is changed."""
    engines = [w for w in wrappers_around(models) if is_deepspeed_engine(w)]
    if engines and dist.get_world_size() > 1:
        raise AmpUsageError(
            'DeepSpeed\'s "amp" section with fp32 master weights (O2/O5) on several ranks would train them apart: DeepSpeed '
            "all-reduces the model's gradients after amp has already taken the masters' gradients from them. Use "
            '"opt_level": "O1" (or O4, O3) in the "amp" section, or DeepSpeed\'s own "fp16"/"bf16" sections'
        )


def rehook_wrappers_after_cast(models: Sequence[nn.Module]) -> int:
    """Rebuild the reducer of every DDP wrapper around ``models``; returns how many were rebuilt."""
    wrappers = [w for w in wrappers_around(models) if isinstance(w, DistributedDataParallel)]
    for wrapper in wrappers:
        rebuild_ddp_reducer(wrapper)
    if wrappers:
        logger.info("re-hooked %d DistributedDataParallel wrapper(s) built before the model's parameters changed dtype", len(wrappers))
    return len(wrappers)
