"""apex's ``apex.optimizers.fused_sgd.FusedSGD`` on ``torch.optim.SGD``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import required
from torch.optim.sgd import sgd as _torch_sgd

from ampddp.apex.optimizers._base import _ApexOptimizer, _apply_lr, _Batch, _check, _run_closure
from ampddp.errors import ConfigError

__all__ = ["FusedSGD"]


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
