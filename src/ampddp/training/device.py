"""What a fast GPU run sets: channels-last memory format, cuDNN autotuning, TF32 — scoped to the run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampddp.errors import ConfigError

logger = logging.getLogger("ampddp.trainer")


@dataclass(frozen=True)
class DeviceSettings:
    """``channels_last``: the model and 4-D floating inputs in channels-last format; ``cudnn_benchmark``
    and ``allow_tf32``: torch's backend flags, set while the run trains and restored after it."""

    channels_last: bool = False
    cudnn_benchmark: bool = False
    allow_tf32: bool | None = None
    """None: torch's defaults (TF32 for cuDNN convolutions, not for matmuls); True / False: both."""

    def __post_init__(self) -> None:
        for name in ("channels_last", "cudnn_benchmark"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"trainer.{name}={getattr(self, name)!r} is not valid; it must be true or false")
        if self.allow_tf32 is not None and not isinstance(self.allow_tf32, bool):
            raise ConfigError(f"trainer.allow_tf32={self.allow_tf32!r} is not valid; it must be true, false or null")

    @property
    def memory_format(self) -> torch.memory_format | None:
        """The format image batches are moved in (None: as loaded)."""
        return torch.channels_last if self.channels_last else None

    def convert(self, model: nn.Module) -> nn.Module:
        """``model`` in the chosen memory format (in place: the parameters stay the same objects)."""
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def describe(self, device: torch.device) -> str:
        """The device and the settings that apply to it (cuDNN and TF32 on CUDA only)."""
        layout = ", channels_last" if self.channels_last else ""
        if device.type != "cuda":
            return f"{device.type}: {torch.get_num_threads()} thread(s){layout}"
        tf32 = "torch's default" if self.allow_tf32 is None else ("on" if self.allow_tf32 else "off")
        benchmark = "on" if self.cudnn_benchmark else "off"
        return f"{device} ({torch.cuda.get_device_name(device)}){layout}, cudnn_benchmark {benchmark}, TF32 {tf32}"

    @contextmanager
    def backend_flags(self, device: torch.device) -> Iterator[None]:
        """cuDNN benchmark and TF32 as asked, for the duration of training; logs them with the device."""
        benchmark = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        precision = _tf32_settings() if self.allow_tf32 is not None else None
        if precision is not None:
            _set_tf32(self.allow_tf32)
        logger.info("device %s", self.describe(device))
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = benchmark
            if precision is not None:
                _restore_tf32(precision)


# TF32 through torch's fp32_precision settings where they exist (mixing them with the legacy allow_tf32
# flags raises in recent torch), else the legacy flags.
_PRECISION_OWNERS = ("cuda.matmul", "cudnn.conv")


def _owner(path: str) -> Any:
    owner = torch.backends
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner


def _tf32_settings() -> tuple[str, ...] | tuple[bool, bool]:
    owners = [_owner(path) for path in _PRECISION_OWNERS]
    if all(owner is not None and hasattr(owner, "fp32_precision") for owner in owners):
        return tuple(owner.fp32_precision for owner in owners)
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _set_tf32(enabled: bool) -> None:
    owners = [_owner(path) for path in _PRECISION_OWNERS]
    if all(owner is not None and hasattr(owner, "fp32_precision") for owner in owners):
        for owner in owners:
            owner.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled


def _restore_tf32(saved: tuple) -> None:
    if isinstance(saved[0], str):
        for owner, value in zip((_owner(path) for path in _PRECISION_OWNERS), saved):
            owner.fp32_precision = value
    else:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
