"""apex.fp16_utils.loss_scaler: the static and dynamic loss scalers of pre-amp apex.

``LossScaler(scale)`` keeps a fixed scale; ``DynamicLossScaler(init_scale=2**32, scale_factor=2.,
scale_window=1000)`` divides the scale by ``scale_factor`` on every overflow (never below 1) and
multiplies it by ``scale_factor`` after each ``scale_window`` iterations without one — fp16_utils'
defaults, not amp's (2**16, 2000). Both keep apex's attributes and methods (``cur_scale``,
``cur_iter``, ``last_overflow_iter``, ``loss_scale``, ``has_overflow``, ``update_scale``,
``scale_gradient``, ``backward``) and pickle in apex's attribute form, so ``torch.load`` of an
apex-era checkpoint (run under ``python -m ampddp.apex``) gives working objects here.

The arithmetic is ampddp's :class:`ampddp.precision.scaler.LossScaler` (held as ``.scaler``), which
``FP16_Optimizer`` hands to the O2 unscaling machinery (one fused unscale + non-finite check).
Deviations: ``backward`` scales the loss in fp32 (apex multiplied an fp16 loss in fp16, which
overflows at the default 2**32); a scale stuck at its floor while every step still overflows raises
``NonFiniteGradientsError`` after 10 skips instead of skipping forever (the loss itself is inf/NaN);
``has_overflow`` reads the gradients with one host synchronisation instead of one per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ampddp.apex._names import unknown_name
from ampddp.apex.fp16_utils.fp16util import to_python_float
from ampddp.errors import ConfigError
from ampddp.precision import LossScaler as _EngineScaler

__all__ = ["DynamicLossScaler", "LossScaler", "to_python_float"]
REPLACEMENTS: dict[str, str] = {}
APEX_DYNAMIC_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")
"""The attributes apex's pickled DynamicLossScaler carries (its ``__dict__``)."""
DEFAULT_MIN_SCALE = 1.0
"""fp16_utils' floor: ``max(cur_scale / scale_factor, 1)``."""


def _scale_value(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ConfigError(f"{what}={value!r} is not valid; it must be a finite number > 0")


def _whole(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() and value >= minimum:
        return int(value)
    raise ConfigError(f"{what}={value!r} is not valid; it must be a whole number >= {minimum}")


def _any_non_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if any tensor holds inf/NaN: one max-abs foreach pass per device, one host read."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_device.setdefault(tensor.device, []).append(tensor.detach())
    if not by_device:
        return False
    flags = []
    for group in by_device.values():
        largest = torch.stack([norm.float() for norm in torch._foreach_norm(group, math.inf)])
        flags.append(largest.isfinite().all().logical_not())
    first = flags[0]
    return bool(sum((flag.to(first.device) for flag in flags[1:]), first).item())


class _ScaleHolder:
    """What both scalers share: ampddp's scaler underneath, apex's scale attributes and loss hooks."""

    dynamic: bool
    scaler: _EngineScaler

    @property
    def cur_scale(self) -> float:
        return self.scaler.loss_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scaler.loss_scale = _scale_value(value, "loss scale")

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    def scale_gradient(self, module: nn.Module, grad_in: tuple[torch.Tensor | None, ...], grad_out: Any) -> tuple[Any, ...]:
        """A module backward hook that multiplies the incoming gradients by the loss scale."""
        return tuple(None if g is None else self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``, with the product taken in fp32."""
        self.scaler.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(_ScaleHolder):
    """apex's static loss scale: ``loss_scale`` is fixed, overflow is never checked, no step is skipped."""

    dynamic = False

    def __init__(self, scale: float = 1) -> None:
        self.scaler = _EngineScaler(dynamic=False, init_scale=_scale_value(scale, "static loss scale"))

    def has_overflow(self, params: Iterable[nn.Parameter]) -> bool:
        """Always False: a static scale never skips a step (as in apex)."""
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update for a static scale."""

    # ---- pickling: apex's attribute form -----------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "cur_scale" not in state:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(f"a saved fp16_utils LossScaler must have 'cur_scale'; got {keys}")
        self.__init__(state["cur_scale"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.cur_scale:g})"


class DynamicLossScaler(_ScaleHolder):
    """apex's dynamic loss scale (fp16_utils defaults): back off on overflow, grow after a clean window.

    ``min_loss_scale``/``max_loss_scale`` (keyword-only, accepted for scripts written for the last apex
    releases, whose FP16_Optimizer took amp's keys) bound the scale; the defaults are fp16_utils':
    a floor of 1 and no ceiling.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        *,
        min_loss_scale: float | None = DEFAULT_MIN_SCALE,
        max_loss_scale: float | None = None,
    ) -> None:
        factor = _scale_value(scale_factor, "scale_factor")
        if factor < 1.0:
            raise ConfigError(f"scale_factor={scale_factor!r} is not valid; it must be >= 1 (the scale is divided by it on overflow)")
        window = _whole(scale_window, "scale_window", 1)
        floor = None if min_loss_scale is None else _scale_value(min_loss_scale, "min_loss_scale")
        ceiling = math.inf if max_loss_scale in (None, math.inf) else _scale_value(max_loss_scale, "max_loss_scale")
        if floor is not None and floor > ceiling:
            raise ConfigError(f"min_loss_scale={floor:g} is larger than max_loss_scale={ceiling:g}; min must be <= max")
        self.scaler = _EngineScaler(
            dynamic=True,
            init_scale=_scale_value(init_scale, "init_scale"),
            min_scale=floor,
            max_scale=ceiling,
            growth_factor=factor,
            backoff_factor=1.0 / factor,
            growth_interval=window,
        )
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def scale_factor(self) -> float:
        return self.scaler.growth_factor

    @property
    def scale_window(self) -> int:
        return self.scaler.growth_interval

    def has_overflow(self, params: Iterable[nn.Parameter]) -> bool:
        """True if any param's ``.grad`` holds inf or NaN."""
        return _any_non_finite(p.grad for p in params if p.grad is not None)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return _any_non_finite([x])

    def update_scale(self, overflow: bool) -> None:
        """One iteration: divide the scale on overflow; multiply it after ``scale_window`` clean ones."""
        self.scaler.update(bool(overflow))
        if overflow:
            self.last_overflow_iter = self.cur_iter
        self.cur_iter += 1

    # ---- pickling: apex's attribute form -----------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
        }
        state["ampddp"] = {
            "min_loss_scale": self.scaler.min_scale,
            "max_loss_scale": None if self.scaler.max_scale == math.inf else self.scaler.max_scale,
            "skipped_steps": self.scaler.skipped_steps,
            "consecutive_skips": self.scaler.consecutive_skips,
        }
        return state

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or any(key not in state for key in APEX_DYNAMIC_KEYS):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(f"a saved fp16_utils DynamicLossScaler must have {list(APEX_DYNAMIC_KEYS)}; got {keys}")
        extra = state.get("ampddp") or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"a saved DynamicLossScaler's 'ampddp' entry must be a dict, got {type(extra).__name__}")
        self.__init__(  # type: ignore[misc]
            state["cur_scale"],
            state["scale_factor"],
            state["scale_window"],
            min_loss_scale=extra.get("min_loss_scale", DEFAULT_MIN_SCALE),
            max_loss_scale=extra.get("max_loss_scale"),
        )
        cur_iter = _whole(state["cur_iter"], "cur_iter", 0)
        last = _whole(state["last_overflow_iter"], "last_overflow_iter", -1)
        if last >= cur_iter:
            raise ConfigError(f"last_overflow_iter={last} must be below cur_iter={cur_iter}")
        self.cur_iter, self.last_overflow_iter = cur_iter, last
        # apex grows when (iteration - last_overflow_iter) % scale_window == 0; ampddp counts clean updates.
        self.scaler.unskipped = (cur_iter - 1 - last) % self.scale_window
        self.scaler.skipped_steps = _whole(extra.get("skipped_steps", 0), "skipped_steps", 0)
        self.scaler.consecutive_skips = _whole(extra.get("consecutive_skips", 0), "consecutive_skips", 0)

    def __repr__(self) -> str:
        return f"DynamicLossScaler(cur_scale={self.cur_scale:g}, scale_factor={self.scale_factor:g}, scale_window={self.scale_window})"


def restore_scaler(saved: Any, where: str = "loss_scaler") -> LossScaler | DynamicLossScaler:
    """A fresh scaler equal to a saved one: either class here (or apex's, unpickled through the
    ``apex`` alias), its apex attribute dict, or the ``apex.amp.scaler.LossScaler`` the last apex
    releases' FP16_Optimizer pickled (``_loss_scale``, ``_unskipped``, ``_scale_seq_len``, ...).
    The result never aliases ``saved``."""
    if isinstance(saved, (LossScaler, DynamicLossScaler)):
        saved = saved.__getstate__()
    elif not isinstance(saved, Mapping) and hasattr(saved, "_loss_scale"):
        return _from_amp_scaler(saved, where)
    if not isinstance(saved, Mapping):
        raise ConfigError(
            f"{where} is a {type(saved).__name__}; expected an fp16_utils LossScaler/DynamicLossScaler (as "
            "FP16_Optimizer.state_dict() stores it), its attribute dict, or apex.amp's LossScaler"
        )
    restored = DynamicLossScaler.__new__(DynamicLossScaler) if "cur_iter" in saved else LossScaler.__new__(LossScaler)
    try:
        restored.__setstate__(saved)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    return restored


def _from_amp_scaler(saved: Any, where: str) -> LossScaler | DynamicLossScaler:
    """apex.amp's scaler: halves/doubles by 2, grows after ``_scale_seq_len`` clean steps."""
    try:
        if not getattr(saved, "dynamic", True):
            return LossScaler(saved._loss_scale)
        restored = DynamicLossScaler(
            saved._loss_scale,
            2.0,
            getattr(saved, "_scale_seq_len", 2000),
            min_loss_scale=getattr(saved, "_min_loss_scale", None),
            max_loss_scale=getattr(saved, "_max_loss_scale", 2.0**24),
        )
        unskipped = _whole(getattr(saved, "_unskipped", 0), "_unskipped", 0)
    except ConfigError as error:
        raise ConfigError(f"{where} (an apex.amp LossScaler): {error}") from None
    restored.scaler.unskipped = unskipped % restored.scale_window
    restored.cur_iter = restored.scaler.unskipped
    return restored


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
