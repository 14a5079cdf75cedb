"""Registered functions torch cannot intercept (not torch's own), swapped in their module while needed.

``amp.register_float_function(my_module, "fn")`` names a plain Python function: no torch-function mode
sees its calls, so while an op-cast context that needs it is open, the name in its module points at
a ``Dispatcher`` that routes calls through ``handle_torch_function``; the original comes back when the
last context using it closes.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from torch.overrides import handle_torch_function, has_torch_function

from ampddp.precision.casting.registry import tensors_in

ORIGINAL_ATTRIBUTE = "__ampddp_original__"

_SWAP_LOCK = threading.Lock()
"""Guards installing/removing dispatchers in user modules, which any thread's context may do."""


class Dispatcher:
    """Stands in for a registered function torch cannot intercept, while any context needs it.

    It routes calls through ``handle_torch_function`` so the active context's mode casts them by
    the original function's kind; shared by all contexts (counted), removed when the last exits.
    """

    def __init__(self, original: Any) -> None:
        functools.update_wrapper(self, original)
        setattr(self, ORIGINAL_ATTRIBUTE, original)
        self.users = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        relevant = tensors_in(args, kwargs)
        if relevant and has_torch_function(relevant):
            return handle_torch_function(self, relevant, *args, **kwargs)
        return getattr(self, ORIGINAL_ATTRIBUTE)(*args, **kwargs)


def install_dispatcher(module: Any, name: str) -> Dispatcher:
    with _SWAP_LOCK:
        current = getattr(module, name)
        dispatcher = current if isinstance(current, Dispatcher) else Dispatcher(current)
        dispatcher.users += 1
        setattr(module, name, dispatcher)
    return dispatcher


def release_dispatcher(module: Any, name: str, dispatcher: Dispatcher) -> None:
    with _SWAP_LOCK:
        dispatcher.users -= 1
        if dispatcher.users == 0 and getattr(module, name) is dispatcher:
            setattr(module, name, getattr(dispatcher, ORIGINAL_ATTRIBUTE))
