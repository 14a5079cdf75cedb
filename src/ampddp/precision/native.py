"""Native torch AMP (``torch.autocast`` + ``torch.amp.GradScaler``) behind the engine interface."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ampddp.errors import AmpUsageError, ConfigError, closest
from ampddp.precision.buffer_guard import BufferGuard
from ampddp.precision.casting.device_autocast import DeviceAutocast
from ampddp.precision.casting.tensors import device_types
from ampddp.precision.diagnostics import overflow_origin
from ampddp.precision.engine import PrecisionEngine, check_loss, check_models_and_optimizers
from ampddp.precision.policy import DYNAMIC, parse_setting
from ampddp.precision.state import PrecisionState, ScalerState

logger = logging.getLogger("ampddp.precision")
NATIVE_SETTINGS = ("loss_scale", "init_loss_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


class NativeAmpEngine(PrecisionEngine):
    """Autocast to ``dtype`` on the models' devices; a GradScaler when scaling is on (``mode``: the
    mode's name, from the mode table).

    ``loss_scale``: "dynamic" (default for float16) or None (default for bfloat16: no scaling).
    """

    def __init__(self, mode: str, dtype: torch.dtype, **settings: Any) -> None:
        unknown = [key for key in settings if key not in NATIVE_SETTINGS]
        if unknown:
            raise ConfigError(
                f"unknown native AMP setting {unknown[0]!r}{closest(unknown[0], NATIVE_SETTINGS)}; valid: {', '.join(NATIVE_SETTINGS)}"
            )
        self.dtype = dtype
        self.mode = mode
        loss_scale = settings.get("loss_scale", DYNAMIC if dtype == torch.float16 else None)
        if loss_scale not in (DYNAMIC, None, "none"):
            raise ConfigError(f"loss_scale={loss_scale!r} is not valid for {self.mode}; valid: 'dynamic' or None (no scaling)")
        self.enabled = parse_setting("enabled", settings.get("enabled", True))
        self._scaler_args = {
            "init_scale": parse_setting("init_loss_scale", settings.get("init_loss_scale", 2.0**16)),
            "growth_factor": parse_setting("growth_factor", settings.get("growth_factor", 2.0)),
            "backoff_factor": parse_setting("backoff_factor", settings.get("backoff_factor", 0.5)),
            "growth_interval": parse_setting("growth_interval", settings.get("growth_interval", 2000)),
            "enabled": self.enabled and loss_scale == DYNAMIC,
        }
        self._device_types: tuple[str, ...] = ("cpu",)
        self.scaler = torch.amp.GradScaler("cpu", **self._scaler_args)
        self._optimizers: list[Optimizer] = []
        self._unscaled: set[int] = set()
        self._stepped = False
        self._skipped = 0
        self._named_params: list[tuple[str, nn.Parameter]] = []
        self._buffer_guard: BufferGuard | None = None
        self._handles: list[RemovableHandle] = []

    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        check_models_and_optimizers(models, optimizers)
        self._device_types = device_types(models)
        self.scaler = torch.amp.GradScaler(self._device_types[0], **self._scaler_args)
        self._optimizers = list(optimizers)
        self._named_params = [(f"models[{i}].{name}", p) for i, model in enumerate(models) for name, p in model.named_parameters()]
        self.teardown()
        if self.scaler.is_enabled():
            self._buffer_guard = BufferGuard(models)
            self._handles = self._buffer_guard.install(models)
        logger.info("precision %s", self.summary())
        return models, optimizers

    def summary(self) -> str:
        """One line saying what the mode does, as the opt levels' set-up says it."""
        if not self.enabled:
            return f"{self.mode} disabled: fp32 throughout"
        scaling = (f"dynamic loss scale from {self._scaler_args['init_scale']:g}" if self._scaler_args["enabled"]
                   else "no loss scaling")  # fmt: skip
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.mode}: torch.autocast {dtype} on {', '.join(self._device_types)} (torch's op lists), fp32 weights, {scaling}"

    def teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forward_context(self) -> AbstractContextManager[Any]:
        return DeviceAutocast(self._device_types, self.dtype, self.enabled)

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        check_loss(loss, "engine.backward")
        if loss_id != 0:
            raise ConfigError(f"loss_id={loss_id!r} is not valid for {self.mode}: native AMP has one scaler (loss_id 0)")
        self.scaler.scale(loss).backward()
        self._stepped = False

    def _check_known(self, optimizer: Optimizer) -> None:
        if not any(optimizer is known for known in self._optimizers):
            raise AmpUsageError("this optimizer was not passed to setup of this engine")

    def unscale_(self, optimizer: Optimizer) -> None:
        self._check_known(optimizer)
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, *optimizers: Optimizer) -> bool:
        if not optimizers:
            raise AmpUsageError("engine.step needs the optimizers to step, e.g. engine.step(optimizer)")
        if self._stepped:
            raise AmpUsageError(
                "engine.step was already called since the last backward: step every optimizer in one call, "
                "engine.step(opt_a, opt_b), so that the loss scale is updated once per backward"
            )
        for optimizer in optimizers:
            self._check_known(optimizer)
        before = self.scaler.get_scale()
        for optimizer in optimizers:
            self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.clear()
        self._stepped = True
        skipped = self.scaler.is_enabled() and self.scaler.get_scale() < before
        self._skipped += int(skipped)
        if skipped:
            self.last_overflow = overflow_origin(self._named_params)
        if self._buffer_guard is not None:
            # A skipped step leaves no trace: buffers its forwards changed (BatchNorm statistics) go back.
            if skipped:
                self._buffer_guard.restore()
            else:
                self._buffer_guard.commit()
        return not skipped

    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        self._check_known(optimizer)
        for group in optimizer.param_groups:
            yield from group["params"]

    def loss_scale(self, loss_id: int = 0) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.dtype if self.enabled else None

    def precision_state(self) -> PrecisionState:
        scalers = []
        if self.scaler.is_enabled():
            state = self.scaler.state_dict()
            scalers.append(
                ScalerState(
                    dynamic=True, loss_scale=float(state["scale"]), unskipped=int(state["_growth_tracker"]), skipped_steps=self._skipped
                )
            )
        return PrecisionState(mode=self.mode, impl="builtin", scalers=tuple(scalers), skipped_steps=self._skipped)

    def load_precision_state(self, state: PrecisionState) -> None:
        expected = 1 if self.scaler.is_enabled() else 0
        if len(state.scalers) != expected:
            raise ConfigError(f"precision state has {len(state.scalers)} loss scalers; {self.mode} here expects {expected}")
        self.check_precision_state(state)
        skipped = state.skipped_steps
        if state.scalers:
            saved = state.scalers[0]
            grad_scaler_state = dict(self.scaler.state_dict(), scale=saved.loss_scale, _growth_tracker=saved.unskipped)
            self.scaler.load_state_dict(grad_scaler_state)
            skipped = saved.skipped_steps or 0
        self._skipped = skipped
