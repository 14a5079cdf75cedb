"""RNN modules where the op lists apply without device autocast (a window, the legacy handle).

torch's ``RNNBase.forward`` refuses an input whose dtype differs from its weights' unless autocast is
enabled, and it does so in Python before any op runs, so the op lists never get to cast: apex's
``test_rnn`` (half inputs to fp32 ``nn.RNN``/``GRU``/``LSTM``, packed sequences too) fails there with
"RNN input dtype (torch.float16) does not match weight dtype". While the lists apply on a thread
without autocast, a module forward pre-hook gives such an input its module's weight dtype; the RNN
op, on the low-precision list, then runs in the low dtype as apex ran it, and the input's gradient
comes back in the input's own dtype.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle


class RnnInputAlignment:
    """A process-wide module pre-hook, installed only while one thread's lists apply, acting on that thread."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._thread: int | None = None

    def install(self) -> None:
        if self._handle is None:
            self._thread = threading.get_ident()
            self._handle = register_module_forward_pre_hook(self._align)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _align(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not isinstance(module, nn.RNNBase) or threading.get_ident() != self._thread or not args:
            return None
        weight = next(module.parameters(), None)
        data = args[0].data if isinstance(args[0], PackedSequence) else args[0]
        if weight is None or not data.is_floating_point() or data.dtype == weight.dtype:
            return None
        if isinstance(args[0], PackedSequence):
            return (args[0]._replace(data=data.to(weight.dtype)), *args[1:])
        return (data.to(weight.dtype), *args[1:])
