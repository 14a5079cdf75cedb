"""The global gradient norm, and clipping by it, over gradients held on any number of device meshes.

torch's ``clip_grad_norm_`` stacks the per-tensor norms into one tensor and scales every gradient with one
foreach call, which DTensor refuses across meshes (FSDP2 x tensor parallelism leaves a parameter on the 1-D
data-parallel mesh beside ones on the 2-D mesh). Here the gradients are grouped by mesh (plain tensors are a
group of their own), each group's norm is taken whole (a collective over its mesh), and the norm of those
norms is the global one, the same on every rank. One group is torch's own computation, step for step.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def total_norm(params: Sequence[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every gradient of ``params`` taken as one vector, whole (a plain tensor)."""
    groups = by_mesh(params)
    if not groups:
        return torch.nn.utils.get_total_norm([], norm_type=norm_type, foreach=True)
    return whole(_combined(_group_norms(groups, norm_type), norm_type))


def clip_total_norm_(params: Sequence[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``; the norm before, whole."""
    groups = by_mesh(params)
    if not groups:
        return torch.nn.utils.clip_grad_norm_([], max_norm, norm_type=norm_type, foreach=True)
    norm = _combined(_group_norms(groups, norm_type), norm_type)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return whole(norm)
