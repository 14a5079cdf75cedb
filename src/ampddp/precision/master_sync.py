"""Keep fp32 masters in step with a model that was written after set-up, on every rank.

apex's documented order is ``amp.initialize`` and then ``DistributedDataParallel``, whose
constructor broadcasts rank 0's (already low-precision) weights into the model. Masters taken at
``initialize`` from each rank's own fp32 weights would then disagree between ranks and the ranks
would train apart. At each optimizer's first step, a master whose model param was overwritten since
set-up takes the model's value; and when the model runs inside a DDP wrapper (seen at its forward),
the ranks of that wrapper's process group agree (one tiny all-reduce) whether any of them was
overwritten — if so, the group's first rank's exact masters are broadcast and every model takes them.
Without DDP there is no collective: ranks that train independent models stay independent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.precision.master import OptimizerGrads

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Same bucket size DDP uses for its start-up broadcast."""


def active_ddp(module: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper whose forward is running ``module`` now, or None."""
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = active() if active is not None else None
    return ddp if ddp is not None and ddp.module is module else None


class DdpForwards:
    """A forward pre-hook on a set-up's models: the DDP wrapper they run in. Its group serves the masters'
    first-step agreement; ``under_no_sync`` says the last forward ran under the wrapper's ``no_sync``, so
    its backward all-reduces nothing and its gradients must wait, scaled, for the synchronising one."""

    def __init__(self) -> None:
        self.group: Any = None
        self.under_no_sync = False

    def __call__(self, module: nn.Module, args: Any) -> None:
        ddp = active_ddp(module)
        self.under_no_sync = ddp is not None and not ddp.require_backward_grad_sync
        if self.group is None and ddp is not None:
            self.group = ddp.process_group

    def __deepcopy__(self, memo: dict[int, Any]) -> DdpForwards:
        """A deep copy of a set-up model (an EMA copy) shares its engine's hooks."""
        return self


def reconcile_masters(record: OptimizerGrads, ddp_group: Any = None) -> None:
    """Masters follow model writes made since set-up; within a DDP group, everybody takes its first rank's."""
    if not record.masters:
        return
    changed = record.adopt_model_writes()
    if ddp_group is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(ddp_group) <= 1:
        return
    flag = torch.tensor([1.0 if changed else 0.0], device=record.masters[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ddp_group)
    if flag.item() == 0:
        return
    dist._broadcast_coalesced(ddp_group, [master.data for master in record.masters], BROADCAST_BUCKET_BYTES, 0)
    record.copy_master_values_to_model()
