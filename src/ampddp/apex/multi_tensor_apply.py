"""apex's ``apex.multi_tensor_apply`` (``multi_tensor_applier``, ``MultiTensorApply``) for the ops in ``ampddp.apex.amp_C``.

apex-era code runs ``multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [srcs, dsts], scale)``.
apex's applier was only usable when its CUDA extension had been built (``available``); here the ops
are torch foreach code, so it is always available, on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ampddp.apex._names import unknown_name

__all__ = ["MultiTensorApply", "multi_tensor_applier"]

REPLACEMENTS = {
    "multi_tensor_apply": "from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier "
    "(this module is apex's package and its multi_tensor_apply submodule in one)",
}


class MultiTensorApply:
    """``MultiTensorApply(chunk_size)``: calling it runs ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"MultiTensorApply: chunk_size must be a positive int (apex used 2048*32), got {chunk_size!r}")
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Always passes: the ops need no compiled extension."""

    def __call__(
        self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor, tensor_lists: Sequence[Sequence[torch.Tensor]], *args: Any
    ) -> Any:
        if not callable(op):
            raise ValueError(f"multi_tensor_applier: op must be an amp_C function such as amp_C.multi_tensor_scale, got {op!r}")
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)

    def __repr__(self) -> str:
        return f"MultiTensorApply(chunk_size={self.chunk_size})"


multi_tensor_applier = MultiTensorApply(2048 * 32)


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
