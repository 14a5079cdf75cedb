"""apex's ``apex.optimizers.fused_lamb.FusedLAMB`` on torch foreach ops, with apex's kernel math."""

from __future__ import annotations

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

__all__ = ["FusedLAMB"]


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
