"""apex.optimizers on native torch: FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad.

apex-era scripts build these optimizers by name (``from apex.optimizers import FusedAdam``), but apex's
versions need its compiled CUDA extension (``amp_C``) and run nowhere else. The classes here keep
apex's constructor signatures (names, defaults, order) and the update rules of apex's CUDA kernels,
on torch's multi-tensor kernels, on any device:

* FusedSGD, FusedAdam, FusedAdagrad subclass ``torch.optim.SGD`` / ``Adam`` / ``Adagrad`` and step
  through torch's own update functions (``foreach`` on the CPU, ``fused`` on CUDA) wherever apex's
  rule is torch's; the modes torch lacks (``wd_after_momentum``, ``bias_correction=False``,
  ``adagrad_w_mode``) are written with ``torch._foreach_*`` ops.
* FusedLAMB and FusedNovoGrad (no torch counterpart) are written with ``torch._foreach_*`` ops, with
  apex's kernel math: LAMB's global-norm clipping and trust ratio, NovoGrad's per-tensor second
  moment kept as a norm.

fp16/bf16 params are updated in fp32 and rounded back, as apex's kernels do; their optimizer state
is fp32 (apex kept LAMB/NovoGrad/SGD state in the param's dtype) and stays fp32 through
``load_state_dict``. apex arguments that cannot be honoured raise an error saying why; bad values
raise :class:`ampddp.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad as _torch_adagrad
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import required
from torch.optim.sgd import sgd as _torch_sgd

from ampddp.apex._names import unknown_name
from ampddp.errors import ConfigError

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedSGD"]

REPLACEMENTS = {
    "FusedMixedPrecisionLamb": "apex.optimizers.FusedLAMB, which does its math in fp32 for fp16/bf16 params; for fp32 master "
    "weights run it under amp.initialize(model, optimizer, opt_level='O2') (or 'O5' for bf16)",
    "DistributedFusedAdam": "torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=apex.optimizers.FusedAdam, ...) "
    "(sharded optimizer state), or apex.optimizers.FusedAdam on a DistributedDataParallel model",
    "DistributedFusedLAMB": "apex.optimizers.FusedLAMB on a DistributedDataParallel model (under ZeroRedundancyOptimizer LAMB's "
    "max_grad_norm clipping would see only each rank's shard of the gradients)",
    "FP16_Optimizer": "apex.fp16_utils.FP16_Optimizer, or amp.initialize(model, optimizer, opt_level='O2')",
}

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_STEPPABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RefusedOptionError(ConfigError, RuntimeError):
    """An apex optimizer option refused, as apex refused it or because it cannot be honoured here.

    A ``ConfigError`` (so a ``ValueError``) and a ``RuntimeError`` (what apex raised), so code
    catching either keeps working.
    """


# ---------------------------------------------------------------------------------------------
# Validation: every bad value names the argument, the value and what is valid.


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _non_negative(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and (value.is_cuda or float(value) >= 0)
    return _is_number(value) and value >= 0  # NaN fails


def _betas_ok(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_number(b) and 0 <= b < 1 for b in value)


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (_non_negative, "a number >= 0"),
    "eps": (_non_negative, "a number >= 0"),
    "weight_decay": (_non_negative, "a number >= 0"),
    "momentum": (_non_negative, "a number >= 0"),
    "dampening": (_is_number, "a number"),
    "betas": (_betas_ok, "a pair (beta1, beta2) with each in [0, 1)"),
    "max_grad_norm": (
        lambda v: _is_number(v) and v > 0,
        "a number > 0 (float('inf') turns clipping off; apex's kernel divides every gradient by "
        "global_norm / max_grad_norm, so 0 would zero every update)",
    ),
    "norm_type": (lambda v: _is_number(v) and v in (0, 2), "0 (infinity norm) or 2 (L2 norm), the two norms apex's kernel computes"),
}


def _check(owner: str, options: dict[str, Any], group: int | None = None) -> None:
    for key, value in options.items():
        if key not in _RULES or value is required:
            continue
        ok, valid = _RULES[key]
        if not ok(value):
            where = f"{owner}: {key}={value!r}" if group is None else f"{owner}: param group {group}: {key}={value!r}"
            raise ConfigError(f"{where} is not valid; {key} must be {valid}")


def _refuse_amsgrad(owner: str, amsgrad: bool) -> None:
    if amsgrad:
        raise RefusedOptionError(
            f"{owner}(amsgrad=True): apex's {owner} refuses the AMSGrad variant, and so does this drop-in; "
            "use torch.optim.AdamW(params, amsgrad=True) for AMSGrad"
        )


def _float_betas(betas: Any) -> Any:
    return (float(betas[0]), float(betas[1])) if _betas_ok(betas) else betas


# ---------------------------------------------------------------------------------------------
# Shared machinery


@dataclass
class _Batch:
    """One param group's params with grads, as the update rule sees them.

    ``params`` are the tensors updated: the param itself, or for an fp16/bf16 param an fp32 copy
    (or its fp32 master) that ``write_back`` rounds into the param, as apex's kernels compute in fp32.
    """

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    low: list[Tensor] = field(default_factory=list)
    low_results: list[Tensor] = field(default_factory=list)

    def write_back(self) -> None:
        if self.low:
            torch._foreach_copy_(self.low, self.low_results)

    def on_cuda(self) -> bool:
        return all(p.is_cuda for p in self.params)


def _apply_lr(params: list[Tensor], updates: list[Tensor], lr: float | Tensor) -> None:
    """``p -= lr * update`` for each pair (``lr`` a number, or a one-element tensor when capturable)."""
    if isinstance(lr, Tensor):
        torch._foreach_mul_(updates, lr)
        torch._foreach_sub_(params, updates)
    else:
        torch._foreach_add_(params, updates, alpha=-lr)


def _zeros(like: Tensor) -> Tensor:
    return torch.zeros_like(like, memory_format=torch.preserve_format)


def _step_tensor(state: dict[str, Any], target: Tensor, on_device: bool) -> Tensor:
    """``state['step']`` where torch's kernel wants it: on the param's device (fused, capturable) or the CPU."""
    step = state.get("step")
    device = target.device if on_device else torch.device("cpu")
    if step is None:
        step = state["step"] = torch.zeros((), dtype=torch.float32, device=device)
    elif step.device != device or step.dtype != torch.float32:
        step = state["step"] = step.to(device=device, dtype=torch.float32)
    return step


def _stack(values: list[Tensor]) -> Tensor:
    return torch.stack([v.to(device=values[0].device, dtype=torch.float32) for v in values])


class _ApexOptimizer(torch.optim.Optimizer):
    """What the optimizers here share: apex's ``zero_grad``, checked param groups, fp32 state for fp16/bf16 params."""

    set_grad_none: bool = True
    _settings: tuple[str, ...] = ("set_grad_none",)  # constructor choices kept as attributes, as apex kept them

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), **{name: getattr(self, name) for name in self._settings}}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """apex's ``zero_grad()``: grads become None when ``set_grad_none`` (else zeros); ``set_to_none`` overrides."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "betas" in group:
            group["betas"] = _float_betas(group["betas"])
        _check(type(self).__name__, {k: v for k, v in group.items() if k != "params"}, len(self.param_groups) - 1)

    def __setstate__(self, state: dict[str, Any]) -> None:
        defaults = state.get("defaults") or getattr(self, "defaults", {})
        for group in state.get("param_groups", []):
            for key, value in defaults.items():
                group.setdefault(key, value)
        super().__setstate__(state)

    def _gather(self, group: dict[str, Any], master_weights: bool = False) -> _Batch:
        batch = _Batch()
        name = type(self).__name__
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients; use torch.optim.SparseAdam for sparse embeddings")
            if p.dtype not in _STEPPABLE:
                raise ConfigError(f"{name} steps fp16, bf16, fp32 and fp64 params; got a {p.dtype} param of shape {tuple(p.shape)}")
            state = self.state[p]
            if p.dtype in _LOW_PRECISION:
                if master_weights:
                    if "master_param" not in state:
                        state["master_param"] = p.detach().float()
                    target = state["master_param"]
                else:
                    target = p.detach().float()
                batch.low.append(p)
                batch.low_results.append(target)
                grad = p.grad.float()
            else:
                target, grad = p, p.grad
            batch.params.append(target)
            batch.grads.append(grad)
            batch.states.append(state)
        return batch

    def _from_apex_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Rewrite a state dict apex saved into this class's layout (identity unless a subclass knows apex's)."""
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` (accepting apex's layout too), keeping fp16/bf16 params' state fp32.

        torch casts loaded state to each param's dtype; for an fp16/bf16 param the saved fp32 state is
        put back uncast, so resuming continues exactly.
        """
        state_dict = self._from_apex_layout(state_dict)
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is None or param.dtype not in _LOW_PRECISION:
                continue
            for key, value in saved.items():
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)


def _apex_group_step_to_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """apex counts steps per group (``group['step']``), torch per param (``state['step']``): move it."""
    if not any("step" in g for g in state_dict["param_groups"]):
        return state_dict
    states = dict(state_dict["state"])
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        count = group.pop("step", None)
        for pid in group["params"]:
            if pid in states and "step" not in states[pid]:
                states[pid] = {**states[pid], "step": torch.tensor(float(count or 0))}
        groups.append(group)
    return {**state_dict, "state": states, "param_groups": groups}


def _run_closure(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# ---------------------------------------------------------------------------------------------
# FusedSGD


class FusedSGD(_ApexOptimizer, torch.optim.SGD):
    """apex's FusedSGD: torch.optim.SGD's rule through torch's foreach/fused SGD, plus ``wd_after_momentum``.

    ``set_grad_none`` (default False, as apex): ``zero_grad()`` zeroes grads instead of dropping them.
    ``materialize_master_grads`` chose how apex's O2 fed fp16 grads to its kernel; ampddp's O2 always
    materialises fp32 master grads, so either value gives the same update (False's memory saving is
    not reproduced).
    """

    _settings = ("set_grad_none", "wd_after_momentum", "materialize_master_grads")

    def __init__(self, params: Iterable[Any], lr: float = required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:  # fmt: skip
        _check("FusedSGD", {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay})
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError(
                f"FusedSGD: nesterov=True needs momentum > 0 and dampening=0; got momentum={momentum!r}, dampening={dampening!r}"
            )
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov,
                    "maximize": False, "foreach": True, "differentiable": False, "fused": None}  # fmt: skip
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.set_grad_none = bool(set_grad_none)
        torch.optim.Optimizer.__init__(self, params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One SGD step over every param with a grad; returns the closure's loss (if given)."""
        loss = _run_closure(closure)
        for group in self.param_groups:
            batch = self._gather(group)
            if not batch.params:
                continue
            buffers = [state.get("momentum_buffer") for state in batch.states]
            if self.wd_after_momentum:
                _sgd_wd_after_momentum(batch, buffers, group)
            else:
                all_or_none = all(b is None for b in buffers) or all(b is not None for b in buffers)
                fused = batch.on_cuda() and all_or_none
                _torch_sgd(batch.params, batch.grads, buffers, has_sparse_grad=False, foreach=not fused, fused=fused,
                                    weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                                    dampening=group["dampening"], nesterov=group["nesterov"], maximize=False)  # fmt: skip
            if group["momentum"] != 0:
                for state, buffer in zip(batch.states, buffers):
                    state["momentum_buffer"] = buffer
            batch.write_back()
        return loss


def _sgd_wd_after_momentum(batch: _Batch, buffers: list[Tensor | None], group: dict[str, Any]) -> None:
    """apex's kernel with ``wd_after_momentum``: momentum on the raw grad, then ``+ weight_decay * p``."""
    momentum, dampening, weight_decay = group["momentum"], group["dampening"], group["weight_decay"]
    updates = batch.grads
    if momentum != 0:
        old = [i for i, b in enumerate(buffers) if b is not None]
        if old:
            kept = [buffers[i] for i in old]
            torch._foreach_mul_(kept, momentum)
            torch._foreach_add_(kept, [batch.grads[i] for i in old], alpha=1 - dampening)
        for i, buffer in enumerate(buffers):
            if buffer is None:
                buffers[i] = batch.grads[i].detach().clone()  # first step: the buffer starts as the grad
        updates = torch._foreach_add(batch.grads, buffers, alpha=momentum) if group["nesterov"] else list(buffers)
    if weight_decay != 0:
        updates = torch._foreach_add(updates, batch.params, alpha=weight_decay)
    _apply_lr(batch.params, updates, group["lr"])


# ---------------------------------------------------------------------------------------------
# FusedAdam


class FusedAdam(_ApexOptimizer, torch.optim.Adam):
    """apex's FusedAdam: torch's Adam/AdamW update (``adam_w_mode`` True: AdamW's decoupled decay, False: L2).

    ``bias_correction=False`` (no torch counterpart) runs apex's uncorrected rule on foreach ops.
    ``capturable`` keeps lr and step counts on the GPU for CUDA-graph capture (CUDA params only).
    ``master_weights`` keeps an fp32 copy of each fp16/bf16 param in the optimizer state (saved in
    ``state_dict``) and updates that; without it the fp32 math starts from the rounded param each step.
    ``amsgrad=True`` is refused, as apex refused it. Step counts are per param, as in torch.
    """

    _settings = ("set_grad_none", "adam_w_mode", "capturable", "master_weights")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, capturable: bool = False, master_weights: bool = False) -> None:  # fmt: skip
        _refuse_amsgrad("FusedAdam", amsgrad)
        _check("FusedAdam", {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        defaults = {"lr": lr, "bias_correction": bool(bias_correction), "betas": _float_betas(betas), "eps": eps,
                    "weight_decay": weight_decay, "amsgrad": False, "maximize": False, "foreach": True,
                    "capturable": bool(capturable), "differentiable": False, "fused": None,
                    "decoupled_weight_decay": bool(adam_w_mode)}  # fmt: skip
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = bool(set_grad_none)
        self.capturable = bool(capturable)
        self.master_weights = bool(master_weights)
        torch.optim.Optimizer.__init__(self, params, defaults)
        if self.capturable:
            self._make_capturable()

    def _make_capturable(self) -> None:
        on_cpu = [tuple(p.shape) for g in self.param_groups for p in g["params"] if not p.is_cuda]
        if on_cpu:
            raise RefusedOptionError(
                f"FusedAdam(capturable=True) keeps lr and step counts on the GPU for CUDA-graph capture and needs CUDA "
                f"params; {len(on_cpu)} param(s) are not on a CUDA device (first of shape {on_cpu[0]}). "
                "Move the model to CUDA first, or use capturable=False"
            )
        for group in self.param_groups:
            if group["params"] and not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=group["params"][0].device)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = bool(getattr(self, "adam_w_mode", group["decoupled_weight_decay"]))

    def _from_apex_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _apex_group_step_to_state(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None, scale: Any = None,
             grad_norms: Any = None, grad_scaler: Any = None) -> Any:  # fmt: skip
        """One Adam step over every param with a grad; returns the closure's loss (if given).

        ``grads``/``output_params``/``scale``/``grad_norms`` are refused as apex refuses them.
        ``grad_scaler`` was apex's hook for torch's GradScaler: call ``scaler.step(optimizer)``
        instead, which unscales, skips steps with inf/NaN grads and then calls ``step()``.
        """
        if any(arg is not None for arg in (grads, output_params, scale, grad_norms)):
            raise RefusedOptionError(
                "FusedAdam.step(grads=/output_params=/scale=/grad_norms=): apex removed these arguments; build FusedAdam "
                "like torch.optim.Adam and call step() with no arguments"
            )
        if grad_scaler is not None:
            raise RefusedOptionError(
                "FusedAdam.step(grad_scaler=...) is not supported: call scaler.step(optimizer), which unscales the grads, "
                "skips the step when they hold inf/NaN and calls optimizer.step()"
            )
        loss = _run_closure(closure)
        for group in self.param_groups:
            batch = self._gather(group, self.master_weights)
            if batch.params:
                self._adam_group(group, batch)
                batch.write_back()
        return loss

    def _adam_group(self, group: dict[str, Any], batch: _Batch) -> None:
        fused = batch.on_cuda()
        for target, state in zip(batch.params, batch.states):
            if "exp_avg" not in state:
                state["exp_avg"], state["exp_avg_sq"] = _zeros(target), _zeros(target)
        steps = [_step_tensor(s, t, fused or self.capturable) for s, t in zip(batch.states, batch.params)]
        exp_avgs = [s["exp_avg"] for s in batch.states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in batch.states]
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            _torch_adam(batch.params, batch.grads, exp_avgs, exp_avg_sqs, [], steps, foreach=not fused, fused=fused,
                                  capturable=self.capturable, decoupled_weight_decay=bool(self.adam_w_mode), amsgrad=False,
                                  beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                                  eps=group["eps"], maximize=False)  # fmt: skip
            return
        # apex's kernel without bias correction: p -= lr * (m / (sqrt(v) + eps) [+ wd * p])
        torch._foreach_add_(steps, 1)
        weight_decay, grads = group["weight_decay"], batch.grads
        if weight_decay != 0 and not self.adam_w_mode:
            grads = torch._foreach_add(grads, batch.params, alpha=weight_decay)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        if weight_decay != 0 and self.adam_w_mode:
            torch._foreach_add_(updates, batch.params, alpha=weight_decay)
        _apply_lr(batch.params, updates, group["lr"])


# ---------------------------------------------------------------------------------------------
# FusedLAMB


class FusedLAMB(_ApexOptimizer):
    """apex's FusedLAMB on torch foreach ops, with apex's kernel math.

    Per step: the global L2 norm of every grad (all groups) ``n``; grads are divided by
    ``n / max_grad_norm`` when ``n > max_grad_norm`` (``max_grad_norm`` read from the constructor,
    as apex does). Adam moments on the clipped grad (``adam_w_mode`` False: ``+ weight_decay * p``
    first), ``update = m_hat / (sqrt(v_hat) + eps)`` (``adam_w_mode`` True: ``+ weight_decay * p``),
    then ``p -= lr * ratio * update`` with ``ratio = ||p|| / ||update||`` per tensor when
    ``weight_decay != 0`` or ``use_nvlamb`` and both norms are non-zero, else 1. apex wrote the
    update into ``p.grad``; here grads are left as they were. ``amsgrad=True`` is refused, as apex did.
    """

    _settings = ("set_grad_none", "adam_w_mode", "use_nvlamb")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True, max_grad_norm: float = 1.0,
                 use_nvlamb: bool = False) -> None:  # fmt: skip
        _refuse_amsgrad("FusedLAMB", amsgrad)
        _check("FusedLAMB", {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "max_grad_norm": max_grad_norm})
        defaults = {"lr": lr, "bias_correction": bool(bias_correction), "betas": _float_betas(betas), "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": bool(grad_averaging), "max_grad_norm": max_grad_norm}  # fmt: skip
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = bool(set_grad_none)
        self.use_nvlamb = bool(use_nvlamb)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step over every param with a grad; returns the closure's loss (if given)."""
        loss = _run_closure(closure)
        batches = [self._gather(group) for group in self.param_groups]
        grads = [g for batch in batches for g in batch.grads]
        clip = None
        if grads:
            global_norm = torch.linalg.vector_norm(_stack(torch._foreach_norm(grads)))
            max_norm = self.defaults["max_grad_norm"]
            clip = torch.where(global_norm > max_norm, global_norm / max_norm, torch.ones_like(global_norm))
        for group, batch in zip(self.param_groups, batches):
            group["step"] = group.get("step", 0) + 1  # apex counts per group, every step
            if batch.params:
                self._lamb_group(group, batch, clip)
                batch.write_back()
        return loss

    def _lamb_group(self, group: dict[str, Any], batch: _Batch, clip: Tensor) -> None:
        beta1, beta2 = group["betas"]
        step, weight_decay = group["step"], group["weight_decay"]
        bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        for target, state in zip(batch.params, batch.states):
            if "exp_avg" not in state:
                state["exp_avg"], state["exp_avg_sq"] = _zeros(target), _zeros(target)
        exp_avgs = [s["exp_avg"] for s in batch.states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in batch.states]
        grads = torch._foreach_div(batch.grads, clip.to(batch.params[0].device))
        if weight_decay != 0 and not self.adam_w_mode:
            torch._foreach_add_(grads, batch.params, alpha=weight_decay)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=beta3)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(exp_avg_sqs, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, bc1)
        torch._foreach_div_(updates, denom)
        if weight_decay != 0 and self.adam_w_mode:
            torch._foreach_add_(updates, batch.params, alpha=weight_decay)
        if weight_decay != 0 or self.use_nvlamb:
            param_norms = _stack(torch._foreach_norm(batch.params))
            update_norms = _stack(torch._foreach_norm(updates))
            usable = (param_norms != 0) & (update_norms != 0)
            ratios = torch.where(usable, param_norms / update_norms, torch.ones_like(param_norms))
            torch._foreach_mul_(updates, list(ratios.unbind()))
        _apply_lr(batch.params, updates, group["lr"])


# ---------------------------------------------------------------------------------------------
# FusedNovoGrad


class FusedNovoGrad(_ApexOptimizer):
    """apex's FusedNovoGrad on torch foreach ops, with apex's kernel math.

    The second moment is one number per tensor, kept as a norm (``state['exp_avg_sq']``):
    ``norm_type`` 2 blends ``v = sqrt(beta2 * v**2 + (1 - beta2) * ||g||**2)``, 0 blends the max-abs
    norm linearly; it starts at the first grad's norm (``init_zero=False``, so the first blend is a
    no-op) or at 0. ``denom = v / sqrt(1 - beta2**step) + eps``. ``reg_inside_moment=True``:
    ``m = beta1 * m + beta3 * (g / denom + wd * p)``, ``p -= lr * m / bc1``; False:
    ``m = beta1 * m + beta3 * g``, ``p -= lr * (m / bc1 / denom + wd * p)``; ``beta3`` is
    ``1 - beta1`` with ``grad_averaging``, else 1. ``amsgrad=True`` is refused, as apex did.
    """

    _settings = ("set_grad_none", "moment_mode")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, reg_inside_moment: bool = False,
                 grad_averaging: bool = True, norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True) -> None:  # fmt: skip
        _refuse_amsgrad("FusedNovoGrad", amsgrad)
        _check("FusedNovoGrad", {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "norm_type": norm_type})
        defaults = {"lr": lr, "bias_correction": bool(bias_correction), "betas": _float_betas(betas), "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": bool(grad_averaging), "norm_type": int(norm_type),
                    "init_zero": bool(init_zero)}  # fmt: skip
        self.moment_mode = 0 if reg_inside_moment else 1
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One NovoGrad step over every param with a grad; returns the closure's loss (if given)."""
        loss = _run_closure(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # apex counts per group, every step
            batch = self._gather(group)
            if batch.params:
                self._novograd_group(group, batch)
                batch.write_back()
        return loss

    def _second_moments(self, group: dict[str, Any], batch: _Batch) -> Tensor:
        """Blend this step's per-tensor grad norms into ``state['exp_avg_sq']``; returns them stacked."""
        beta2 = group["betas"][1]
        norms = _stack(torch._foreach_norm(batch.grads, 2 if group["norm_type"] == 2 else math.inf))
        for index, state in enumerate(batch.states):
            if "exp_avg_sq" not in state:
                state["exp_avg_sq"] = torch.zeros((), dtype=torch.float32, device=norms.device)
                if not group["init_zero"]:
                    state["exp_avg_sq"].copy_(norms[index])
        old = _stack([s["exp_avg_sq"] for s in batch.states])
        l2 = group["norm_type"] == 2  # L2 blends the squares, the infinity norm blends linearly
        new = (beta2 * old * old + (1 - beta2) * norms * norms).sqrt() if l2 else beta2 * old + (1 - beta2) * norms
        torch._foreach_copy_([s["exp_avg_sq"] for s in batch.states], list(new.unbind()))
        return new

    def _novograd_group(self, group: dict[str, Any], batch: _Batch) -> None:
        beta1, beta2 = group["betas"]
        step, weight_decay = group["step"], group["weight_decay"]
        bc1, bc2 = (1 - beta1**step, math.sqrt(1 - beta2**step)) if group["bias_correction"] else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        for target, state in zip(batch.params, batch.states):
            if "exp_avg" not in state:
                state["exp_avg"] = _zeros(target)
        exp_avgs = [s["exp_avg"] for s in batch.states]
        denoms = list((self._second_moments(group, batch) / bc2 + group["eps"]).to(batch.params[0].device).unbind())
        torch._foreach_mul_(exp_avgs, beta1)
        if self.moment_mode == 0:  # reg_inside_moment: normalise and decay inside the moment
            grads = torch._foreach_div(batch.grads, denoms)
            if weight_decay != 0:
                torch._foreach_add_(grads, batch.params, alpha=weight_decay)
            torch._foreach_add_(exp_avgs, grads, alpha=beta3)
            updates = torch._foreach_div(exp_avgs, bc1)
        else:
            torch._foreach_add_(exp_avgs, batch.grads, alpha=beta3)
            updates = torch._foreach_div(exp_avgs, bc1)
            torch._foreach_div_(updates, denoms)
            if weight_decay != 0:
                torch._foreach_add_(updates, batch.params, alpha=weight_decay)
        _apply_lr(batch.params, updates, group["lr"])

    def _from_apex_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """apex kept the norms per group as ``group['exp_avg_sq'] = [fp16 params' norms, fp32 params' norms]``."""
        if not any(isinstance(g.get("exp_avg_sq"), (list, tuple)) for g in state_dict["param_groups"]):
            return state_dict
        states = dict(state_dict["state"])
        groups = []
        for index, (saved, current) in enumerate(zip(state_dict["param_groups"], self.param_groups)):
            saved = dict(saved)
            norms = saved.pop("exp_avg_sq", None)
            if norms is not None:
                _spread_apex_norms(index, saved["params"], current["params"], states, norms)
            groups.append(saved)
        return {**state_dict, "state": states, "param_groups": groups}


def _spread_apex_norms(index: int, saved_ids: list[Any], params: list[Tensor], states: dict[Any, Any], norms: list[Tensor]) -> None:
    with_state = [(pid, p) for pid, p in zip(saved_ids, params) if pid in states]
    for slot, dtype in ((0, torch.float16), (1, torch.float32)):
        members = [pid for pid, p in with_state if p.dtype == dtype]
        values = norms[slot].flatten() if norms[slot] is not None else torch.zeros(0)
        if len(members) != values.numel():
            raise ConfigError(
                f"FusedNovoGrad.load_state_dict: param group {index} of this apex checkpoint holds {values.numel()} "
                f"{dtype} norm(s) but {len(members)} {dtype} param(s) with state; it does not match these params"
            )
        for pid, value in zip(members, values.unbind()):
            states[pid] = {**states[pid], "exp_avg_sq": value.float().clone()}


# ---------------------------------------------------------------------------------------------
# FusedAdagrad


class FusedAdagrad(_ApexOptimizer, torch.optim.Adagrad):
    """apex's FusedAdagrad: torch.optim.Adagrad's rule through torch's foreach Adagrad (L2 weight decay).

    ``adagrad_w_mode=True`` (no torch counterpart) decays decoupled, as apex's kernel:
    ``p -= lr * (g / (sqrt(sum) + eps) + weight_decay * p)``.
    """

    _settings = ("set_grad_none", "adagrad_w_mode")

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False) -> None:  # fmt: skip
        _check("FusedAdagrad", {"lr": lr, "eps": eps, "weight_decay": weight_decay})
        defaults = {"lr": lr, "lr_decay": 0, "eps": eps, "weight_decay": weight_decay, "initial_accumulator_value": 0,
                    "foreach": True, "maximize": False, "differentiable": False, "fused": None}  # fmt: skip
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0
        self.set_grad_none = bool(set_grad_none)
        torch.optim.Optimizer.__init__(self, params, defaults)  # state starts lazily, at the first step

    def _from_apex_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        states = {pid: s if "step" in s else {**s, "step": torch.tensor(0.0)} for pid, s in state_dict["state"].items()}
        return {**state_dict, "state": states}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adagrad step over every param with a grad; returns the closure's loss (if given)."""
        loss = _run_closure(closure)
        for group in self.param_groups:
            batch = self._gather(group)
            if not batch.params:
                continue
            for target, state in zip(batch.params, batch.states):
                if "sum" not in state:
                    state["sum"] = _zeros(target)
            sums = [s["sum"] for s in batch.states]
            steps = [_step_tensor(s, t, False) for s, t in zip(batch.states, batch.params)]
            if self.adagrad_w_mode:
                torch._foreach_add_(steps, 1)
                torch._foreach_addcmul_(sums, batch.grads, batch.grads, value=1)
                std = torch._foreach_sqrt(sums)
                torch._foreach_add_(std, group["eps"])
                updates = torch._foreach_div(batch.grads, std)
                if group["weight_decay"] != 0:
                    torch._foreach_add_(updates, batch.params, alpha=group["weight_decay"])
                _apply_lr(batch.params, updates, group["lr"])
            else:
                _torch_adagrad(batch.params, batch.grads, sums, steps, foreach=True, lr=group["lr"],
                                            weight_decay=group["weight_decay"], lr_decay=0, eps=group["eps"], maximize=False)  # fmt: skip
            batch.write_back()
        return loss


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
