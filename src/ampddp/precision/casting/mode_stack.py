"""Surgery on this thread's torch-function mode stack, for cast modes that outlive a ``with`` block.

The modes of a window or a held context stay pushed across user code that enters and leaves its
own modes (``with torch.device(...)`` pops whatever is on top), so they are placed underneath
those and taken out from wherever they sit, leaving the user's modes in their order.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ampddp.torch_compat import function_mode_depth, pop_function_mode, push_function_mode


def remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack wherever it sits; modes pushed
    above it (by user code still inside their ``with``) stay, in their order."""
    above = []
    while function_mode_depth() > 0:
        top = pop_function_mode()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        push_function_mode(other)


def push_below_others(mode: TorchFunctionMode) -> None:
    """Push a mode that outlives the user's ``with`` blocks underneath their modes, so that leaving
    one of those blocks (``with torch.device(...)`` pops whatever is on top) never pops it. It stays
    above the default-device mode of ``torch.set_default_device``, which must remain at the bottom."""
    above = [pop_function_mode() for _ in range(function_mode_depth())]
    default_device = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    below = [m for m in above[-1:] if default_device is not None and m is default_device]
    for other in below:
        push_function_mode(other)
    push_function_mode(mode)
    for other in reversed(above[: len(above) - len(below)]):
        push_function_mode(other)
