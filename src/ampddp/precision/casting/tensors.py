"""Casting of nested inputs/outputs and of a model's own parameters and buffers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ampddp.precision.shards import cast_param_


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside lists, tuples (named too) and dicts; keep the structure."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(value, fn)) for key, value in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(value, fn) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(value, fn) for value in obj)
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in ``obj`` (recursively) to ``dtype``; others are untouched."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

    return map_tensors(obj, cast)


def is_fp32_batchnorm(module: nn.Module) -> bool:
    """Affine BatchNorm layers (incl. SyncBatchNorm) are the ones O2/O5 keep in fp32."""
    return isinstance(module, _BatchNorm) and module.affine


def convert_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast each module's own floating params and buffers to ``dtype`` in place.

    Parameter objects are kept (``precision.shards.cast_param_``), so optimizers built before the cast
    still reference them. Affine BatchNorm modules stay fp32 when ``keep_batchnorm_fp32``.
    """
    for module in model.modules():
        if keep_batchnorm_fp32 and is_fp32_batchnorm(module):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                cast_param_(param, dtype)
                if param.grad is not None:
                    param.grad = None
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))


def first_non_fp32_param(model: nn.Module) -> tuple[str, torch.dtype] | None:
    """Name and dtype of the first floating param that is not fp32, or None."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != torch.float32:
            return name, param.dtype
    return None


def device_types(models: list[nn.Module]) -> tuple[str, ...]:
    """The device types ('cpu', 'cuda', ...) the models' parameters live on, in first-seen order;
    without any params (the legacy ``amp.init`` handle), CPU and CUDA when present."""
    seen: dict[str, None] = {}
    for model in models:
        for param in model.parameters():
            seen.setdefault(param.device.type, None)
    return tuple(seen) or (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
