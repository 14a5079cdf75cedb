"""What apex's optimizers share here: argument checks, fp32 math for fp16/bf16 params, apex's zero_grad."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import required

from ampddp.errors import ConfigError

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
