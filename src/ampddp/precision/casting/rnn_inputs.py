"""RNN modules where the op lists apply without device autocast (a window, the legacy handle).

torch's ``RNNBase.forward`` refuses an input whose dtype differs from its weights' unless autocast is
enabled, and it does so in Python before any op runs, so the op lists never get to cast: apex's
``test_rnn`` (half inputs to fp32 ``nn.RNN``/``GRU``/``LSTM``, packed sequences too) fails there with
"RNN input dtype (torch.float16) does not match weight dtype". While the lists apply on a thread
without autocast, a module forward pre-hook gives such an input its module's weight dtype; the RNN
op, on the low-precision list, then runs in the low dtype as apex ran it, and the input's gradient
comes back in the input's own dtype.

torch's module hooks are process-wide, so there is one hook, present only while some live thread
has the lists applied (counted per thread; a thread that ended with its count open stops counting),
and it acts only on such threads.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

_LOCK = threading.Lock()
_OPEN: dict[threading.Thread, int] = {}
"""Live threads with the lists applied without autocast, and how many openings each has."""
_HOOK: list[RemovableHandle] = []
"""The one process-wide pre-hook, while ``_OPEN`` is not empty."""


def _align(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    if not isinstance(module, nn.RNNBase) or not args or threading.current_thread() not in _OPEN:
        return None
    weight = next(module.parameters(), None)
    data = args[0].data if isinstance(args[0], PackedSequence) else args[0]
    if weight is None or not data.is_floating_point() or data.dtype == weight.dtype:
        return None
    if isinstance(args[0], PackedSequence):
        return (args[0]._replace(data=data.to(weight.dtype)), *args[1:])
    return (data.to(weight.dtype), *args[1:])


def _sync_hook() -> None:
    """Drop threads that ended; the hook exists exactly while some live thread needs it (under ``_LOCK``)."""
    for thread in [t for t in _OPEN if not t.is_alive()]:
        del _OPEN[thread]
    if _OPEN and not _HOOK:
        _HOOK.append(register_module_forward_pre_hook(_align))
    elif not _OPEN and _HOOK:
        _HOOK.pop().remove()


class RnnInputAlignment:
    """One opening's share of the hook, on the thread that installs it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    @property
    def installed(self) -> bool:
        """Whether this share is installed (RNN inputs are aligned on its thread)."""
        return self._thread is not None

    def install(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.current_thread()
        with _LOCK:
            _OPEN[self._thread] = _OPEN.get(self._thread, 0) + 1
            _sync_hook()

    def remove(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with _LOCK:
            left = _OPEN.get(thread, 0) - 1
            if left > 0:
                _OPEN[thread] = left
            else:
                _OPEN.pop(thread, None)
            _sync_hook()
