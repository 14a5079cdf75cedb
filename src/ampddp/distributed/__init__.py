"""Data-parallel training: process-group environment, wrapping, SyncBN, sharding and launching."""

import ampddp.torch_compat  # noqa: F401  (first: it refuses a torch older than ampddp supports)
from ampddp.choices import COMM_HOOKS, STRATEGIES
from ampddp.distributed.data import (
    EvalShardSampler,
    ResumableSampler,
    all_gather_ragged,
    barrier,
    eval_sampler,
    gather_in_order,
    print_main,
    shard_bounds,
    sum_across_ranks,
)
from ampddp.distributed.env import DistEnv, detect_env, init_distributed, seed_everything, setup_distributed, shutdown_distributed
from ampddp.distributed.fsdp2 import FSDPOptions
from ampddp.distributed.launch import LaunchError, free_port, launch_local
from ampddp.distributed.parallel import Parallel
from ampddp.distributed.portable_sync_bn import PortableSyncBatchNorm
from ampddp.distributed.strategies import STRATEGY_TABLE, Strategy, wrap_model
from ampddp.distributed.sync_bn import convert_sync_batchnorm
from ampddp.distributed.watch import PeerFailureError, PeerWatch
from ampddp.distributed.wrap import DDPOptions, GradSync, global_batch_loss_weight, unwrap_model

__all__ = [
    "COMM_HOOKS",
    "STRATEGIES",
    "STRATEGY_TABLE",
    "DDPOptions",
    "DistEnv",
    "FSDPOptions",
    "EvalShardSampler",
    "GradSync",
    "LaunchError",
    "Parallel",
    "PeerFailureError",
    "PeerWatch",
    "PortableSyncBatchNorm",
    "ResumableSampler",
    "Strategy",
    "all_gather_ragged",
    "barrier",
    "convert_sync_batchnorm",
    "detect_env",
    "eval_sampler",
    "free_port",
    "gather_in_order",
    "global_batch_loss_weight",
    "init_distributed",
    "launch_local",
    "print_main",
    "seed_everything",
    "setup_distributed",
    "shard_bounds",
    "shutdown_distributed",
    "sum_across_ranks",
    "unwrap_model",
    "wrap_model",
]
