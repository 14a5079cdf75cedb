"""What each O1/O4 cast kind does to an op's arguments, shared by both ways ampddp applies its lists
(the dispatcher kernels of ``aten_casts.py`` and the torch-function mode of ``cast_context.py``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ampddp.precision.casting.device_autocast import DeviceAutocast
from ampddp.precision.casting.tensors import map_tensors

LOW = "half"
"""Run in the level's low-precision dtype (float16 under O1, bfloat16 under O4)."""
BFLOAT16 = "bfloat16"
FP32 = "float"
PROMOTE = "promote"
CAST_KINDS = (LOW, FP32, PROMOTE, BFLOAT16)
BANNED = "banned"
INPLACE_FP32 = "inplace-float"
"""In-place form of an fp32-list op (``exp_``): refused on low-precision tensors, as apex did."""
LOW_TYPES = (torch.float16, torch.bfloat16)


class CastCache:
    """Casts of fp32 leaf parameters, reused within one outermost context (weights shared by
    several ops, RNN time steps) and dropped when it exits, as apex did per iteration."""

    def __init__(self) -> None:
        self._casts: dict[tuple[int, torch.dtype, bool], tuple[torch.Tensor, int, torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):
            return tensor.to(dtype)
        key = (id(tensor), dtype, torch.is_grad_enabled())
        hit = self._casts.get(key)
        if hit is not None and hit[0] is tensor and hit[1] == tensor._version:
            return hit[2]
        result = tensor.to(dtype)
        self._casts[key] = (tensor, tensor._version, result)
        return result

    def clear(self) -> None:
        self._casts.clear()


def floating_dtypes(args: Any, kwargs: dict[str, Any]) -> set[torch.dtype]:
    """The floating dtypes among the tensors in ``args``/``kwargs`` (nested lists included)."""
    seen: set[torch.dtype] = set()

    def note(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            seen.add(tensor.dtype)
        return tensor

    map_tensors((args, kwargs), note)
    return seen


def cast_floating_to(obj: Any, dtype: torch.dtype, cache: CastCache) -> Any:
    """Floating tensors other than fp64 become ``dtype`` (leaf parameters through ``cache``)."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == dtype or not tensor.is_floating_point() or tensor.dtype == torch.float64:
            return tensor
        return cache.cast(tensor, dtype)

    return map_tensors(obj, cast)


def target_dtype(kind: str, low: torch.dtype, args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype ``kind`` casts floating inputs to, or None where it leaves them as they are.

    ``low`` is the level's low-precision dtype; a promote op casts only when its inputs mix
    floating types (and none is fp64), to fp32 as apex did.
    """
    if kind == LOW:
        return low
    if kind == BFLOAT16:
        return torch.bfloat16
    if kind == FP32:
        return torch.float32
    if kind == PROMOTE:
        dtypes = floating_dtypes(args, kwargs)
        return torch.float32 if len(dtypes) > 1 and torch.float64 not in dtypes else None
    raise ValueError(f"cast kind {kind!r} has no target dtype")


def refuse_inplace_on_low(name: str, args: tuple[Any, ...]) -> None:
    """An fp32-list op in place on a half tensor cannot run in fp32 and write back: refuse it."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW_TYPES:
        raise NotImplementedError(
            f"in-place {name} on a {args[0].dtype} tensor under an op-casting opt level: the op runs in fp32 and "
            f"its result cannot be written back in place; use the out-of-place form (x = x.{name.rstrip('_')}())"
        )


def refuse_banned_on_low(name: str, message: str, args: Any, kwargs: dict[str, Any]) -> None:
    """A banned op (binary_cross_entropy) with a low-precision input: refuse it with guidance."""
    if floating_dtypes(args, kwargs) & set(LOW_TYPES):
        raise NotImplementedError(f"{name} called with low-precision input under an op-casting opt level: {message}")


@dataclass
class EnteredCasts:
    """What a forward context entered with dispatcher kernels applies on its thread (see ``aten_casts``)."""

    kinds: dict[Any, str]
    low: torch.dtype
    device_types: tuple[str, ...]
    cache: CastCache = field(default_factory=CastCache)


_ENTERED = threading.local()
"""This thread's contexts entered with dispatcher kernels, innermost last (None: a suspension)."""


def entered_casts() -> EnteredCasts | None:
    """The casts entered on this thread with dispatcher kernels (None: none, or suspended)."""
    stack = getattr(_ENTERED, "stack", None)
    return stack[-1] if stack else None


def push_entered_casts(casts: EnteredCasts | None) -> None:
    """Enter ``casts`` on this thread (None: no casts until it is removed, ``amp.disable_casts``)."""
    stack = getattr(_ENTERED, "stack", None)
    if stack is None:
        stack = _ENTERED.stack = []
    stack.append(casts)


def remove_entered_casts(casts: EnteredCasts | None) -> None:
    """Remove the innermost entry of ``casts`` wherever it sits: contexts may close out of order
    (``amp.end_casts`` after an interrupted forward), and the others stay as they were."""
    stack = getattr(_ENTERED, "stack", [])
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is casts:
            del stack[index]
            return


def call_tagged(fn: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], casts: EnteredCasts) -> Any:
    """Call a function tagged with ``kind`` (``float_function``, ...) as the entered context casts it."""
    dtype = target_dtype(kind, casts.low, args, kwargs)
    if dtype is not None:
        args, kwargs = cast_floating_to(args, dtype, casts.cache), cast_floating_to(kwargs, dtype, casts.cache)
    if kind == FP32:
        with DeviceAutocast(casts.device_types, enabled=False):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)
