"""``apex.amp._amp_state``: apex's global state object, as a view of the default ``amp`` set-up.

apex kept loss scalers, opt properties and the O1 handle in one process-wide object that scripts
and apex's own tests read and write (``_amp_state.loss_scalers[0]._loss_scale = 4.0``,
``_amp_state.allow_incoming_model_not_fp32 = True``). Here every attribute reads and writes
through to the newest set-up of ``ampddp.amp.default``, so nothing is copied or goes stale.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.amp import Amp, default
from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision import LossScaler, OptLevelEngine, PrecisionPolicy
from ampddp.precision.casting import OpCastContext


class ScalerView:
    """apex's ``LossScaler`` attributes over one live ampddp scaler (one view per scaler: see ``view_of``)."""

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler
        self._flag: torch.Tensor | None = None
        self._own_flag: torch.Tensor | None = None

    def loss_scale(self) -> float:
        return self._scaler.loss_scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"loss scale {value!r} is not valid; it must be a finite number > 0")
        self._scaler.loss_scale = float(value)

    @property
    def _unskipped(self) -> int:
        return self._scaler.unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"unskipped {value!r} is not valid; it must be a whole number >= 0")
        self._scaler.unskipped = value

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_scale

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        """NVIDIA's GNMT sets its own growth interval here (``upscale_interval``)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"_scale_seq_len {value!r} is not valid; it must be a whole number >= 1 (steps between scale growths)")
        self._scaler.growth_interval = value

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """apex's overflow flag (a one-element int tensor, always there). A script may put its own in its place
        (NVIDIA's BERT passes the one its ``amp_C.multi_tensor_scale`` calls set) and put the old one back:
        ``update_scale`` then reads the script's flag; with this view's own flag it reads the non-finite flags
        of ``scale_loss(..., delay_overflow_check=True)``."""
        if self._flag is None:
            self._own_flag = self._flag = torch.zeros(1, dtype=torch.int)
        return self._flag

    @_overflow_buf.setter
    def _overflow_buf(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ConfigError(f"_overflow_buf must be a one-element tensor (an overflow flag), got {type(value).__name__}")
        self._flag = value

    @property
    def _has_overflow(self) -> bool:
        if self._flag is not None and self._flag is not self._own_flag:
            return bool(self._flag.item())
        found = self._scaler.deferred_found_inf
        return found is not None and bool(found.item())

    def clear_overflow_state(self) -> None:
        """Forget pending overflow flags (apex called this before each unscale)."""
        self._scaler.deferred_found_inf = None
        if self._flag is not None:
            self._flag.zero_()

    def update_scale(self) -> bool:
        """apex's ``LossScaler.update_scale``: apply the pending overflow flag to the scale; True means skip the step.

        For callers of ``scale_loss(..., delay_overflow_check=True)``: like apex, this does not skip
        ``optimizer.step()`` itself; the caller does not step when it returns True.
        """
        overflow = self._has_overflow
        self._scaler.deferred_found_inf = None
        return self._scaler.update(overflow)


VIEW_ATTRIBUTE = "_apex_view"


def view_of(scaler: LossScaler) -> ScalerView:
    """The one view of ``scaler``, kept on it (and freed with it), so that what a script sets on
    ``loss_scalers[0]`` (``_overflow_buf``, its own attributes) is there the next time it reads
    ``loss_scalers[0]``, as on apex's persistent scaler objects."""
    view = scaler.__dict__.get(VIEW_ATTRIBUTE)
    if view is None:
        view = ScalerView(scaler)
        setattr(scaler, VIEW_ATTRIBUTE, view)
    return view


class PropertiesView:
    """apex's ``opt_properties`` (read-only: an opt level's properties are fixed at ``initialize``)."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        self._policy = policy

    def __getattr__(self, name: str) -> Any:
        policy = self.__dict__["_policy"]
        if name == "options":
            return policy.describe()
        if hasattr(policy, name):
            return getattr(policy, name)
        raise AttributeError(f"opt_properties has no {name!r}; it has {', '.join(sorted(policy.describe()))}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_policy":
            object.__setattr__(self, name, value)
            return
        raise AmpUsageError(f"opt_properties.{name} cannot be changed after amp.initialize; pass {name}=... to amp.initialize instead")


class SetUpHandle:
    """apex's O1 ``handle`` of the newest set-up: ``_deactivate()`` ends its op casting."""

    def __init__(self, amp: Amp, engine: OptLevelEngine) -> None:
        self._amp = amp
        self._engine = engine

    def _deactivate(self) -> None:
        for setup in self._amp.setups:
            if setup.engine is self._engine:
                setup.close_window()
        self._engine.stop_op_casting()

    def is_active(self) -> bool:
        return isinstance(self._engine.forward_context(), OpCastContext)

    def _clear_cache(self) -> None:
        self._amp.end_casts()

    def disable_casts(self) -> Any:
        return self._amp.disable_casts()

    def scale_loss(self, loss: Any, optimizers: Any, **kwargs: Any) -> Any:
        return self._amp.scale_loss(loss, optimizers, **kwargs)

    @property
    def verbose(self) -> bool:
        return self._engine.policy.verbosity > 0

    @property
    def _default_scaler(self) -> ScalerView:
        return view_of(self._engine.scalers[0])


WRITABLE = ("allow_incoming_model_not_fp32", "hard_override")


class AmpStateView:
    """apex's ``_amp_state`` over an ``Amp`` instance (the default one for ``apex.amp``)."""

    def __init__(self, amp: Amp) -> None:
        object.__setattr__(self, "_amp", amp)

    def _engine(self, what: str) -> OptLevelEngine:
        amp = self.__dict__["_amp"]
        if not amp.setups:
            raise AttributeError(f"_amp_state.{what} exists after amp.initialize(model, optimizer, opt_level=...) has been called")
        engine = amp.engine
        if not isinstance(engine, OptLevelEngine):
            raise AttributeError(f"_amp_state.{what} describes the builtin engine; impl='apex' keeps its state in apex itself")
        return engine

    @property
    def allow_incoming_model_not_fp32(self) -> bool:
        return self._amp.allow_incoming_model_not_fp32

    @property
    def hard_override(self) -> bool:
        return False

    @property
    def loss_scalers(self) -> list[ScalerView]:
        return [view_of(scaler) for scaler in self._engine("loss_scalers").scalers]

    @property
    def opt_properties(self) -> PropertiesView:
        return PropertiesView(self._engine("opt_properties").policy)

    @property
    def handle(self) -> SetUpHandle:
        return SetUpHandle(self._amp, self._engine("handle"))

    @property
    def verbosity(self) -> int:
        return self._engine("verbosity").policy.verbosity

    @property
    def min_loss_scale(self) -> float | None:
        return self._engine("min_loss_scale").policy.min_loss_scale

    @property
    def max_loss_scale(self) -> float:
        return self._engine("max_loss_scale").policy.max_loss_scale

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "allow_incoming_model_not_fp32":
            self._amp.allow_incoming_model_not_fp32 = bool(value)
        elif name == "hard_override":
            if value:
                raise ConfigError("_amp_state.hard_override=True (skip apex's property checks) is not supported; pass valid overrides")
        else:
            raise AttributeError(f"_amp_state.{name} cannot be set; writable: {', '.join(WRITABLE)} (and loss_scalers[i]._loss_scale)")


_amp_state = AmpStateView(default)


def master_params(optimizer: Optimizer) -> Iterator[nn.Parameter]:
    """apex's ``_amp_state.master_params``: the params ``optimizer`` steps (fp32 masters under O2/O5)."""
    return default.master_params(optimizer)
