"""The global gradient norm, and clipping by it, over gradients held on any number of device meshes.

torch's ``clip_grad_norm_`` stacks the per-tensor norms into one tensor and scales every gradient with one
foreach call, which DTensor refuses across meshes (FSDP2 x tensor parallelism leaves a parameter on the 1-D
data-parallel mesh beside ones on the 2-D mesh). Here the gradients are grouped by mesh (plain tensors are a
group of their own), each group's norm is taken whole (a collective over its mesh), and the norm of those
norms is the global one, the same on every rank. One group is torch's own computation, step for step. Where the
model's parameters are split into disjoint parts over ranks as plain tensors (a pipeline's stages), ``across`` names
those ranks: their norms combine into the model's (one all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampddp.torch_compat import is_dtensor


def whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm over sharded (FSDP2) gradients comes back as a DTensor: its value as a plain tensor."""
    return norm.full_tensor() if is_dtensor(norm) else norm


def by_mesh(params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` with gradients, grouped by their gradients' device mesh (plain tensors: one group), in first-seen
    order, which is the same on every rank: each group's norm is a collective over its mesh."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(param.grad.device_mesh if is_dtensor(param.grad) else None, []).append(param)
    return list(groups.values())


def _group_norms(groups: list[list[nn.Parameter]], norm_type: float) -> list[torch.Tensor]:
    return [torch.nn.utils.get_total_norm([param.grad for param in group], norm_type=norm_type, foreach=True) for group in groups]


def _combined(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The global norm from the groups' norms (a p-norm of p-norms; the largest for the inf-norm)."""
    if len(norms) == 1:
        return norms[0]
    return torch.nn.utils.get_total_norm([whole(norm) for norm in norms], norm_type=norm_type, foreach=True)


def _across(norm: torch.Tensor, norm_type: float, across: Any) -> torch.Tensor:
    """``norm`` (this rank's part's) combined with the other parts' over the ranks of ``across`` (None: it is whole)."""
    if across is None:
        return norm
    import torch.distributed as dist

    if math.isinf(norm_type):
        combined = norm.clone()
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=across)
        return combined
    powered = norm.double() ** norm_type
    dist.all_reduce(powered, group=across)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)


def _local_norm(groups: list[list[nn.Parameter]], norm_type: float, device: torch.device | None) -> torch.Tensor:
    if not groups:
        return torch.zeros((), device=device)
    return whole(_combined(_group_norms(groups, norm_type), norm_type))


def total_norm(params: Sequence[nn.Parameter], norm_type: float = 2.0, across: Any = None) -> torch.Tensor:
    """The norm of every gradient of ``params`` taken as one vector, whole (a plain tensor); ``across``: the ranks
    holding the model's other parts (a pipeline's stages), whose gradients count too."""
    groups = by_mesh(params)
    if not groups and across is None:
        return torch.nn.utils.get_total_norm([], norm_type=norm_type, foreach=True)
    return _across(_local_norm(groups, norm_type, _device(params)), norm_type, across)


def clip_total_norm_(params: Sequence[nn.Parameter], max_norm: float, norm_type: float = 2.0, across: Any = None) -> torch.Tensor:
    """Scale the gradients of ``params`` so that the global norm (``across`` the ranks holding the model's other parts
    too) is at most ``max_norm``; the norm before, whole."""
    groups = by_mesh(params)
    if not groups and across is None:
        return torch.nn.utils.clip_grad_norm_([], max_norm, norm_type=norm_type, foreach=True)
    if across is None:
        norm = _combined(_group_norms(groups, norm_type), norm_type)
    else:
        norm = _across(_local_norm(groups, norm_type, _device(params)), norm_type, across)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return whole(norm)


def _device(params: Sequence[nn.Parameter]) -> torch.device | None:
    return next((param.device for param in params), None)
