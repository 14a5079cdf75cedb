"""Device autocast over several device types at once, in a form ``torch.compile`` traces."""

from __future__ import annotations

from typing import Any

import torch

from ampddp.torch_compat import enter_autocast, exit_autocast


class DeviceAutocast:
    """``torch.autocast`` on each of ``device_types``, entered and exited together.

    Why not an ``ExitStack`` of ``torch.autocast`` objects: dynamo then inlines autocast's own
    ``__enter__``, cannot trace it (``setattr`` on an autocast object) and fails on the exit with
    ``NotImplementedError: AutocastModeVariable()``. ``torch_compat.enter_autocast`` is the form dynamo
    records as graph nodes, even when the enter and the exit run in different functions (a model's
    forward pre-hook and forward hook). Eager behaviour is that of ``torch.autocast``. Enter an
    instance once at a time.
    """

    def __init__(self, device_types: tuple[str, ...], dtype: torch.dtype | None = None, enabled: bool = True) -> None:
        self._device_types = device_types
        self._dtype = dtype
        self._enabled = enabled
        self._entered: list[Any] = []

    def __enter__(self) -> DeviceAutocast:
        self._entered = [enter_autocast(device_type, self._dtype, self._enabled) for device_type in self._device_types]
        return self

    def __exit__(self, *exc_info: Any) -> None:
        entered, self._entered = self._entered, []
        for mode in reversed(entered):
            exit_autocast(mode)
