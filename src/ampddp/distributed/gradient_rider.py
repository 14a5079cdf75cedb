"""A few numbers summed over the DDP ranks in the all-reduce of one gradient bucket, not in one of their own.

The Trainer agrees two flags every step (a stop signal came, the loss is not finite) before anyone steps. Over gloo
each collective is a round trip through every rank's communication thread: on two CPU processes (Intel Xeon with
AMX, 2 cores) a second all-reduce cost 0.6-0.9 ms a step, more than the whole step of a small model
(``benchmarks/peers.py``'s ``tiny`` groups). So the flags ride the gradients: a DDP communication hook appends them to
the smallest bucket it all-reduces (its size known from the backward before; a copy of that bucket, so only up to
``RIDES_UP_TO_BYTES``; where it is larger, ``board`` says so and the caller sends them on their own before the backward)
and reads them back when that bucket lands.

A Python hook gives up DDP's division fused into its copy of the gradients into the buckets; a pass of its own to
divide cost 3.6-4.5 ms of CPU a step on an MLP with 13.6 MB of gradients (same machine), more than the round trip it
saves. So where the caller weights each rank's loss by its share of the global batch already (``summing``: the
Trainer's steps), the hook sums and does not divide; any other backward through the wrapper is averaged as DDP
averages. Either way the trained weights are DDP's own: bit-equal for a power-of-two number of ranks.

Only over gloo (NCCL's all-reduces of a few bytes cost microseconds), on a wrapper the Trainer's strategy made without a
hook of its own (a user's or ``comm_hook`` compression keeps its hook, and the flags their all-reduce).
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ampddp.torch_compat import logged_comm_hook

RIDES_UP_TO_BYTES = 2 * 1024 * 1024
"""The largest bucket the flags ride: the hook copies it once to append them (a bucket of 1.2 MB, a few layers of a
small GPT, 0.1 ms on an Intel Xeon with AMX; DDP's buckets after its first are 25 MiB)."""


class GradientRider:
    """Values boarded before a backward, summed over ``group`` with one of its gradient buckets, read after it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ranks = dist.get_world_size(group)
        self._boarded: torch.Tensor | None = None
        self._landed: torch.Tensor | None = None
        self._summing = False
        self._bucket_bytes: dict[int, int] = {}
        self._seat: int | None = None

    def board(self, values: torch.Tensor) -> bool:
        """Send ``values`` (a flat tensor, each a non-negative count) with the next synced backward's smallest bucket;
        every rank must board the same number of values before the same backward. False, and nothing boarded, where
        the last backward's smallest bucket was over ``RIDES_UP_TO_BYTES``: the same answer on every rank, whose caller
        then sums them in an all-reduce of their own, started before the backward so that it travels while it computes
        (boarding anyway would leave that all-reduce until after it)."""
        self._landed = None
        # DDP lays its buckets out alike on every rank, and every rank's hook sees them in index order: the same seat.
        sizes = self._bucket_bytes
        self._seat = min(sizes, key=lambda index: (sizes[index], index)) if sizes else 0
        if sizes and sizes[self._seat] > RIDES_UP_TO_BYTES:
            self._boarded = None
            return False
        self._boarded = values.detach().flatten()
        return True

    def landed(self) -> torch.Tensor | None:
        """The boarded values summed over the ranks once that backward ran (None: no bucket took them, e.g. no backward
        synced since they boarded, or its smallest bucket was over ``RIDES_UP_TO_BYTES``; then no rank's did, and a
        caller agrees them otherwise)."""
        landed, self._landed = self._landed, None
        return landed

    @contextlib.contextmanager
    def summing(self) -> Iterator[None]:
        """Inside, the backward's gradients are summed over the ranks, not averaged: the caller weighted each rank's loss
        by its share of the global batch (its samples over all ranks' samples), so there is nothing to divide."""
        self._summing = True
        try:
            yield
        finally:
            self._summing = False

    def _take(self, index: int, nbytes: int) -> torch.Tensor | None:
        if index == 0:  # a backward's first bucket: DDP may have laid them out anew since (it does after its first)
            self._bucket_bytes = {}
        self._bucket_bytes[index] = nbytes
        if self._boarded is None or index != self._seat or nbytes > RIDES_UP_TO_BYTES:
            return None
        boarded, self._boarded = self._boarded, None
        return boarded

    def _arrived(self, values: torch.Tensor) -> None:
        self._landed = values


def _gradients_with_riders(rider: GradientRider, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket summed over the ranks (averaged, as DDP does, unless the rider is ``summing``), the smallest one
    carrying what boarded.

    The values ride in the bucket's dtype: counts of ranks, exact in bf16 and fp16 up to 256 and 2048 ranks, and above
    zero whenever any rank's is. Started on the group itself (a sum), not through ``dist.all_reduce``, whose checks
    add 10-15 us to every bucket's 22 us start (two gloo processes, an Intel Xeon with AMX)."""
    buffer = bucket.buffer()
    if not rider._summing:
        buffer.mul_(1.0 / rider.ranks)  # as DDP multiplies each gradient into its bucket when no hook is registered
    boarded = rider._take(bucket.index(), buffer.numel() * buffer.element_size())
    if boarded is None:
        return rider.group.allreduce([buffer]).get_future().then(_only_tensor)
    size = buffer.numel()
    joined = torch.cat([buffer, boarded.to(device=buffer.device, dtype=buffer.dtype)])

    def unpack(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = future.value()[0]
        rider._arrived(summed[size:])
        return summed[:size]

    return rider.group.allreduce([joined]).get_future().then(unpack)


def _only_tensor(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return future.value()[0]


def ride_gradients(wrapper: DistributedDataParallel) -> GradientRider | None:
    """A rider on ``wrapper``'s gradient all-reduce: the one it carries already, or a new one where the wrapper runs over
    gloo with no communication hook (DDP takes one hook, once); None otherwise."""
    for hook, state in getattr(wrapper, "_comm_hooks", ()):
        if hook is _gradients_with_riders:
            return state
    group = getattr(wrapper, "process_group", None)
    if group is None or dist.get_backend(group) != "gloo" or getattr(wrapper, "_comm_hooks", None) or logged_comm_hook(wrapper):
        return None
    rider = GradientRider(group)
    wrapper.register_comm_hook(rider, _gradients_with_riders)
    return rider
