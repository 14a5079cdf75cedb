"""The strategy and sync-BN tables hold exactly the names a recipe may choose (``choices``, which the
command line lists without importing torch), and apex's paths give the core's classes."""

from __future__ import annotations

from ampddp.choices import STRATEGIES, SYNC_BN_IMPLS
from ampddp.distributed.apex_ddp import DistributedDataParallel
from ampddp.distributed.apex_sync_bn import SyncBatchNorm
from ampddp.distributed.strategies import STRATEGY_TABLE
from ampddp.distributed.sync_bn import CONVERTERS


def test_every_strategy_name_has_a_strategy_and_every_strategy_a_name():
    assert tuple(STRATEGY_TABLE) == STRATEGIES
    assert all(strategy.name == name for name, strategy in STRATEGY_TABLE.items())


def test_every_sync_bn_name_but_auto_has_a_converter():
    assert set(CONVERTERS) == set(SYNC_BN_IMPLS) - {"auto"}


def test_apex_paths_give_the_core_classes():
    import ampddp.apex.parallel as parallel
    from ampddp.apex.parallel.distributed import DistributedDataParallel as FromSubmodule
    from ampddp.apex.parallel.optimized_sync_batchnorm import SyncBatchNorm as Optimized

    assert parallel.DistributedDataParallel is FromSubmodule is DistributedDataParallel
    assert parallel.SyncBatchNorm is Optimized is SyncBatchNorm
