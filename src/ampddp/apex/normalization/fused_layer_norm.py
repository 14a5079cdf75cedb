"""apex's ``apex.normalization.fused_layer_norm`` on ``torch.nn.functional.layer_norm`` / ``rms_norm``.

apex shipped LayerNorm/RMSNorm as a CUDA extension (``fused_layer_norm_cuda``) that only ran on CUDA
tensors. Code written against it (timm, Megatron, many training scripts) imports these names; here they
are built on torch's own norm kernels, so they run on any device, export, compile and keep apex's
dtype rules:

* ``FusedLayerNorm`` / ``FusedRMSNorm`` (and ``fused_layer_norm*`` / ``fused_rms_norm*``) return the
  input's dtype; statistics are accumulated in at least float32.
* ``MixedFusedLayerNorm`` / ``MixedFusedRMSNorm`` (and ``mixed_dtype_fused_*``) return the *parameters'*
  dtype, as apex's ``*_mixed_dtypes`` kernels do: fp32 params keep an fp32 output for a half input
  (fp32 residual streams), half params give a half output for an fp32 input (Megatron's
  ``fp32_residual_connection``).
* Under ``torch.autocast`` the input and parameters are first cast to the autocast dtype and the norm
  runs with autocast off, as apex's functions did (output in the autocast dtype, not fp32).

The modules subclass ``nn.LayerNorm`` / ``nn.RMSNorm``: same ``weight``/``bias`` state_dict keys, and
``isinstance(m, nn.LayerNorm)`` is true, so checkpoints and weight-decay filters work either way.
``memory_efficient`` is accepted everywhere apex takes it; it changed what apex's kernel saved for
backward, not the result, and torch's autograd decides that here.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampddp.apex._names import unknown_name

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm_affine",
    "fused_layer_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm_affine",
    "fused_rms_norm",
    "mixed_dtype_fused_rms_norm_affine",
    "manual_rms_norm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
]

REPLACEMENTS = {
    "fused_layer_norm_cuda": "nothing: ampddp.apex computes these norms with torch.nn.functional.layer_norm / rms_norm "
    "(no CUDA extension to load)",
    "FusedGroupNorm": "torch.nn.GroupNorm",
    "GroupNorm": "torch.nn.GroupNorm",
    "InstanceNorm3dNVFuser": "torch.nn.InstanceNorm3d",
}

ShapeLike = int | Sequence[int] | torch.Size


def _as_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    try:
        if isinstance(normalized_shape, str):
            raise TypeError
        shape = tuple(operator.index(d) for d in normalized_shape)
    except TypeError:
        raise ValueError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}") from None
    if not shape:
        raise ValueError("normalized_shape must name at least one trailing dimension, got ()")
    return shape


def _check(name: str, x: torch.Tensor, shape: tuple[int, ...], **params: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"{name}: input of shape {tuple(x.shape)} does not end in normalized_shape {shape}; "
            f"valid inputs have shape (*, {', '.join(map(str, shape))})"
        )
    if not x.is_floating_point():
        raise ValueError(f"{name}: input must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    for pname, p in params.items():
        if p is not None and tuple(p.shape) != shape:
            raise ValueError(f"{name}: {pname} has shape {tuple(p.shape)}; it must have normalized_shape {shape}")


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast to for ``x``'s device, or None when autocast is off there."""
    try:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        pass
    return None


def _autocast_eligible(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t


def _norm(
    kind: str, x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, mixed: bool
) -> torch.Tensor:
    cast_to = _autocast_dtype(x)
    if cast_to is not None:
        # apex's functions: cast the floating (not float64) arguments to the autocast dtype, run with autocast off.
        x, weight, bias = (_autocast_eligible(t, cast_to) for t in (x, weight, bias))
        with torch.autocast(x.device.type, enabled=False):
            return _norm(kind, x, shape, weight, bias, eps, mixed)
    out_dtype = weight.dtype if mixed and weight is not None else x.dtype
    params = [p for p in (weight, bias) if p is not None]
    if out_dtype == x.dtype and all(p.dtype == x.dtype for p in params):
        compute, x_c, w_c, b_c = x.dtype, x, weight, bias
    else:
        # Mixed dtypes: normalise in the widest of (input, params, float32), then return out_dtype.
        compute = torch.promote_types(torch.float32, x.dtype)
        for p in params:
            compute = torch.promote_types(compute, p.dtype)
        x_c, w_c, b_c = (t.to(compute) if t is not None else None for t in (x, weight, bias))
    y = F.layer_norm(x_c, shape, w_c, b_c, eps) if kind == "layer" else F.rms_norm(x_c, shape, w_c, eps)
    return y if compute == out_dtype else y.to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# Functional forms (apex's signatures and defaults: eps=1e-6, memory_efficient=False)
# ---------------------------------------------------------------------------------------------------


def fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """LayerNorm with weight and bias over the trailing ``normalized_shape`` dims; output in the input's dtype."""
    shape = _as_shape(normalized_shape)
    _check("fused_layer_norm_affine", input, shape, weight=weight, bias=bias)
    return _norm("layer", input, shape, weight, bias, eps, mixed=False)


def fused_layer_norm(input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """LayerNorm without affine parameters over the trailing ``normalized_shape`` dims."""
    shape = _as_shape(normalized_shape)
    _check("fused_layer_norm", input, shape)
    return _norm("layer", input, shape, None, None, eps, mixed=False)


def mixed_dtype_fused_layer_norm_affine(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalized_shape: ShapeLike,
    eps: float = 1e-6,
    memory_efficient: bool = False,
) -> torch.Tensor:
    """LayerNorm with weight and bias whose output has the *weight's* dtype (apex's mixed-dtype kernel)."""
    shape = _as_shape(normalized_shape)
    _check("mixed_dtype_fused_layer_norm_affine", input, shape, weight=weight, bias=bias)
    return _norm("layer", input, shape, weight, bias, eps, mixed=True)


def fused_rms_norm_affine(
    input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    """RMSNorm with a weight over the trailing ``normalized_shape`` dims; output in the input's dtype."""
    shape = _as_shape(normalized_shape)
    _check("fused_rms_norm_affine", input, shape, weight=weight)
    return _norm("rms", input, shape, weight, None, eps, mixed=False)


def fused_rms_norm(input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """RMSNorm without a weight over the trailing ``normalized_shape`` dims."""
    shape = _as_shape(normalized_shape)
    _check("fused_rms_norm", input, shape)
    return _norm("rms", input, shape, None, None, eps, mixed=False)


def mixed_dtype_fused_rms_norm_affine(
    input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6, memory_efficient: bool = False
) -> torch.Tensor:
    """RMSNorm with a weight whose output has the *weight's* dtype (apex's mixed-dtype kernel)."""
    shape = _as_shape(normalized_shape)
    _check("mixed_dtype_fused_rms_norm_affine", input, shape, weight=weight)
    return _norm("rms", input, shape, weight, None, eps, mixed=True)


def manual_rms_norm(input: torch.Tensor, normalized_shape: ShapeLike, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """apex's reference RMSNorm (its CPU path): mean of squares in float32, result in float32 unless the weight is half.

    Kept for code that calls it directly; its dtypes follow apex's function (a float16 input without
    weight comes back float32; with a float16/bfloat16 weight the result has the weight's dtype).
    """
    shape = _as_shape(normalized_shape)
    _check("manual_rms_norm", input, shape, weight=weight)
    out_dtype = torch.promote_types(input.dtype, torch.float32)
    if weight is not None:
        out_dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.promote_types(out_dtype, weight.dtype)
    compute = torch.promote_types(out_dtype, torch.float32)
    y = F.rms_norm(input.to(compute), shape, None if weight is None else weight.to(compute), eps)
    return y.to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# apex's autograd.Function entry points (Megatron calls ``FusedLayerNormAffineFunction.apply`` directly)
# ---------------------------------------------------------------------------------------------------


class _FunctionShim:
    """``Cls.apply(...)`` with apex's positional arguments; autograd is torch's own, so there is no
    backward here. ``forward`` keeps apex's signature (Megatron inspects it for ``memory_efficient``)."""

    forward: Any

    @classmethod
    def apply(cls, *args: Any) -> torch.Tensor:
        return cls.forward(None, *args)


class FusedLayerNormAffineFunction(_FunctionShim):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        normalized_shape: ShapeLike,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        return fused_layer_norm_affine(input, weight, bias, normalized_shape, eps, memory_efficient)


class FusedLayerNormAffineMixedDtypesFunction(_FunctionShim):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``; output in the weight's dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        normalized_shape: ShapeLike,
        eps: float,
        memory_efficient: bool = False,
    ) -> torch.Tensor:
        return mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps, memory_efficient)


class FusedLayerNormFunction(_FunctionShim):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, normalized_shape: ShapeLike, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return fused_layer_norm(input, normalized_shape, eps, memory_efficient)


class FusedRMSNormAffineFunction(_FunctionShim):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike, eps: float, memory_efficient: bool = False
    ) -> torch.Tensor:
        return fused_rms_norm_affine(input, weight, normalized_shape, eps, memory_efficient)


class FusedRMSNormAffineMixedDtypesFunction(_FunctionShim):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``; output in the weight's dtype."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike, eps: float, memory_efficient: bool = False
    ) -> torch.Tensor:
        return mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps, memory_efficient)


class FusedRMSNormFunction(_FunctionShim):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, normalized_shape: ShapeLike, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return fused_rms_norm(input, normalized_shape, eps, memory_efficient)


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


class FusedLayerNorm(nn.LayerNorm):
    """apex's ``FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``.

    An ``nn.LayerNorm`` (same parameters and state_dict) whose output keeps the input's dtype, on any
    device. ``bias``/``device``/``dtype`` are accepted as keywords, as ``nn.LayerNorm`` takes them.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(_as_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device, dtype=dtype)
        self.memory_efficient = memory_efficient

    _mixed = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        _check(type(self).__name__, input, shape)
        return _norm("layer", input, shape, self.weight, self.bias, self.eps, mixed=self._mixed)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedRMSNorm(nn.RMSNorm):
    """apex's ``FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``.

    An ``nn.RMSNorm`` (same ``weight`` and state_dict) with apex's default eps of 1e-5; output keeps the
    input's dtype, statistics in at least float32.
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        memory_efficient: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(_as_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        self.memory_efficient = memory_efficient

    _mixed = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        _check(type(self).__name__, input, shape)
        return _norm("rms", input, shape, self.weight, None, self.eps, mixed=self._mixed)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def _require_affine(cls_name: str, elementwise_affine: bool) -> None:
    if not elementwise_affine:
        raise ValueError(
            f"{cls_name} always has a weight (its output dtype is the weight's); elementwise_affine=False is not valid. "
            f"Use {cls_name.replace('Mixed', '')}(..., elementwise_affine=False) for a norm without parameters."
        )


class MixedFusedLayerNorm(FusedLayerNorm):
    """apex's ``MixedFusedLayerNorm(normalized_shape, eps=1e-5, *, memory_efficient=False)``: output in the params' dtype.

    Always affine. With float32 params (the default) a float16/bfloat16 input gives a float32 output;
    after ``.half()`` an fp32 input gives a half output, as apex's mixed-dtype kernel did.
    """

    _mixed = True

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _require_affine(type(self).__name__, elementwise_affine)
        super().__init__(normalized_shape, eps, True, memory_efficient, bias=bias, device=device, dtype=dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    """apex's ``MixedFusedRMSNorm(normalized_shape, eps=1e-5, *, memory_efficient=False)``: output in the weight's dtype."""

    _mixed = True

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-5,
        *,
        memory_efficient: bool = False,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _require_affine(type(self).__name__, elementwise_affine)
        super().__init__(normalized_shape, eps, True, memory_efficient, device=device, dtype=dtype)


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
