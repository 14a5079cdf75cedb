"""ParallelDims: the named mesh's sizes checked once (every factor named), each rank's coordinates and
data coordinates; with today's strategies every rank is a data rank of its own."""

from __future__ import annotations

import pytest

from ampddp import Parallel
from ampddp.distributed import DDPOptions
from ampddp.distributed.env import DistEnv
from ampddp.distributed.fsdp2 import FSDPOptions
from ampddp.distributed.mesh import DataShard, ParallelDims
from ampddp.errors import ConfigError


def test_sizes_that_do_not_make_the_world_are_refused_naming_every_factor():
    with pytest.raises(ConfigError, match=r"the parallel dimensions pp 2 x dp_replicate 1 x dp_shard 3 x tp 2 make 12 ranks, "
                                          r"but the world has 8: choose sizes"):  # fmt: skip
        ParallelDims(8, pp=2, dp_shard=3, tp=2)
    with pytest.raises(ConfigError, match=r"parallel dimension tp=0 is not valid; it must be an integer >= 1"):
        ParallelDims(4, tp=0)


def test_coordinates_run_row_major_and_model_parallel_ranks_share_their_data():
    dims = ParallelDims(8, pp=2, dp_shard=2, tp=2)
    assert dims.coordinates(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
    assert [dims.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1] and dims.dp_size == 2  # a tp pair reads one batch
    hybrid = ParallelDims(8, dp_replicate=2, dp_shard=4)
    assert [hybrid.dp_rank(rank) for rank in range(8)] == list(range(8)) and hybrid.data_shard(3) == DataShard(3, 8)


@pytest.mark.parametrize("strategy", ["ddp", "apex-ddp", "fsdp2", "hsdp", "none"])
def test_with_data_parallelism_alone_the_data_coordinates_are_the_global_rank_and_world(strategy):
    fsdp = FSDPOptions(shard_size=2) if strategy == "hsdp" else FSDPOptions()
    parallel = Parallel(strategy, fsdp=fsdp)
    for rank in range(4):
        env = DistEnv(rank=rank, world_size=4, local_world_size=4)
        shard = parallel.dims(env).data_shard(rank)
        assert (shard.rank, shard.size, shard.group) == (rank, 4, None) and shard == DataShard.of(env)


def test_each_strategy_holds_only_its_own_settings_and_refuses_another_strategys():
    assert Parallel("ddp", ddp=DDPOptions(static_graph=True)).plan.ddp.static_graph
    assert Parallel("fsdp2", fsdp=FSDPOptions(reshard_after_forward=False)).plan.fsdp.reshard_after_forward is False
    assert not hasattr(Parallel("fsdp2").plan, "ddp") and not hasattr(Parallel("ddp").plan, "fsdp")
    with pytest.raises(ConfigError, match=r"wrap_options \['x'\] do not apply to strategy none; the strategies with a wrapper take "
                                          r"them: ddp, apex-ddp, dp"):  # fmt: skip
        Parallel("none", wrap_options={"x": 1})
