"""apex's O1/O4 op lists and a set-up's registrations as one table: torch function -> cast kind."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import get_overridable_functions

from ampddp.precision.casting import op_lists
from ampddp.precision.casting.cast_rules import BANNED, INPLACE_FP32
from ampddp.precision.casting.function_swaps import ORIGINAL_ATTRIBUTE
from ampddp.precision.casting.registry import FP32, LOW, PROMOTE, Registration

NAMESPACES = (torch, F, torch.Tensor)


@functools.lru_cache(maxsize=1)
def _overridable() -> frozenset[Any]:
    return frozenset(fn for fns in get_overridable_functions().values() for fn in fns)


def _lookup(names: tuple[str, ...] | list[str]) -> list[Any]:
    found = []
    for name in names:
        for namespace in NAMESPACES:
            fn = getattr(namespace, name, None)
            if fn is not None and not isinstance(fn, types.ModuleType):
                found.append(fn)
    return found


@dataclass(frozen=True)
class OpTable:
    """Function -> cast kind, plus registrations that need a scoped swap in their module."""

    kinds: dict[Any, str]
    swaps: tuple[Registration, ...]
    banned_messages: dict[Any, str]
    registrations: tuple[Registration, ...] = ()


def build_op_table(registrations: tuple[Registration, ...]) -> OpTable:
    """Built-in lists first, user registrations on top (so a registration can lift a ban)."""
    kinds: dict[Any, str] = {}
    for names, kind in ((op_lists.PROMOTE_OPS, PROMOTE), (op_lists.FP32_OPS, FP32), (op_lists.LOW_PRECISION_OPS, LOW)):
        kinds.update(dict.fromkeys(_lookup(names), kind))
    for name in op_lists.FP32_OPS:
        in_place = None if name.startswith("__") else getattr(torch.Tensor, f"{name}_", None)
        if in_place is not None:
            kinds[in_place] = INPLACE_FP32
    banned_messages: dict[Any, str] = {}
    for name, message in op_lists.BANNED_OPS.items():
        for fn in _lookup([name]):
            kinds[fn] = BANNED
            banned_messages[fn] = message
    swaps = []
    for entry in registrations:
        fn = getattr(entry.module, entry.name)
        fn = getattr(fn, ORIGINAL_ATTRIBUTE, fn)
        if fn in _overridable():
            kinds[fn] = entry.kind
            if entry.module in (torch, F):
                tensor_method = getattr(torch.Tensor, entry.name, None)
                if tensor_method is not None:
                    kinds[tensor_method] = entry.kind
        else:
            kinds[fn] = entry.kind
            swaps.append(entry)
    return OpTable(kinds, tuple(swaps), banned_messages, tuple(registrations))
