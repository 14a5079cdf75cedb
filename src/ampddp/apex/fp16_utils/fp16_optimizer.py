"""apex.fp16_utils.fp16_optimizer: pre-amp apex's ``FP16_Optimizer`` on ampddp's O2 machinery.

Scripts from before ``apex.amp`` made their model half (``network_to_half`` / ``model.half()``),
wrapped the optimizer in ``FP16_Optimizer`` and replaced ``loss.backward()`` with
``optimizer.backward(loss)``. apex deleted the class with amp; this one keeps its API, its
semantics and its ``state_dict`` format, built on what ``build_engine("O2")`` uses:
:class:`ampddp.precision.master.OptimizerGrads` swaps fp32 masters into the wrapped optimizer's
param groups (fp32 params stay their own masters), unscales every new gradient into the masters
with one fused pass and non-finite check (:meth:`ampddp.precision.scaler.LossScaler.unscale_`),
and copies the stepped masters back into the model with one foreach call. Started from the same
weights, a run matches the O2 engine bit for bit.

apex behaviour kept: the scale is updated in ``step`` (dynamic: halved on overflow, grown after a
clean window) and an overflowed step is skipped (returns None); ``clip_master_grads`` returns -1
and ``inspect_master_grad_data`` None while overflowed; closures (``step(closure)``) re-run the
closure until it does not overflow, as apex did; pickling the wrapper itself is refused (use
``state_dict``). Differences, each where apex silently misbehaved: fp32 params that get gradients
from several ``backward`` calls are unscaled once each (apex divided earlier grads again);
``step`` after ``backward(..., update_master_grads=False)`` without ``update_master_grads()``, or
after a plain ``loss.backward()``, raises instead of stepping stale or still-scaled gradients;
``state_dict()`` holds a copy of the loss scaler (apex's aliased the live one); the model's fp16
gradients are dropped once moved into the masters (they are scaled, meaningless values) and the
masters' gradients after each step, as in the O2 engine, so ``model.zero_grad()`` in place of
``optimizer.zero_grad()`` stays correct; a dynamic scale stuck at its floor of 1 while every step
overflows raises ``NonFiniteGradientsError`` after 10 skips instead of skipping forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.apex._names import unknown_name
from ampddp.apex.fp16_utils.fp16util import clip_grad_norm, master_params_to_model_params, model_grads_to_master_grads
from ampddp.apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler, restore_scaler
from ampddp.errors import AmpUsageError, ConfigError, NonFiniteGradientsError
from ampddp.precision import GradPhase, OptimizerGrads

__all__ = ["FP16_Optimizer", "clip_grad_norm", "master_params_to_model_params", "model_grads_to_master_grads"]
REPLACEMENTS = {
    "FP16_Module": "apex.fp16_utils.FP16Model (or network_to_half)",
    "fp32_to_fp16": "tensor.half(), or ampddp.precision.casting.cast_floating(obj, torch.float16) for nested inputs",
    "fp16_to_fp32": "tensor.float(), or ampddp.precision.casting.cast_floating(obj, torch.float32) for nested outputs",
}
STATE_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step", "optimizer_state_dict", "fp32_from_fp16")
"""apex's FP16_Optimizer.state_dict() keys."""
DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
"""``dynamic_loss_args`` keys: fp16_utils' DynamicLossScaler's, plus amp's bounds (last apex releases)."""
WRAPPED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

logger = logging.getLogger("ampddp.apex.fp16_utils")


def _make_scaler(
    static_loss_scale: float, dynamic_loss_scale: bool, dynamic_loss_args: Mapping[str, Any] | None
) -> LossScaler | DynamicLossScaler:
    if not isinstance(dynamic_loss_scale, bool):
        raise ConfigError(f"dynamic_loss_scale={dynamic_loss_scale!r} is not valid; valid: True or False")
    if not dynamic_loss_scale:
        return LossScaler(static_loss_scale)  # dynamic_loss_args only matter with dynamic_loss_scale=True, as in apex
    if dynamic_loss_args is None:
        return DynamicLossScaler()
    if not isinstance(dynamic_loss_args, Mapping):
        raise ConfigError(f"dynamic_loss_args must be a dict, got {type(dynamic_loss_args).__name__}")
    unknown = sorted(set(dynamic_loss_args) - set(DYNAMIC_ARGS))
    if unknown:
        raise ConfigError(f"dynamic_loss_args has unknown keys {unknown}; valid keys: {', '.join(DYNAMIC_ARGS)}")
    return DynamicLossScaler(**dynamic_loss_args)


def _shapes(saved: Any) -> Any:
    """Per group, the shapes of saved master tensors (type names where something else stands)."""
    if not isinstance(saved, (list, tuple)):
        return type(saved).__name__
    return [
        [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in group]
        if isinstance(group, (list, tuple))
        else type(group).__name__
        for group in saved
    ]


def _check_param_dtypes(optimizer: Optimizer) -> None:
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param.dtype not in WRAPPED_DTYPES:
                raise ConfigError(
                    f"FP16_Optimizer: param_groups[{g}]['params'][{i}] is {param.dtype}; it wraps float16/bfloat16 params "
                    "(stepped through fp32 master copies) and float32 params (stepped as they are)"
                )


class FP16_Optimizer:
    """Wrap ``init_optimizer`` (over a model already made half) with fp32 master weights and loss scaling.

    ``static_loss_scale`` is the fixed scale unless ``dynamic_loss_scale=True``, which uses a
    :class:`DynamicLossScaler` built from ``dynamic_loss_args``. ``verbose`` prints the params taken in.
    Replace ``loss.backward()`` with ``optimizer.backward(loss)``; then ``optimizer.step()``.
    """

    def __init__(
        self,
        init_optimizer: Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Mapping[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if isinstance(init_optimizer, FP16_Optimizer):
            raise AmpUsageError("this optimizer is already an FP16_Optimizer; wrap the torch optimizer once")
        if not isinstance(init_optimizer, Optimizer):
            raise AmpUsageError(f"FP16_Optimizer wraps a torch.optim.Optimizer, got {type(init_optimizer).__name__}")
        _check_param_dtypes(init_optimizer)
        self.loss_scaler = _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        self.dynamic_loss_scale = dynamic_loss_scale
        self.verbose = verbose
        self.optimizer = init_optimizer
        for g, group in enumerate(init_optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {g}:")
            for param in group["params"]:
                self.maybe_print(f"FP16_Optimizer received {param.type()} with {param.size()}")
        self._grads = OptimizerGrads(init_optimizer, make_masters=True)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        self._unscaled_in_place = False

    def maybe_print(self, msg: str) -> None:
        """Print ``msg`` when constructed with ``verbose=True`` (apex's sanity-check output)."""
        if self.verbose:
            print(msg)

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # ---- apex's parameter lists ------------------------------------------------------------------
    def _model_of(self) -> dict[int, nn.Parameter]:
        self._grads.sync_param_groups()
        return {id(master): param for param, master in zip(self._grads.model_params, self._grads.masters)}

    @property
    def fp16_groups(self) -> list[list[nn.Parameter]]:
        """Per param group: the model's low-precision params (that require grad)."""
        model_of = self._model_of()
        return [[model_of[id(p)] for p in group["params"] if id(p) in model_of and p.requires_grad] for group in self.param_groups]

    @property
    def fp32_from_fp16_groups(self) -> list[list[nn.Parameter]]:
        """Per param group: the fp32 masters of those params, which the wrapped optimizer steps."""
        model_of = self._model_of()
        return [[p for p in group["params"] if id(p) in model_of and p.requires_grad] for group in self.param_groups]

    @property
    def fp32_from_fp32_groups(self) -> list[list[nn.Parameter]]:
        """Per param group: the fp32 params, stepped as they are (their own masters)."""
        model_of = self._model_of()
        return [[p for p in group["params"] if id(p) not in model_of and p.requires_grad] for group in self.param_groups]

    @property
    def all_fp16_params(self) -> list[nn.Parameter]:
        return [p for group in self.fp16_groups for p in group]

    @property
    def all_fp32_from_fp16_params(self) -> list[nn.Parameter]:
        return [p for group in self.fp32_from_fp16_groups for p in group]

    @property
    def all_fp32_from_fp32_params(self) -> list[nn.Parameter]:
        return [p for group in self.fp32_from_fp32_groups for p in group]

    # ---- gradients -------------------------------------------------------------------------------
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or, with ``set_grads_to_None``, drop) the masters' and fp32 params' grads; drop the model's."""
        record = self._grads
        record.sync_param_groups()
        params = list(record.master_params())
        if set_grads_to_None:
            for param in params:
                param.grad = None
        else:
            grads = [param.grad for param in params if param.grad is not None]
            for grad in grads:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
            if grads:
                torch._foreach_zero_(grads)
        record.discard_grads()
        self._unscaled_in_place = False

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Backward of ``loss.float() * loss_scale``; then (``update_master_grads``) unscale into the masters.

        With several losses per step, pass ``update_master_grads=False`` and call
        :meth:`update_master_grads` once after the last backward.
        """
        if not isinstance(loss, torch.Tensor):
            raise AmpUsageError(f"FP16_Optimizer.backward needs the loss tensor, got {type(loss).__name__}")
        record = self._grads
        if self._unscaled_in_place:
            record.stash_grads()  # fp32 params' grads are unscaled already: keep them out of the next unscale
            self._unscaled_in_place = False
        try:
            self.loss_scaler.scaler.scale_loss(loss).backward(retain_graph=retain_graph)
        except BaseException:
            record.discard_new_grads()
            raise
        record.phase = GradPhase.SCALED
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the gradients of the backward calls since the last update into the fp32 master grads.

        Sets :attr:`overflow` (dynamic scaling: any inf/NaN in them); a no-op when nothing is pending.
        """
        record = self._grads
        if record.phase is not GradPhase.SCALED:
            return
        record.unscale_(self.loss_scaler.scaler)
        record.phase = GradPhase.READY
        self._unscaled_in_place = True
        found = record.found_inf
        self.overflow = self.loss_scaler.dynamic and found is not None and bool(found.item())

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """Per param group, the fp32 master grads (None where a param has none); None while overflowed."""
        if self.overflow:
            logger.warning(
                "calling FP16_Optimizer.inspect_master_grad_data while in an overflow state: gradients are currently "
                "invalid (may be inf, nan, or stale); returning None"
            )
            return None
        return [[None if p.grad is None else p.grad.data for p in group["params"]] for group in self.param_groups]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | int:
        """Clip the fp32 master grads with torch's ``clip_grad_norm_``; their total norm, or -1 if overflowed."""
        if self._grads.phase is GradPhase.SCALED:
            raise AmpUsageError("clip_master_grads after backward(..., update_master_grads=False): call update_master_grads() first")
        if self.overflow:
            return -1
        return self.clip_grad_norm(list(self._grads.master_params()), max_norm, norm_type)

    # ---- stepping --------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        record = self._grads
        record.sync_param_groups()
        if record.phase is GradPhase.SCALED:
            raise AmpUsageError(
                "FP16_Optimizer.step() after backward(loss, update_master_grads=False): the master gradients are not "
                "updated yet; call optimizer.update_master_grads() before step()"
            )
        if any(param.grad is not None for param in record.model_params):
            raise AmpUsageError(
                "FP16_Optimizer.step() found model gradients that never reached the fp32 master params: replace "
                "loss.backward() with optimizer.backward(loss)"
            )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the loss scale; unless the gradients overflowed, step the masters and copy them to the model.

        Returns the wrapped optimizer's ``step`` result, or None for a skipped step. A ``closure`` must
        call ``optimizer.zero_grad()``, compute the loss, call ``optimizer.backward(loss)`` and return it.
        """
        self._check_ready()
        scale = self.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            logger.warning("gradient overflow: skipping step; attempted loss scale %g, reducing to %g", scale, self.loss_scale)
            self._grads.drop_grads()
            self._grads.reset_step_state()
            return None
        result = self.optimizer.step() if closure is None else self._step_with_closure(closure)
        self._grads.copy_masters_to_model()
        self._grads.reset_step_state()
        return result

    def _update_scale(self, overflow: bool) -> None:
        try:
            self.loss_scaler.update_scale(overflow)
        except NonFiniteGradientsError as error:
            raise NonFiniteGradientsError(f"FP16_Optimizer: {error}") from None

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        record = self._grads

        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The wrapped optimizer moved the masters since the last call: refresh the model first.
                with torch.no_grad():
                    if record.model_params:
                        torch._foreach_copy_(record.model_params, record.masters)
            loss = closure()
            while self.overflow:
                scale = self.loss_scale
                self._update_scale(True)
                logger.warning(
                    "gradient overflow within closure: attempted loss scale %g, reducing to %g and re-running it", scale, self.loss_scale
                )
                loss = closure()
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """apex's format: loss scaler, dynamic flag, overflow, closure flag, optimizer state, fp32 masters."""
        return {
            "loss_scaler": restore_scaler(self.loss_scaler),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (ours or apex's); load the model's own state_dict separately.

        Everything is checked before anything changes.
        """
        if not isinstance(state_dict, Mapping):
            raise ConfigError(f"FP16_Optimizer.load_state_dict needs the dict state_dict() returned, got {type(state_dict).__name__}")
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise ConfigError(f"FP16_Optimizer state is missing {missing}; expected apex's keys {list(STATE_KEYS)}")
        scaler = restore_scaler(state_dict["loss_scaler"], "FP16_Optimizer state 'loss_scaler'")
        flags = {key: state_dict[key] for key in ("dynamic_loss_scale", "overflow", "first_closure_call_this_step")}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise ConfigError(f"FP16_Optimizer state {key!r}={value!r} is not valid; it must be True or False")
        if flags["dynamic_loss_scale"] != scaler.dynamic:
            raise ConfigError(
                f"FP16_Optimizer state says dynamic_loss_scale={flags['dynamic_loss_scale']} but its loss_scaler is a "
                f"{type(scaler).__name__}"
            )
        saved_masters = self._check_saved_masters(state_dict["fp32_from_fp16"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current, saved in zip(self.all_fp32_from_fp16_params, saved_masters):
                current.copy_(saved)
        self.loss_scaler = scaler
        self.dynamic_loss_scale = flags["dynamic_loss_scale"]
        self.overflow = flags["overflow"]
        self.first_closure_call_this_step = flags["first_closure_call_this_step"]

    def _check_saved_masters(self, saved: Any) -> list[torch.Tensor]:
        shapes = [[tuple(p.shape) for p in group] for group in self.fp32_from_fp16_groups]
        got = _shapes(saved)
        if got != shapes:
            raise ConfigError(
                f"FP16_Optimizer state 'fp32_from_fp16' does not fit this optimizer: it holds {got}, this optimizer's fp32 "
                f"masters are {shapes} (was it saved from a differently built model or optimizer?)"
            )
        return [t for group in saved for t in group]

    # ---- apex's promoted attributes --------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale; settable (e.g. to schedule a static scale)."""
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (holding the fp32 masters), e.g. to set the learning rate."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    def __repr__(self) -> str:
        return f"FP16_Optimizer({type(self.optimizer).__name__}, {self.loss_scaler!r})"


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
