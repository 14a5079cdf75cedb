"""Sharding that counts every sample once, ragged all-gather, and rank-0 helpers.

``DistributedSampler`` pads the last round by repeating indices, so metrics computed over its
shards count some samples twice (pytorch 25162, torchvision 4559). Evaluation here uses contiguous,
unpadded shards instead, and gathers results back in dataset order. Training uses
``ResumableSampler``: one global order per epoch that can resume mid-epoch on any world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler, SequentialSampler

from ampddp.distributed.env import DistEnv
from ampddp.distributed.mesh import DataShard

DataPlace = DistEnv | DataShard
"""Where a rank reads data: a ``DataShard`` (its data-parallel coordinates), or a ``DistEnv`` whose
every rank is a data rank (data parallelism alone)."""


def data_shard(place: DataPlace) -> DataShard:
    """``place`` as data coordinates."""
    return place if isinstance(place, DataShard) else DataShard.of(place)


def shard_bounds(length: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard; shard sizes differ by at most one, none padded."""
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class EvalShardSampler(Sampler[int]):
    """Contiguous, unpadded shard of a dataset for evaluation: every index on exactly one rank."""

    def __init__(self, dataset: Sized, place: DataPlace) -> None:
        shard = data_shard(place)
        self.start, self.end = shard_bounds(len(dataset), shard.rank, shard.size)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class ResumableSampler(Sampler[int]):
    """Training order that can resume mid-epoch, on any number of ranks, without skips or repeats.

    Epoch ``e`` has one global order (a permutation seeded by ``seed + e``). ``set_epoch(e, start)``
    drops the first ``start`` samples of it (those consumed before a resume), pads the rest to a
    multiple of the world size by repeating its last samples (or trims it with ``drop_last``), and
    gives rank r every world_size-th sample from r. Ranks consume the order front to back, so the
    consumed part is always a prefix, whatever the world size before and after. The ranks and world
    are the data-parallel ones of ``place`` (ranks of one model-parallel group read the same samples).
    """

    def __init__(self, dataset: Sized, place: DataPlace, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        self.length = len(dataset)
        shard = data_shard(place)
        self.rank, self.world_size = shard.rank, shard.size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def _remaining(self) -> list[int]:
        order = self._order()
        remaining = order[self.start :]
        if self.drop_last:
            return remaining[: len(remaining) - len(remaining) % self.world_size]
        pad = -len(remaining) % self.world_size
        while pad and remaining:
            remaining += remaining[-pad:]
            pad = -len(remaining) % self.world_size
        return remaining

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.world_size])

    def __len__(self) -> int:
        return self.samples_per_rank()

    def samples_per_rank(self, start: int | None = None) -> int:
        """Samples each rank gets in an epoch begun at ``start`` (default: the current epoch's start)."""
        left = max(self.length - (self.start if start is None else start), 0)
        return left // self.world_size if self.drop_last else -(-left // self.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}


def eval_sampler(dataset: Sized, place: DataPlace) -> Sampler[int]:
    """Each data rank's contiguous, unpadded shard of ``dataset`` (the whole of it for one)."""
    return EvalShardSampler(dataset, place) if data_shard(place).distributed else SequentialSampler(dataset)


def all_gather_ragged(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """All-gather tensors whose first dimension differs per rank; returns one tensor per rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [tensor]
    world = dist.get_world_size(group)
    size = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = tensor.new_zeros((max(lengths), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return [part[:length] for part, length in zip(gathered, lengths)]


def gather_in_order(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's rows in rank order: with EvalShardSampler that is dataset order."""
    return torch.cat(all_gather_ragged(tensor, group))


def sum_across_ranks(value: torch.Tensor | float, group: Any = None) -> torch.Tensor:
    """Sum a number or tensor over ranks (identity in a single process)."""
    tensor = torch.as_tensor(value, dtype=torch.float64).clone()
    if dist.is_available() and dist.is_initialized():
        backend_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        tensor = tensor.to(backend_device)
        dist.all_reduce(tensor, group=group)
    return tensor.cpu()


class PendingSum:
    """``values`` summed over ranks, the all-reduce started now and awaited at the first ``result()``:
    work the caller does meanwhile (a forward) hides its latency. Identity in a single process, and
    where ``reduce`` is False (a sum every rank already knows: then no tensor is made, as a step asks
    for one every time)."""

    def __init__(self, values: torch.Tensor | list[float], group: Any = None, reduce: bool = True) -> None:
        self._in_flight: tuple[Any, torch.Tensor] | None = None
        if not (reduce and dist.is_available() and dist.is_initialized()):
            # tolist() gives Python floats of any floating dtype, exactly (an fp32, bf16 or fp16 value is a double).
            self._result = values.tolist() if isinstance(values, torch.Tensor) else [float(value) for value in values]
            return
        self._result = []
        backend_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        tensor = torch.as_tensor(values, dtype=torch.float64).to(backend_device, copy=True)
        self._in_flight = dist.all_reduce(tensor, group=group, async_op=True), tensor

    def result(self) -> list[float]:
        """The summed values, on the host."""
        if self._in_flight is not None:
            work, tensor = self._in_flight
            work.wait()
            self._result, self._in_flight = tensor.tolist(), None
        return self._result


def broadcast_from_main(value: Any, env: DistEnv) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object; identity in a single process)."""
    if not env.distributed or not (dist.is_available() and dist.is_initialized()):
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(value: Any, env: DistEnv) -> list[Any]:
    """Every rank's ``value`` (picklable) on every rank, in rank order (``[value]`` in a single process)."""
    if not env.distributed or not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def barrier(group: Any = None) -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def print_main(env: DistEnv, *args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only."""
    if env.is_main:
        print(*args, **kwargs)
