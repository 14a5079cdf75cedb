"""apex's ``apex_C`` extension: ``flatten`` and ``unflatten``, which apex-era scripts call directly.

NVIDIA's BERT all-reduces master gradients through one flat buffer: ``flat = apex_C.flatten(grads)``
or ``views = apex_C.unflatten(flat, grads)``. Here on plain torch ops, any device and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampddp.apex._names import unknown_name

__all__ = ["flatten", "unflatten"]

REPLACEMENTS: dict[str, str] = {}


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``tensors`` one after another (they must share a dtype and device)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("apex_C.flatten needs at least one tensor")
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"apex_C.flatten needs tensors of one dtype and device, got {sorted(str(k) for k in kinds)}")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like ``tensors``, in order (writing a view writes ``flat``)."""
    tensors = list(tensors)
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"apex_C.unflatten: flat must be 1-D with {total} elements (the tensors' total), got shape {tuple(flat.shape)}")
    views, offset = [], 0
    for t in tensors:
        views.append(flat.narrow(0, offset, t.numel()).view(t.shape))
        offset += t.numel()
    return views


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
