"""One line at set-up when the chosen mode is slower than fp32 on its device, naming the faster choice.

Decided by the device's capabilities (``ampddp.precision.hardware``), never by timing. Said by
``prepare`` (recipes, the Trainer, library set-ups) and by the apex facade's ``initialize``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ampddp.precision.fp8 import fp8_layer_in
from ampddp.precision.hardware import native_bf16, slower_than_fp32

logger = logging.getLogger("ampddp.precision")


def warn_if_slower_than_fp32(mode: str, compute_dtype: torch.dtype | None, device: torch.device, models: Iterable[nn.Module]) -> None:
    """A set-up of ``models`` in ``mode`` on ``device`` slower than fp32 there says so, once."""
    models = list(models)
    convolutions = any(isinstance(module, nn.modules.conv._ConvNd) for model in models for module in model.modules())
    runs_fp8 = any(fp8_layer_in(model) is not None for model in models)
    reason = slower_than_fp32(device, compute_dtype, convolutions, runs_fp8)
    if reason is None:
        return
    bf16_is_the_problem = compute_dtype == torch.bfloat16 and not runs_fp8
    faster = "native-bf16 (or O4/O5)" if native_bf16(device) and not bf16_is_the_problem else "O0 (fp32)"
    logger.warning("precision %s on %s is slower than fp32 here: %s; the faster choice on this machine is %s", mode, device, reason, faster)
