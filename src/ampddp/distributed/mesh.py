"""``ParallelDims``: the run's ranks as one named device mesh, built once, and each rank's data coordinates.

Data, tensor and pipeline parallelism compose on one mesh whose dimensions are named, outer to inner,
``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (torchtitan's order: the innermost dimension's ranks are
the closest, so tensor parallelism's frequent collectives stay inside a node). The sizes are checked
once, every factor named when they do not multiply to the world size; the ``DeviceMesh`` is made on
first use and sliced by name (FSDP2 takes ``dp_shard``, HSDP ``dp_replicate`` x ``dp_shard``).

Whatever shards data, counts samples, weights the loss or compares replicas asks for the rank's
**data coordinates** (``DataShard``: its data-parallel rank and the number of data-parallel ranks),
never the global rank: the ranks of one tensor-parallel group must read the same batch, and under
pipeline parallelism only one stage reads inputs. With data parallelism alone the two coincide.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from ampddp.distributed.env import DistEnv
from ampddp.errors import ConfigError

DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outer to inner."""


@dataclass(frozen=True)
class DataShard:
    """Where a rank reads data: its data-parallel ``rank`` among ``size`` data-parallel ranks (ranks
    that differ only in an inner model-parallel coordinate share one), and ``group``, the process group
    of those ranks that sample counts and evaluation sums add up over (None: the default group, every
    rank)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"data shard {self.rank} of {self.size} is not valid; it needs 0 <= rank < size, size >= 1")

    @property
    def distributed(self) -> bool:
        """Whether more than one rank reads data (then samples are counted across them)."""
        return self.size > 1

    @classmethod
    def of(cls, env: DistEnv) -> DataShard:
        """Every rank of ``env`` a data rank of its own (data parallelism alone)."""
        return cls(env.rank, env.world_size)


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the mesh's dimensions (``DIMENSIONS``) over ``world_size`` ranks on ``device_type``."""

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("world_size", *DIMENSIONS):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel dimension {name}={value!r} is not valid; it must be an integer >= 1")
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            factors = " x ".join(f"{name} {getattr(self, name)}" for name in DIMENSIONS)
            raise ConfigError(f"the parallel dimensions {factors} make {product} ranks, but the world has {self.world_size}: "
                              "choose sizes that multiply to the number of processes")  # fmt: skip

    @classmethod
    def data_parallel(cls, env: DistEnv, replicas: int | None = None, tp: int = 1) -> ParallelDims:
        """Data parallelism over ``env``'s ranks: replicated (DDP: ``replicas`` None, every rank a replica), or
        sharded (FSDP2: ``replicas`` 1; HSDP: ``replicas`` sharded groups), each data rank's model split over
        ``tp`` ranks (tensor parallelism, the innermost dimension)."""
        if replicas is None:
            return cls(env.world_size, dp_replicate=env.world_size, device_type=env.device.type)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or env.world_size % tp:
            raise ConfigError(f"tp_size={tp!r} does not divide the world of {env.world_size} rank(s); choose a tp_size that "
                              "divides the number of processes")  # fmt: skip
        data_ranks = env.world_size // tp
        if replicas < 1 or data_ranks % replicas:
            raise ConfigError(f"{replicas} replica(s) do not divide the {data_ranks} data-parallel rank(s) of a world of "
                              f"{env.world_size} with tp_size={tp}")  # fmt: skip
        return cls(env.world_size, dp_replicate=replicas, dp_shard=data_ranks // replicas, tp=tp, device_type=env.device.type)

    def sizes(self) -> dict[str, int]:
        """Each dimension's size by name, outer to inner (what a checkpoint records of the layout that wrote it)."""
        return {name: getattr(self, name) for name in DIMENSIONS}

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: one per (dp_replicate, dp_shard) coordinate."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension (row-major, the innermost varying fastest)."""
        found, rest = {}, rank
        for name in reversed(DIMENSIONS):
            rest, found[name] = divmod(rest, getattr(self, name))
        return {name: found[name] for name in DIMENSIONS}

    def dp_rank(self, rank: int) -> int:
        """Global ``rank``'s data-parallel rank (its place among the ``dp_size`` data ranks)."""
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def data_shard(self, rank: int) -> DataShard:
        """Where global ``rank`` reads data (its data-parallel coordinates), with the group of the
        data-parallel ranks it belongs to (None when every rank is one: no mesh is needed then)."""
        return DataShard(self.dp_rank(rank), self.dp_size, self._data_group)

    @functools.cached_property
    def _data_group(self) -> Any:
        """The process group of the data-parallel ranks (flattened from the mesh once), None when every rank is one."""
        return None if self.dp_size == self.world_size else self.submesh("dp_replicate", "dp_shard")._flatten().get_group()

    @functools.cached_property
    def mesh(self) -> Any:
        """The device mesh over every rank, its dimensions named (made on first use, once: it needs the
        process group); a one-rank world is a mesh of one rank (FSDP2 on one process)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(self, name) for name in DIMENSIONS)
        try:
            return init_device_mesh(self.device_type, shape, mesh_dim_names=DIMENSIONS)
        except (RuntimeError, ValueError) as error:
            raise ConfigError(f"cannot build a device mesh of {dict(zip(DIMENSIONS, shape))} on {self.device_type}: {error}") from error

    def submesh(self, *names: str) -> Any:
        """The mesh sliced to the dimensions ``names`` (in mesh order), e.g. ``("dp_replicate", "dp_shard")``."""
        unknown = [name for name in names if name not in DIMENSIONS]
        if unknown or not names:
            raise ConfigError(f"mesh dimensions {names!r} are not valid; valid: {', '.join(DIMENSIONS)}")
        return self.mesh[names if len(names) > 1 else names[0]]
