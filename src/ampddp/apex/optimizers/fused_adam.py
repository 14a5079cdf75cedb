"""apex's ``apex.optimizers.fused_adam.FusedAdam`` on ``torch.optim.Adam``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from ampddp.apex import amp_C
from ampddp.apex.optimizers._base import (
    RefusedOptionError,
    _apex_group_step_to_state,
    _ApexOptimizer,
    _apply_lr,
    _Batch,
    _check,
    _float_betas,
    _refuse_amsgrad,
    _run_closure,
    _step_tensor,
    _zeros,
)

__all__ = ["FusedAdam"]


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
        # apex's kernel handles, which subclasses call themselves (fairseq's FusedAdamV2 checks for them)
        first = next((p for group in self.param_groups for p in group["params"]), None)
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=first.device if first is not None else "cpu")
        self.multi_tensor_adam = amp_C.multi_tensor_adam

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
