"""apex's ``apex.optimizers.fused_adagrad.FusedAdagrad`` on ``torch.optim.Adagrad``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adagrad import adagrad as _torch_adagrad

from ampddp.apex.optimizers._base import _ApexOptimizer, _apply_lr, _check, _run_closure, _step_tensor, _zeros

__all__ = ["FusedAdagrad"]


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
