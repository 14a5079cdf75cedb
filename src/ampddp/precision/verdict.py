"""The loss-scale verdict (skip this step or take it), agreed by every rank whose gradients can differ.

Each rank unscales its own gradients. Where ranks hold different gradients (FSDP2's shards, tensor-parallel
slices) their non-finite flags differ, and a rank that skips while another steps trains other weights, under
another loss scale, from then on, with no error. torch agreed the flag only as a side effect of DTensor's
dispatch, over the mesh of each (device, dtype) group's first gradient: with a parameter on a 1-D mesh beside
2-D ones, ranks 0 and 2 stepped while 1 and 3 skipped. So the engine agrees it itself, after unscaling and
before stepping, with one small MAX all-reduce over the group whoever set the engine up named
(``PrecisionEngine.agree_over``), as Megatron-LM, DeepSpeed and apex's model-parallel scaler do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampddp.errors import ConfigError
from ampddp.torch_compat import is_dtensor


def non_finite_flag(norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the gradient norm is inf or NaN, else 0.0 (a device tensor: read with the verdict, not now)."""
    return (~torch.isfinite(norm.detach())).float().reshape(1)


def agreed_flag(flags: Sequence[torch.Tensor], group: Any, device: torch.device | str) -> torch.Tensor:
    """One fp32 flag, non-zero when any of ``flags`` (this rank's found-inf flags and gradient-norm checks) is,
    taken as the MAX over ``group``'s ranks (None: this rank's alone). A rank without flags (no gradients)
    still joins the collective, with 0, on ``device``."""
    total = torch.zeros(1, dtype=torch.float32, device=flags[0].device if flags else device)
    for flag in flags:
        total.add_(flag.detach().reshape(1).to(total.device, torch.float32))
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    return total


def check_group(group: Any) -> None:
    """A process group (or None); ConfigError naming what was given otherwise."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ConfigError(
            f"agree_over({group!r}) is not valid: give the torch.distributed.ProcessGroup of every rank whose gradients can "
            "differ (dist.group.WORLD for FSDP2 and tensor parallelism), or None where they cannot (one process, DDP)"
        )


def group_for_sharded(params: Iterable[torch.Tensor]) -> Any:
    """The group a verdict over ``params`` must be agreed in: every rank (``dist.group.WORLD``) when any of them is
    a DTensor spread over more than one rank (a model the user parallelized over a device mesh: its ranks hold
    different gradients), else None. The world, not the parameters' meshes: one scalar costs the same, and every
    rank stepping together is never wrong."""
    spread = any(is_dtensor(param) and param.device_mesh.size() > 1 for param in params)
    return dist.group.WORLD if spread and dist.is_available() and dist.is_initialized() else None
