"""Native torch AMP (``torch.autocast`` + ``torch.amp.GradScaler``) behind the engine interface."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision.buffer_guard import BufferGuard
from ampddp.precision.casting.device_autocast import DeviceAutocast
from ampddp.precision.casting.registry import OpRegistry
from ampddp.precision.casting.tensors import device_types
from ampddp.precision.diagnostics import overflow_origin
from ampddp.precision.engine import PrecisionEngine, check_loss, check_models_and_optimizers
from ampddp.precision.policy import DYNAMIC, parse_setting
from ampddp.precision.shards import ShardLocalGradScaler
from ampddp.precision.state import PrecisionState, ScalerState
from ampddp.precision.verdict import agreed_flag
from ampddp.torch_compat import grad_scaler_found_infs

logger = logging.getLogger("ampddp.precision")
NATIVE_SETTINGS = ("loss_scale", "init_loss_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


class NativeAmpEngine(PrecisionEngine):
    """Autocast to ``dtype`` on the models' devices; a GradScaler when scaling is on (``mode``: the
    mode's name, from the mode table).

    ``loss_scale``: "dynamic" (default for float16) or None (default for bfloat16: no scaling).
    """

    def __init__(
        self,
        mode: str,
        dtype: torch.dtype,
        *,
        loss_scale: str | None,
        init_loss_scale: Any = 2.0**16,
        growth_factor: Any = 2.0,
        backoff_factor: Any = 0.5,
        growth_interval: Any = 2000,
        enabled: Any = True,
    ) -> None:
        self.dtype = dtype
        self.mode = mode
        if loss_scale not in (DYNAMIC, None, "none"):
            raise ConfigError(f"loss_scale={loss_scale!r} is not valid for {self.mode}; valid: 'dynamic' or None (no scaling)")
        self.enabled = parse_setting("enabled", enabled)
        self._scaler_args = {
            "init_scale": parse_setting("init_loss_scale", init_loss_scale),
            "growth_factor": parse_setting("growth_factor", growth_factor),
            "backoff_factor": parse_setting("backoff_factor", backoff_factor),
            "growth_interval": parse_setting("growth_interval", growth_interval),
            "enabled": self.enabled and loss_scale == DYNAMIC,
        }
        self._device_types: tuple[str, ...] = ("cpu",)
        self.scaler = ShardLocalGradScaler("cpu", **self._scaler_args)
        self._optimizers: list[Optimizer] = []
        self._unscaled: set[int] = set()
        self._stepped = False
        self._skipped = 0
        self._named_params: list[tuple[str, nn.Parameter]] = []
        self._buffer_guard: BufferGuard | None = None
        self._handles: list[RemovableHandle] = []

    @classmethod
    def for_mode(
        cls, spec: Any, settings: Mapping[str, Any], registry: OpRegistry | None = None, allow_low_precision_models: bool = False
    ) -> NativeAmpEngine:
        """The engine of the mode table's row ``spec`` (its name and dtype) with ``settings`` (the row's checked names;
        ``loss_scale`` defaults to "dynamic" for float16, None for bfloat16). torch.autocast applies no registered
        functions and casts no models' params, so ``registry`` and ``allow_low_precision_models`` decide nothing here."""
        return cls(spec.name, spec.compute_dtype, **{"loss_scale": DYNAMIC if spec.compute_dtype == torch.float16 else None, **settings})

    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        check_models_and_optimizers(models, optimizers)
        self._device_types = device_types(models)
        self.scaler = ShardLocalGradScaler(self._device_types[0], **self._scaler_args)
        first = next((param for model in models for param in model.parameters()), None)
        if self.scaler.is_enabled() and first is not None:
            # GradScaler makes its scale at its first scale(): a pipeline stage without a loss never calls it.
            self.scaler.scale(torch.ones((), device=first.device))
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

    def scale_for_backward(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        check_loss(loss, "engine.backward")
        self._check_loss_id(loss_id)
        return self.scaler.scale(loss)

    def backward_done(self, loss_id: int = 0) -> None:
        self._check_loss_id(loss_id)
        self._stepped = False

    def _check_loss_id(self, loss_id: int) -> None:
        if loss_id != 0:
            raise ConfigError(f"loss_id={loss_id!r} is not valid for {self.mode}: native AMP has one scaler (loss_id 0)")

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
        self._agree_verdict(optimizers)
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

    def _agree_verdict(self, optimizers: tuple[Optimizer, ...]) -> None:
        """Unscale, then make GradScaler's per-device non-finite flags say what every rank of the verdict group found
        (and a non-finite gradient norm), so that its ``step`` skips and its ``update`` backs off on all of them alike.
        Without a group or a norm check GradScaler decides alone, as it always did."""
        norm_flags = self._take_norm_overflow()
        if not self.scaler.is_enabled() or not (norm_flags or self._verdict_group is not None):
            return
        for optimizer in optimizers:
            self.unscale_(optimizer)
        found = [grad_scaler_found_infs(self.scaler, optimizer) for optimizer in optimizers]
        flags = [flag for per_device in found for flag in per_device.values()] + norm_flags
        agreed = agreed_flag(flags, self._verdict_group, self._device_types[0])
        for per_device in found:
            for flag in per_device.values():
                flag.copy_(agreed.reshape(flag.shape))
            if not per_device:  # no gradients here: the step still follows the ranks that had some
                per_device[agreed.device] = agreed.reshape(())

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
