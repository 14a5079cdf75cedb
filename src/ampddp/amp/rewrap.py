"""Data-parallel wrappers built before a set-up changed their model's parameters.

apex's documented order is ``amp.initialize`` and then DDP, but libraries wrap first and pass
``ddp.module`` (or parts of it) to ``initialize`` later (mmengine's ApexOptimWrapper). An opt level
that casts the model (O2/O3/O5) changes each parameter's dtype in place, which leaves a DDP wrapper
hooked to accumulators that no longer exist: without a rebuild no gradient is all-reduced and ranks
train apart silently. DeepSpeed's ``"amp"`` section all-reduces the model's gradients itself, after
fp32 masters (O2/O5) already took theirs: refused. Everything is checked before anything changes.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.errors import AmpUsageError
from ampddp.torch_compat import ddp_rebuild_problem, rebuild_ddp_reducer

logger = logging.getLogger("ampddp.distributed")


def is_deepspeed_engine(wrapper: nn.Module) -> bool:
    return any(cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed.") for cls in type(wrapper).__mro__)


@dataclass
class Wrappers:
    """The data-parallel wrappers around some models: torch DDP (and subclasses: apex's, mmengine's) and DeepSpeed engines."""

    ddp: list[DistributedDataParallel] = field(default_factory=list)
    deepspeed: list[nn.Module] = field(default_factory=list)

    def check(self, casts_params: bool, steps_fp32_masters: bool) -> None:
        """Raise, before any change, for a wrapper the coming set-up would leave reducing the wrong gradients."""
        if steps_fp32_masters and self.deepspeed and dist.get_world_size() > 1:
            raise AmpUsageError(
                'DeepSpeed\'s "amp" section with fp32 master weights (O2/O5) on several ranks would train them apart: DeepSpeed '
                "all-reduces the model's gradients after amp has already taken the masters' gradients from them. Use "
                '"opt_level": "O1" (or O4, O3) in the "amp" section, or DeepSpeed\'s own "fp16"/"bf16" sections'
            )
        if casts_params:
            for wrapper in self.ddp:
                problem = ddp_rebuild_problem(wrapper)
                if problem is not None:
                    raise AmpUsageError(
                        f"the model is already wrapped in {type(wrapper).__name__}, and this opt level changes its parameters' "
                        f"dtype, which leaves the wrapper reducing nothing; it cannot be re-hooked ({problem}): call "
                        "amp.initialize before wrapping the model"
                    )

    def rehook_after_cast(self) -> None:
        """Rebuild every DDP wrapper's reducer for the parameters' new dtypes."""
        for wrapper in self.ddp:
            rebuild_ddp_reducer(wrapper)
        if self.ddp:
            logger.info("re-hooked %d DistributedDataParallel wrapper(s) built before the model's parameters changed dtype", len(self.ddp))


def wrappers_around(models: Sequence[nn.Module]) -> Wrappers:
    """The DDP wrappers and DeepSpeed engines whose wrapped module is, or contains, one of ``models``.

    A wrapper keeps no mark on the module it wraps, so this scans the live objects once; it runs only
    when a process group is up (no data-parallel wrapper can exist otherwise).
    """
    found = Wrappers()
    if not models or not (dist.is_available() and dist.is_initialized()):
        return found
    wanted = {id(model) for model in models}
    for obj in gc.get_objects():
        is_ddp = issubclass(type(obj), DistributedDataParallel)
        if not (is_ddp or (issubclass(type(obj), nn.Module) and is_deepspeed_engine(obj))):
            continue
        wrapped = (obj.__dict__.get("_modules") or {}).get("module")
        if isinstance(wrapped, nn.Module) and any(id(module) in wanted for module in wrapped.modules()):
            (found.ddp if is_ddp else found.deepspeed).append(obj)
    return found
