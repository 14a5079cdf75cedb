"""Finding where non-finite values come from, without disturbing the run.

On an overflowed step the trainer asks two questions: did the forward pass itself produce inf/NaN
(and in which module first), or did the gradients overflow in backward (and in which parameter,
counting from the output, where the overflow starts and spreads towards the input)?
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ampddp.precision.casting.tensors import map_tensors
from ampddp.torch_compat import is_dtensor


def _non_finite(value: Any) -> bool:
    found = []

    def check(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            found.append(True)
        return tensor

    map_tensors(value, check)
    return bool(found)


def first_non_finite_module(module: nn.Module, forward: Callable[[], Any], context: AbstractContextManager[Any]) -> str | None:
    """Re-run ``forward()`` (a call of ``module``) without grad; return the first module whose output is non-finite.

    Buffers (BatchNorm statistics) and the RNG state are restored afterwards, so the run continues
    exactly as if the check had not happened.
    """
    names = {id(m): name or type(m).__name__ for name, m in module.named_modules()}
    found: list[str] = []

    def hook(mod: nn.Module, args: Any, output: Any) -> None:
        if not found and _non_finite(output):
            found.append(names[id(mod)])

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    buffers = [(b, b.clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with torch.no_grad(), context:
            forward()
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return found[0] if found else None


def overflow_origin(named_params: Iterable[tuple[str, nn.Parameter]]) -> str | None:
    """The parameter nearest the output whose gradient is non-finite on this rank: where a backward overflow
    began. A sharded gradient is read in this rank's shard: its whole would be a collective per parameter,
    which the ranks, stopping at different parameters, would not all join."""
    for name, param in reversed(list(named_params)):
        grad = param.grad
        local = grad.to_local() if is_dtensor(grad) else grad
        if local is not None and not bool(torch.isfinite(local).all()):
            return name
    return None
