"""``optimizer._amp_stash``: the mark apex's ``initialize`` left on each optimizer, read by apex-era code.

Libraries decide whether amp is already set up with ``hasattr(optimizer, "_amp_stash")`` (mmengine's
ApexOptimWrapper calls ``initialize`` on every iteration until it appears), and scripts read the
stash's parameter lists to name master weights or restore them (Hugging Face's old Trainer, NVIDIA's
examples: ``_amp_stash.all_fp16_params`` / ``all_fp32_from_fp16_params`` after ``_amp_lazy_init()``).
Here the stash is a live view of the set-up's bookkeeping for that optimizer, so nothing is copied or
goes stale; the ``lazy init`` calls are no-ops because the masters exist from ``initialize`` on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.precision import GradPhase, OptimizerGrads

LOW_PRECISION = (torch.float16, torch.bfloat16)
LAZY_INIT_METHODS = ("_amp_lazy_init", "_lazy_init_maybe_master_weights")


class AmpStash:
    """apex's ``AmpOptimizerState`` fields over one optimizer's ``OptimizerGrads``.

    "fp16" in the field names is apex's word for the model's low-precision dtype (bf16 under O5).
    """

    def __init__(self, grads: OptimizerGrads) -> None:
        self._grads = grads

    lazy_init_called = True
    """apex built masters at the first backward; here they exist from ``initialize`` on."""

    @property
    def already_patched(self) -> bool:
        """True while the next ``step()`` is to be skipped (apex patched ``step`` to skip once)."""
        return self._grads.skip_pending

    @property
    def params_have_scaled_gradients(self) -> bool:
        return self._grads.phase is GradPhase.SCALED

    def _groups(self) -> list[tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]]:
        """Per param group: (low-precision model params with masters, their masters, fp32 params stepped in place)."""
        model_of = {id(master): param for param, master in zip(self._grads.model_params, self._grads.masters)}
        groups = []
        for group in self._grads.optimizer.param_groups:
            masters = [p for p in group["params"] if id(p) in model_of]
            in_place = [p for p in group["params"] if id(p) not in model_of]
            groups.append(([model_of[id(p)] for p in masters], masters, in_place))
        return groups

    @property
    def fp16_groups(self) -> list[list[nn.Parameter]]:
        return [low for low, _, _ in self._groups()]

    @property
    def fp32_from_fp16_groups(self) -> list[list[nn.Parameter]]:
        return [masters for _, masters, _ in self._groups()]

    @property
    def fp32_from_fp32_groups(self) -> list[list[nn.Parameter]]:
        return [[p for p in in_place if p.dtype == torch.float32] for _, _, in_place in self._groups()]

    @property
    def all_fp16_params(self) -> list[nn.Parameter]:
        """Low-precision model params: those with masters, or (no masters) those stepped in place."""
        with_masters = list(self._grads.model_params)
        return with_masters + [p for p in self._grads.in_place if p.dtype in LOW_PRECISION]

    @property
    def all_fp32_from_fp16_params(self) -> list[nn.Parameter]:
        return list(self._grads.masters)

    @property
    def all_fp32_from_fp32_params(self) -> list[nn.Parameter]:
        return [p for p in self._grads.in_place if p.dtype == torch.float32]

    @property
    def all_fp32_params(self) -> list[nn.Parameter]:
        """apex's name without master weights: every fp32 param the optimizer steps."""
        return self.all_fp32_from_fp32_params

    def __repr__(self) -> str:
        return f"AmpStash(masters={len(self._grads.masters)}, skip_pending={self.already_patched})"


def _lazy_init_done(*args: Any) -> None:
    """apex's lazy master creation; ampddp's masters already exist."""


def mark_optimizer(optimizer: Optimizer, grads: OptimizerGrads) -> None:
    """Give ``optimizer`` apex's ``_amp_stash`` and no-op lazy-init methods (on this object only)."""
    optimizer._amp_stash = AmpStash(grads)  # type: ignore[attr-defined]
    for name in LAZY_INIT_METHODS:
        setattr(optimizer, name, _lazy_init_done)


def unmark_optimizer(optimizer: Optimizer) -> None:
    """Remove what ``mark_optimizer`` set (the set-up holding ``optimizer`` was torn down)."""
    for name in ("_amp_stash", *LAZY_INIT_METHODS):
        optimizer.__dict__.pop(name, None)
