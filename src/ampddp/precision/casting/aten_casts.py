"""O1/O4's op lists in torch's dispatcher: a forward context at the speed of ``torch.autocast``.

Why: a ``TorchFunctionMode`` sees every torch call in Python, 3 µs (``F.linear``) to 14 µs
(``F.batch_norm``) each on CPU, listed or not: 0.5 ms per step on the benchmark MLP. Device
autocast already applies most of apex's lists in C++ (torch's CUDA lists descend from apex's); what
it lacks for a device (on CPU: softmax, exp, sum, layer_norm, the promote ops, ...) gets a kernel on
that device's autocast dispatch key. Only those ops pay a Python call; every other op runs at
autocast's own speed.

Scope: dispatcher kernels are process-wide, so they are shared and counted (``KernelRegistry``),
registered when the first set-up needs them and removed when the last one using them is freed. They
cast only on a thread where an ampddp forward context is entered (``EnteredPlan``); anywhere else,
including a user's own ``torch.autocast``, they call the op exactly as torch would have.

What cannot be expressed here (a registration of a function that is not an aten op, a registration
that would replace one of torch's own autocast kernels, a device without an autocast key) makes the
forward context fall back to the torch-function mode; ``AtenCastPlan.build`` returns None then.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ampddp.precision.casting import op_lists
from ampddp.precision.casting.cast_rules import (
    BANNED,
    FP32,
    INPLACE_FP32,
    LOW,
    LOW_TYPES,
    PROMOTE,
    CastCache,
    EnteredCasts,
    entered_casts,
    push_entered_casts,
    refuse_banned_on_low,
    refuse_inplace_on_low,
    remove_entered_casts,
    target_dtype,
)
from ampddp.precision.casting.registry import Registration
from ampddp.torch_compat import dispatcher_op_names, excluding_key, has_kernel_for_key

TO_HOST = "to-host-fp32"
"""``Tensor.cpu()`` of a low-precision tensor on another device: fp32, as apex's list had it (apex cast
before copying to the host). ``x.to("cpu")`` reaches the dispatcher the same way and is cast too; a
tensor already on the CPU is returned as it is (aliasing kept)."""
TORCH_BANNED = "torch-banned"
"""torch's CUDA autocast refuses binary_cross_entropy whatever the inputs."""
AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS", "hpu": "AutocastHPU"}
ATEN_NAMES = {
    "cross_entropy": ("cross_entropy_loss",),
    "interpolate": (
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    ),
    "grid_sample": ("grid_sampler",),
    "norm": ("norm", "linalg_vector_norm", "linalg_matrix_norm", "linalg_norm"),  # torch.norm calls linalg
    "__matmul__": ("matmul",), "__rmatmul__": ("matmul",),
    "__pow__": ("pow",), "__rpow__": ("pow",),
    "__add__": ("add",), "__radd__": ("add",), "__sub__": ("sub",), "__rsub__": ("rsub",),
    "__mul__": ("mul",), "__rmul__": ("mul",), "__truediv__": ("div",), "__rtruediv__": ("div",),
    "__eq__": ("eq",), "__ne__": ("ne",), "__lt__": ("lt",), "__le__": ("le",), "__gt__": ("gt",), "__ge__": ("ge",),
    "true_divide": ("div",),
    "cpu": (),
}  # fmt: skip
"""apex list names whose aten ops are named differently. Python compositions (softmin, normalize,
local_response_norm, gaussian_nll_loss, multilabel_soft_margin_loss, hstack/vstack/dstack) are not
ops of their own: the listed ops they are made of are cast (so their results have the listed dtype)."""
TORCH_KERNEL_REPLACED = {
    ("AutocastCPU", "aten::binary_cross_entropy"): FP32,
    ("AutocastCUDA", "aten::binary_cross_entropy"): TORCH_BANNED,
    ("AutocastCUDA", "aten::grid_sampler"): PROMOTE,
}
"""Torch autocast kernels whose policy differs from apex's lists, which ampddp replaces, with the
policy torch's kernel had (applied wherever no ampddp context is entered). apex refused
binary_cross_entropy on half inputs only (torch: fp32 on CPU, refused on CUDA) and ran grid_sample
in fp32 (torch's CUDA list promotes it)."""


@functools.lru_cache(maxsize=1)
def _dispatcher_ops() -> frozenset[str]:
    """Ops the dispatcher knows (``torch.ops.aten`` also lists TorchScript-only ones such as ``atan2.int``)."""
    return dispatcher_op_names()


def _overloads(name: str) -> list[Any]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    found = (getattr(packet, overload) for overload in packet.overloads())
    return [overload for overload in found if overload.name() in _dispatcher_ops()]


def _functional_overloads(name: str) -> list[Any]:
    return [overload for overload in _overloads(name) if not overload._schema.is_mutable]


def _inplace_overloads(name: str) -> list[Any]:
    return _overloads(f"{name}_")


def _list_kinds() -> dict[str, str]:
    """apex's lists as aten base name -> kind (later lists win, as ``build_op_table`` orders them)."""
    kinds: dict[str, str] = {}
    for names, kind in ((op_lists.PROMOTE_OPS, PROMOTE), (op_lists.FP32_OPS, FP32), (op_lists.LOW_PRECISION_OPS, LOW)):
        for name in names:
            for aten in ATEN_NAMES.get(name, (name,)):
                kinds[aten] = kind
    for name in op_lists.BANNED_OPS:
        kinds[name] = BANNED
    return kinds


@functools.lru_cache(maxsize=1)
def _shared_aten_names() -> frozenset[str]:
    """aten ops that more than one list name reaches (``pow`` from ``pow``, ``__pow__`` and ``__rpow__``):
    a registration of one of those names cannot be told apart from the others in the dispatcher."""
    reached: dict[str, set[str]] = {}
    for name in (*op_lists.PROMOTE_OPS, *op_lists.FP32_OPS, *op_lists.LOW_PRECISION_OPS):
        for aten in ATEN_NAMES.get(name, (name,)):
            reached.setdefault(aten, set()).add(name)
    return frozenset(aten for aten, names in reached.items() if len(names) > 1)


@functools.lru_cache(maxsize=1)
def _list_overload_kinds() -> dict[Any, str]:
    """apex's lists by aten overload (looked up once: a few hundred overloads)."""
    kinds: dict[Any, str] = {}
    for name, kind in _list_kinds().items():
        kinds.update(dict.fromkeys(_functional_overloads(name), kind))
    for name in op_lists.FP32_OPS:
        if not name.startswith("__"):
            kinds.update(dict.fromkeys(_inplace_overloads(name), INPLACE_FP32))
    kinds[torch.ops.aten.to.dtype_layout] = TO_HOST
    return kinds


def _overload_kinds(registrations: tuple[Registration, ...]) -> tuple[dict[Any, str], set[Any]] | None:
    """Each aten overload the lists and registrations name -> its kind, and the overloads registrations
    name; None if a registration names no aten op."""
    kinds = dict(_list_overload_kinds())
    registered: set[Any] = set()
    for entry in registrations:
        aten_names = ATEN_NAMES.get(entry.name, (entry.name,))
        if entry.module not in (torch, F, torch.Tensor) or set(aten_names) & _shared_aten_names():
            return None
        overloads = [overload for name in aten_names for overload in _functional_overloads(name)]
        if not overloads:
            return None
        kinds.update(dict.fromkeys(overloads, entry.kind))
        registered.update(overloads)
    return kinds, registered


@dataclass(frozen=True)
class AtenCastPlan:
    """The kinds one context applies (by aten overload) and the kernels it needs, per autocast key."""

    kinds: dict[Any, str]
    kernels: tuple[tuple[Any, str], ...]
    low: torch.dtype

    @classmethod
    def build(cls, registrations: tuple[Registration, ...], low: torch.dtype, device_types: Iterable[str]) -> AtenCastPlan | None:
        """Kernels wherever torch's autocast has none for a listed op; None where that cannot cover the lists."""
        found = _overload_kinds(registrations)
        keys = [AUTOCAST_KEYS.get(device_type) for device_type in device_types]
        if found is None or None in keys:
            return None
        kinds, registered = found
        kernels = []
        for key in keys:
            for overload in kinds:
                if not KERNELS.has_torch_kernel(overload, key) or (key, overload.name()) in TORCH_KERNEL_REPLACED:
                    kernels.append((overload, key))
                elif overload in registered:
                    return None  # a registration would replace torch's own kernel for every autocast user
        return cls(kinds, tuple(kernels), low)


class EnteredPlan:
    """Enter ``plan``'s casts on this thread until ``close`` (closing out of order is fine)."""

    def __init__(self, plan: AtenCastPlan, device_types: tuple[str, ...]) -> None:
        self._casts = EnteredCasts(plan.kinds, plan.low, device_types)

    def open(self) -> None:
        push_entered_casts(self._casts)

    def close(self) -> None:
        remove_entered_casts(self._casts)
        self._casts.cache.clear()


def _aten_dtypes(values: Iterable[Any]) -> set[torch.dtype]:
    """Floating dtypes among an aten op's arguments (tensors, or lists of tensors: nothing deeper)."""
    seen = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                seen.add(value.dtype)
        elif isinstance(value, (list, tuple)):
            seen.update(v.dtype for v in value if isinstance(v, torch.Tensor) and v.is_floating_point())
    return seen


def _cast_aten(value: Any, dtype: torch.dtype, cache: CastCache) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype == dtype or value.dtype == torch.float64 or not value.is_floating_point():
            return value
        return cache.cast(value, dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_aten(v, dtype, cache) for v in value)
    return value


def _apply(
    kind: str, op: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any], low: torch.dtype, cache: CastCache
) -> Any:
    if kind == TORCH_BANNED:
        raise RuntimeError(
            f"{name} is refused under torch.autocast on this device (torch's own rule): it is unsafe in low precision; "
            "use torch.nn.BCEWithLogitsLoss / F.binary_cross_entropy_with_logits"
        )
    if kind == PROMOTE:
        dtypes = _aten_dtypes((*args, *kwargs.values()))
        if len(dtypes) < 2 or torch.float64 in dtypes:
            return op(*args, **kwargs)
        dtype = torch.float32
    elif kind == INPLACE_FP32:
        refuse_inplace_on_low(name, args)
        return op(*args, **kwargs)
    elif kind == TO_HOST:
        return _to_host(op, args, kwargs)
    else:
        if kind == BANNED:
            refuse_banned_on_low(name, op_lists.BANNED_OPS[name], args, kwargs)
            kind = FP32
        dtype = target_dtype(kind, low, args, kwargs)
    args = tuple(_cast_aten(value, dtype, cache) for value in args)
    return op(*args, **{key: _cast_aten(value, dtype, cache) for key, value in kwargs.items()})


def _to_host(op: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A low-precision tensor copied to the host without a dtype of its own arrives in fp32."""
    device, dtype, source = kwargs.get("device"), kwargs.get("dtype"), args[0]
    keeps_dtype = dtype is None or dtype == source.dtype  # Tensor.cpu() passes the tensor's own dtype
    to_host = device is not None and torch.device(device).type == "cpu" and source.device.type != "cpu"
    if keeps_dtype and to_host and source.dtype in LOW_TYPES:
        return op(args[0], **{**kwargs, "dtype": torch.float32})
    return op(*args, **kwargs)


def _kernel(overload: Any, key: str) -> Callable[..., Any]:
    """The shared kernel for ``overload`` on ``key``: the entered plan's kind, or torch's behaviour."""
    torch_kind = TORCH_KERNEL_REPLACED.get((key, overload.name()))
    name = overload._schema.name.removeprefix("aten::")
    call = overload._op  # the op's C++ entry point: one Python frame less than calling the OpOverload

    def kernel(*args: Any, **kwargs: Any) -> Any:
        casts = entered_casts()
        kind = casts.kinds.get(overload) if casts is not None else None
        # Nested ops run below autocast, as inside torch's own autocast kernels.
        with excluding_key(key):
            if kind is not None:
                return _apply(kind, call, name, args, kwargs, casts.low, casts.cache)
            if torch_kind is not None:
                return _apply(torch_kind, call, name, args, kwargs, torch.float32, CastCache())
            return call(*args, **kwargs)

    return kernel


class KernelRegistry:
    """Dispatcher registrations shared by every context that needs them, counted and removed with the last.

    One instance per process (``KERNELS``): torch's dispatcher is itself process-wide, and it
    accepts one Python kernel per op and key. A context's kernels are released once it is
    garbage-collected; the release is queued by its finalizer (which may run inside any allocation,
    even within ``acquire``) and carried out at the next ``acquire`` or ``registered``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libraries: dict[tuple[Any, str], tuple[Any, int]] = {}
        self._released: list[tuple[tuple[Any, str], ...]] = []

    def acquire(self, kernels: tuple[tuple[Any, str], ...], owner: object) -> None:
        """Register what is not registered yet; released when ``owner`` is garbage-collected."""
        with self._lock:
            self._drain()
            for overload, key in kernels:
                library, users = self._libraries.get((overload, key), (None, 0))
                if library is None:
                    library = torch.library.Library("aten", "IMPL")
                    library.impl(overload, _kernel(overload, key), key)
                self._libraries[(overload, key)] = (library, users + 1)
        weakref.finalize(owner, self._released.append, kernels)

    def _drain(self) -> None:
        while self._released:
            for overload, key in self._released.pop():
                library, users = self._libraries[(overload, key)]
                if users > 1:
                    self._libraries[(overload, key)] = (library, users - 1)
                else:
                    del self._libraries[(overload, key)]
                    library._destroy()

    def has_torch_kernel(self, overload: Any, key: str) -> bool:
        """Whether torch itself (not this registry) has a kernel for ``overload`` on ``key``."""
        with self._lock:
            if (overload, key) in self._libraries:
                return (key, overload.name()) in TORCH_KERNEL_REPLACED
        return has_kernel_for_key(overload.name(), key)

    def registered(self) -> int:
        """How many (op, key) kernels are registered now (releases queued so far carried out)."""
        with self._lock:
            self._drain()
            return len(self._libraries)


KERNELS = KernelRegistry()
