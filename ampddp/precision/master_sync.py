"""Keep fp32 masters in step with a model that was written after set-up, on every rank.

apex's documented order is ``amp.initialize`` and then ``DistributedDataParallel``, whose
constructor broadcasts rank 0's (already low-precision) weights into the model. Masters taken at
``initialize`` from each rank's own fp32 weights would then disagree between ranks and the ranks
would train apart. At each optimizer's first step the ranks agree (one tiny all-reduce) whether any
rank's model was overwritten; if so rank 0's exact masters are broadcast and every model takes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ampddp.precision.master import OptimizerGrads

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Same bucket size DDP uses for its start-up broadcast."""


def reconcile_masters(record: OptimizerGrads) -> None:
    """Masters follow model writes made since set-up; across ranks, everybody takes rank 0's masters."""
    if not record.masters:
        return
    changed = record.adopt_model_writes()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    flag = torch.tensor([1.0 if changed else 0.0], device=record.masters[0].device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    dist._broadcast_coalesced(dist.group.WORLD, [master.data for master in record.masters], BROADCAST_BUCKET_BYTES, 0)
    record.copy_master_values_to_model()
