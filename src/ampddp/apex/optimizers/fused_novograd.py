"""apex's ``apex.optimizers.fused_novograd.FusedNovoGrad`` on torch foreach ops, with apex's kernel math."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ampddp.apex.optimizers._base import (
    _ApexOptimizer,
    _apply_lr,
    _Batch,
    _check,
    _float_betas,
    _refuse_amsgrad,
    _run_closure,
    _stack,
    _zeros,
)
from ampddp.errors import ConfigError

__all__ = ["FusedNovoGrad"]


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
