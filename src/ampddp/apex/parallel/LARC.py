"""apex.parallel.LARC: layer-wise adaptive rate control around any torch optimizer.

apex deleted ``apex.parallel`` in May 2025; ``from apex.parallel.LARC import LARC`` is common in
large-batch training scripts. This LARC applies apex's rule exactly (https://arxiv.org/abs/1708.03888)
and, unlike apex's plain-object wrapper, is a real ``torch.optim.Optimizer``: step hooks registered
on it fire, LR schedulers and GradScaler accept it, and its ``param_groups``/``state`` are the inner
optimizer's own objects (so parameters swapped into a group, e.g. fp32 master weights, are stepped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ampddp.apex._names import unknown_name
from ampddp.errors import ConfigError

__all__ = ["LARC"]

REPLACEMENTS: dict[str, str] = {}

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class LARC(Optimizer):
    """Scale each parameter's step by its trust ratio, then run the wrapped optimizer's step.

    Per parameter with ``||p|| != 0`` and ``||g|| != 0`` (norms in at least fp32), with the group's
    ``lr`` and ``weight_decay`` (``wd``)::

        local_lr = trust_coefficient * ||p|| / (||g|| + ||p|| * wd + eps)
        clip=True:  g <- (g + wd * p) * min(local_lr / lr, 1)   # effective lr = min(local_lr, lr)
        clip=False: g <- (g + wd * p) * local_lr                # effective lr = local_lr * lr

    LARC applies the weight decay itself: each group's ``weight_decay`` is 0 while the inner step
    runs and is restored afterwards. Parameters whose weight or gradient norm is zero get the inner
    step unchanged and no weight decay (apex's behaviour).
    """

    def __init__(self, optimizer: Optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8) -> None:
        if not isinstance(optimizer, Optimizer):
            raise ConfigError(f"LARC wraps a torch.optim.Optimizer; got {type(optimizer).__name__}")
        if isinstance(optimizer, LARC):
            raise ConfigError("LARC(LARC(...)) would apply the trust ratio twice; wrap the inner optimizer once")
        if not trust_coefficient > 0:
            raise ConfigError(f"trust_coefficient={trust_coefficient!r} is not valid; it must be > 0 (apex default 0.02)")
        if not eps >= 0:
            raise ConfigError(f"eps={eps!r} is not valid; it must be >= 0 (apex default 1e-8)")
        # Optimizer.__init__ would build new param_groups and state; this wrapper shares the inner ones,
        # so only the hook machinery Optimizer.__init__ sets up is created here.
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = bool(clip)
        self.eps = eps
        self._init_hooks()

    def _init_hooks(self) -> None:
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's param_groups list itself (not a copy)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's state dict itself (not a copy)."""
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's defaults."""
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    def __getstate__(self) -> dict[str, Any]:
        return {"optim": self.optim, "trust_coefficient": self.trust_coefficient, "clip": self.clip, "eps": self.eps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_hooks()

    def __repr__(self) -> str:
        inner = repr(self.optim).replace("\n", "\n    ")
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps},\n    optimizer={inner})"

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict (LARC itself has no state)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the inner optimizer."""
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's zero_grad."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (it fills in its defaults)."""
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _adapt_gradients(self) -> None:
        for group in self.param_groups:
            weight_decay = group.get("weight_decay", 0.0) or 0.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError("LARC needs dense gradients (it takes the gradient's norm and adds weight decay in place)")
                compute = torch.promote_types(p.dtype, torch.float32)
                param_norm = torch.linalg.vector_norm(p, dtype=compute)
                grad_norm = torch.linalg.vector_norm(p.grad, dtype=compute)
                adaptive = self.trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + self.eps)
                if self.clip:
                    adaptive = torch.clamp(adaptive / group["lr"], max=1.0)
                usable = (param_norm != 0) & (grad_norm != 0)
                if weight_decay != 0:
                    p.grad.add_(p * torch.where(usable, weight_decay, 0.0).to(p.grad.dtype))
                p.grad.mul_(torch.where(usable, adaptive, 1.0).to(p.grad.dtype))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Evaluate ``closure`` (if given), adapt every gradient, run the inner step without weight decay."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adapt_gradients()
        saved = [(group, group["weight_decay"]) for group in self.param_groups if "weight_decay" in group]
        for group, _ in saved:
            group["weight_decay"] = 0
        try:
            self.optim.step()
        finally:
            for group, weight_decay in saved:
                group["weight_decay"] = weight_decay
        return loss


def __getattr__(name: str) -> Any:
    raise unknown_name(__name__, name, REPLACEMENTS, __all__)
