"""apex-compatible API: change ``from apex import amp`` to ``from ampddp import amp`` and run.

Everything apex kept in process-wide globals lives in an ``Amp`` object here. The module-level
functions (``amp.initialize``, ``amp.scale_loss``, ...) belong to one default instance; create more
with ``amp.Amp()`` to train independent set-ups in one process. Calling ``initialize`` again starts
the instance afresh (new scalers, hooks of the previous set-up removed).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision.apex_backend import ApexEngine
from ampddp.precision.factory import build_engine
from ampddp.precision.opt_level import OptLevelEngine, check_models_and_optimizers
from ampddp.precision.policy import check_opt_level
from ampddp.precision.registry import (
    BFLOAT16,
    FP32,
    LOW,
    PROMOTE,
    OpRegistry,
    bfloat16_function,
    float_function,
    half_function,
    promote_function,
)
from ampddp.precision.scaler import GRAD_SCALER_KEYS

_APEX_KEY = re.compile(r"loss_scaler(\d+)")


def _as_list(value: Any, kind: type, name: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, (list, tuple)):
        return list(value), True
    raise AmpUsageError(f"{name} must be a {kind.__name__} or a list of them, got {type(value).__name__}")


class Amp:
    """One amp set-up: its op registry, its engine (scalers, masters, hooks)."""

    def __init__(self) -> None:
        self._registry = OpRegistry()
        self._engine: OptLevelEngine | ApexEngine | None = None

    # ---- registration (before initialize) ------------------------------------------------------
    def register_half_function(self, module: Any, name: str) -> None:
        """Run ``module.name`` in the low-precision dtype under O1/O4 (takes effect at initialize)."""
        self._registry.register(module, name, LOW)

    def register_float_function(self, module: Any, name: str) -> None:
        """Run ``module.name`` in fp32 under O1/O4 (takes effect at initialize)."""
        self._registry.register(module, name, FP32)

    def register_promote_function(self, module: Any, name: str) -> None:
        """Cast ``module.name``'s inputs to their widest float type under O1/O4."""
        self._registry.register(module, name, PROMOTE)

    def register_bfloat16_function(self, module: Any, name: str) -> None:
        """Run ``module.name`` in bfloat16 under O1/O4."""
        self._registry.register(module, name, BFLOAT16)

    # ---- set-up ---------------------------------------------------------------------------------
    def initialize(
        self,
        models: nn.Module | list[nn.Module],
        optimizers: Optimizer | list[Optimizer] | None = None,
        enabled: bool = True,
        opt_level: str = "O1",
        impl: str = "builtin",
        **overrides: Any,
    ) -> Any:
        """Prepare models (and optimizers) for ``opt_level``; returns them in the shapes given.

        ``overrides`` are apex's keywords (cast_model_type, patch_torch_functions,
        keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs, num_losses,
        verbosity, min_loss_scale, max_loss_scale) plus ampddp's scaler settings
        (init_loss_scale, growth_factor, backoff_factor, growth_interval, hysteresis).
        """
        model_list, models_were_list = _as_list(models, nn.Module, "models")
        optimizer_list, optimizers_were_list = ([], False) if optimizers is None else _as_list(optimizers, Optimizer, "optimizers")
        engine = build_engine(check_opt_level(opt_level), impl=impl, registry=self._registry, enabled=enabled, **overrides)
        check_models_and_optimizers(model_list, optimizer_list)
        if self._engine is not None:
            self._engine.teardown()
            self._engine = None
        engine.setup(model_list, optimizer_list)
        self._engine = engine
        out_models = model_list if models_were_list else model_list[0]
        if optimizers is None:
            return out_models
        return out_models, (optimizer_list if optimizers_were_list else optimizer_list[0])

    @property
    def engine(self) -> OptLevelEngine | ApexEngine:
        """The engine behind this instance (raises before ``initialize``)."""
        if self._engine is None:
            raise AmpUsageError("amp.initialize(model, optimizer, opt_level=...) must be called first")
        return self._engine

    # ---- per iteration --------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: Optimizer | list[Optimizer],
        loss_id: int = 0,
        model: nn.Module | None = None,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """``with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()``.

        On exit the new grads are unscaled (into fp32 masters under O2/O5) and checked; an overflow
        halves the scale and makes the next ``optimizer.step()`` a no-op. ``model`` is accepted for
        apex compatibility and unused, as in apex.
        """
        if delay_overflow_check:
            raise ConfigError("delay_overflow_check=True is not supported; valid: False (the overflow check runs when scale_loss exits)")
        optimizer_list, _ = _as_list(optimizers, Optimizer, "optimizers")
        with self.engine.scale_loss(loss, optimizer_list, loss_id=loss_id, delay_unscale=delay_unscale) as scaled:
            yield scaled

    def forward_context(self) -> AbstractContextManager[Any]:
        """The O1/O4 op-cast context; models from ``initialize`` enter it on their own. Use it for a
        loss computed outside the model, so loss functions run in fp32 as they did under apex."""
        return self.engine.forward_context()

    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        """The params ``optimizer`` steps: fp32 masters under O2/O5. Clip these."""
        return self.engine.master_params(optimizer)

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """apex's format: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``."""
        scalers = self.engine.state_dict()["scalers"]
        return {f"loss_scaler{i}": {"loss_scale": float(s["loss_scale"]), "unskipped": int(s["unskipped"])} for i, s in enumerate(scalers)}

    def grad_scaler_state_dict(self, loss_id: int = 0) -> dict[str, Any]:
        """Scaler ``loss_id`` in ``torch.amp.GradScaler.state_dict()`` form."""
        engine = self.engine
        if not isinstance(engine, OptLevelEngine):
            raise AmpUsageError("grad_scaler_state_dict needs the builtin engine (impl='builtin')")
        return engine.scaler_for(loss_id).grad_scaler_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore scalers from apex's format, or (one scaler) from a GradScaler state dict.

        Call after ``initialize``, as apex documents. Nothing changes unless the whole dict is valid.
        """
        engine = self.engine
        count = len(engine.state_dict()["scalers"])
        if not isinstance(state_dict, Mapping):
            raise ConfigError(f"amp state must be a dict, got {type(state_dict).__name__}")
        if "scale" in state_dict:
            if count != 1:
                raise ConfigError(
                    f"a torch GradScaler state holds one scaler, but this amp has {count} (num_losses); "
                    f"pass apex's form with keys loss_scaler0..loss_scaler{count - 1}"
                )
            engine.load_state_dict({"scalers": [dict(state_dict)]})
            return
        indices = {}
        for key in state_dict:
            match = _APEX_KEY.fullmatch(str(key))
            if match is None:
                raise ConfigError(
                    f"amp state key {key!r} is not a loss scaler; expected apex keys loss_scaler0..loss_scaler{count - 1} "
                    f"or a torch GradScaler state with keys {list(GRAD_SCALER_KEYS)}"
                )
            indices[int(match.group(1))] = state_dict[key]
        if sorted(indices) != list(range(count)):
            raise ConfigError(
                f"amp state has scalers {sorted(f'loss_scaler{i}' for i in indices)} but this amp has {count} "
                f"(num_losses={count}): expected exactly loss_scaler0..loss_scaler{count - 1}"
            )
        engine.load_state_dict({"scalers": [indices[i] for i in range(count)]})


default = Amp()
"""The instance behind the module-level functions."""

initialize = default.initialize
scale_loss = default.scale_loss
master_params = default.master_params
state_dict = default.state_dict
load_state_dict = default.load_state_dict
grad_scaler_state_dict = default.grad_scaler_state_dict
forward_context = default.forward_context
register_half_function = default.register_half_function
register_float_function = default.register_float_function
register_promote_function = default.register_promote_function
register_bfloat16_function = default.register_bfloat16_function

__all__ = [
    "Amp",
    "bfloat16_function",
    "default",
    "float_function",
    "forward_context",
    "grad_scaler_state_dict",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_bfloat16_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
