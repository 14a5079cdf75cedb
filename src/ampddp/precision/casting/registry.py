"""User op-precision registrations and the decorators that tag functions with a cast class.

A registry is an ordinary object (the ``Amp`` facade owns one, an engine takes one): what one
training set-up registers never reaches another, unlike apex's process-wide lists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.overrides import handle_torch_function, has_torch_function

from ampddp.errors import choice_error
from ampddp.precision.casting.cast_rules import BFLOAT16, CAST_KINDS, FP32, LOW, PROMOTE, call_tagged, entered_casts

__all__ = [
    "BFLOAT16",
    "CAST_ATTRIBUTE",
    "CAST_KINDS",
    "FP32",
    "LOW",
    "PROMOTE",
    "OpRegistry",
    "Registration",
    "bfloat16_function",
    "float_function",
    "half_function",
    "promote_function",
    "tag_function",
]
CAST_ATTRIBUTE = "__ampddp_cast__"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Registration:
    module: Any
    name: str
    kind: str


class OpRegistry:
    """Functions the user wants cast differently from the built-in lists.

    Registrations are read when an engine is set up (``amp.initialize``); they apply only inside
    that engine's forward context.
    """

    def __init__(self) -> None:
        self._entries: list[Registration] = []

    def register(self, module: Any, name: str, kind: str) -> None:
        """Record that ``module.name`` runs with cast class ``kind`` (one of CAST_KINDS)."""
        if kind not in CAST_KINDS:
            raise choice_error("cast kind", kind, CAST_KINDS)
        if not isinstance(name, str) or not hasattr(module, name):
            owner = getattr(module, "__name__", type(module).__name__)
            raise ValueError(f"{owner} has no attribute {name!r}; register an existing function, e.g. (torch, 'sigmoid')")
        self._entries = [e for e in self._entries if not (e.module is module and e.name == name)]
        self._entries.append(Registration(module, name, kind))

    def entries(self) -> tuple[Registration, ...]:
        return tuple(self._entries)


def tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return tuple(found)


def tag_function(fn: F, kind: str) -> F:
    """Wrap ``fn`` so an active ampddp op-cast context sees calls to it and applies ``kind``.

    Outside a context the wrapper calls ``fn`` directly; the checks cost one C call and one
    thread-local read. A context entered with dispatcher kernels has no mode to see the call, so
    the wrapper applies ``kind`` itself.
    """
    if kind not in CAST_KINDS:
        raise choice_error("cast kind", kind, CAST_KINDS)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        relevant = tensors_in(args, kwargs)
        if relevant and has_torch_function(relevant):
            return handle_torch_function(wrapper, relevant, *args, **kwargs)
        casts = entered_casts()
        if casts is not None:
            return call_tagged(fn, kind, args, kwargs, casts)
        return fn(*args, **kwargs)

    setattr(wrapper, CAST_ATTRIBUTE, kind)
    return wrapper  # type: ignore[return-value]


def half_function(fn: F) -> F:
    """Decorator: inside an O1/O4 forward context, run ``fn`` in the low-precision dtype."""
    return tag_function(fn, LOW)


def float_function(fn: F) -> F:
    """Decorator: inside an O1/O4 forward context, run ``fn`` in fp32."""
    return tag_function(fn, FP32)


def promote_function(fn: F) -> F:
    """Decorator: inside an O1/O4 forward context, cast ``fn``'s inputs to their widest float type."""
    return tag_function(fn, PROMOTE)


def bfloat16_function(fn: F) -> F:
    """Decorator: inside an O1/O4 forward context, run ``fn`` in bfloat16."""
    return tag_function(fn, BFLOAT16)
