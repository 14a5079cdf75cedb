"""A few numbers summed over the DDP ranks in the all-reduce of the gradients' first bucket, not in one of their own.

The Trainer agrees two flags every step (a stop signal came, the loss is not finite) before anyone steps. Over gloo
each collective is a round trip through every rank's communication thread: on two CPU processes (Intel Xeon with
AMX, 2 cores) a second all-reduce cost 0.6-0.9 ms a step, more than the whole step of a small model
(``benchmarks/peers.py``'s ``tiny`` groups). So the flags ride the gradients: a DDP communication hook appends them to
the first bucket it all-reduces and reads them back when that bucket lands. It averages the gradients as DDP does
(each rank's share multiplied by 1/ranks, then summed), so the trained weights are DDP's own.

Only where that pays: over gloo, for a model whose gradients fit DDP's first bucket (1 MiB), on a wrapper the
Trainer's strategy made without a hook of its own (a user's or ``comm_hook`` compression keeps its hook, and the flags
their all-reduce). A Python hook gives up DDP's division fused into the gradients' copy, so it divides in one more pass
over them: on 2 CPU processes (Intel Xeon with AMX, 2 cores), 3.6-4.5 ms of CPU a step on an MLP with 13.6 MB of
gradients, more than the round trip it saves; NCCL's all-reduces of a few bytes cost microseconds.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ampddp.torch_compat import logged_comm_hook

RIDES_UP_TO_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES
"""The gradients' size up to which the flags ride them: DDP's first bucket (1 MiB), which the hook then copies once."""


class GradientRider:
    """Values boarded before a backward, summed over ``group`` with its first gradient bucket, read after it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ranks = dist.get_world_size(group)
        self._boarded: torch.Tensor | None = None
        self._landed: torch.Tensor | None = None

    def board(self, values: torch.Tensor) -> None:
        """Send ``values`` (a flat tensor, each a non-negative count) with the next synced backward's first bucket; every
        rank must board the same number of values before the same backward."""
        self._boarded, self._landed = values.detach().flatten(), None

    def landed(self) -> torch.Tensor | None:
        """The boarded values summed over the ranks once that backward ran (None: no bucket took them, e.g. no backward
        synced since they boarded; then no rank's did, and a caller agrees them otherwise)."""
        landed, self._landed = self._landed, None
        return landed

    def _take(self) -> torch.Tensor | None:
        boarded, self._boarded = self._boarded, None
        return boarded

    def _arrived(self, values: torch.Tensor) -> None:
        self._landed = values


def _gradients_with_riders(rider: GradientRider, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's average of ``bucket`` (every rank's gradients times 1/ranks, summed), the first bucket carrying what boarded.

    The values ride in the bucket's dtype: counts of ranks, exact in bf16 and fp16 up to 256 and 2048 ranks, and above
    zero whenever any rank's is."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / rider.ranks)  # as DDP multiplies each gradient into its bucket when no hook is registered
    boarded = rider._take() if bucket.index() == 0 else None
    if boarded is None:
        return dist.all_reduce(buffer, group=rider.group, async_op=True).get_future().then(_only_tensor)
    size = buffer.numel()
    joined = torch.cat([buffer, boarded.to(device=buffer.device, dtype=buffer.dtype)])

    def unpack(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = future.value()[0]
        rider._arrived(summed[size:])
        return summed[:size]

    return dist.all_reduce(joined, group=rider.group, async_op=True).get_future().then(unpack)


def _only_tensor(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return future.value()[0]


def ride_gradients(wrapper: DistributedDataParallel) -> GradientRider | None:
    """A rider on ``wrapper``'s gradient all-reduce: the one it carries already, or a new one where the wrapper runs over
    gloo with no communication hook (DDP takes one hook, once) and its gradients fit ``RIDES_UP_TO_BYTES``; None
    otherwise."""
    for hook, state in getattr(wrapper, "_comm_hooks", ()):
        if hook is _gradients_with_riders:
            return state
    group = getattr(wrapper, "process_group", None)
    if group is None or dist.get_backend(group) != "gloo" or getattr(wrapper, "_comm_hooks", None) or logged_comm_hook(wrapper):
        return None
    if sum(p.numel() * p.element_size() for p in wrapper.module.parameters() if p.requires_grad) > RIDES_UP_TO_BYTES:
        return None
    rider = GradientRider(group)
    wrapper.register_comm_hook(rider, _gradients_with_riders)
    return rider
