"""The interface every precision mode implements.

The trainer and the ``amp`` facade talk only to this interface; a new mode is a new small class,
never a new branch in the training loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.precision.policy import OPT_LEVELS

NATIVE_MODES = {"native-fp16": torch.float16, "native-bf16": torch.bfloat16}
PRECISION_MODES = (*OPT_LEVELS, *NATIVE_MODES)
IMPLS = ("builtin", "apex")


class PrecisionEngine(ABC):
    """Model conversion, forward context, scaled backward, optimizer step and scaler state."""

    mode: str
    last_overflow: str | None = None
    """Parameter where the gradients of the last skipped step first became non-finite."""

    @abstractmethod
    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        """Convert models and optimizers in place for this mode; returns the objects to use."""

    @abstractmethod
    def forward_context(self) -> AbstractContextManager[Any]:
        """Context for the forward pass and loss computation."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """Backward of the (scaled) loss; call it once per micro-batch when accumulating."""

    @abstractmethod
    def unscale_(self, optimizer: Optimizer) -> None:
        """Unscale the optimizer's grads now (before clipping); idempotent within a step."""

    @abstractmethod
    def step(self, *optimizers: Optimizer) -> bool:
        """Unscale if needed, step unless grads overflowed, update the scale; True if stepped."""

    @abstractmethod
    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        """Params the optimizer steps (fp32 masters under O2/O5) — clip and inspect these."""

    @abstractmethod
    def loss_scale(self, loss_id: int = 0) -> float:
        """Current loss scale (1.0 when not scaling)."""

    @property
    @abstractmethod
    def skipped_steps(self) -> int:
        """Steps skipped because of non-finite gradients, over the engine's life."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (mode, scalers) for checkpoints."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (or a compatible scaler form)."""

    def zero_grad(self, *optimizers: Optimizer) -> None:
        """Clear the optimizers' gradients (and any pending gradient state the engine keeps)."""
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)

    def teardown(self) -> None:  # noqa: B027 - optional for engines that install nothing
        """Remove hooks this engine installed; the models keep their converted dtypes."""

    def clip_grad_norm_(self, optimizers: Iterable[Optimizer], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then clip the global norm over the params the optimizers step."""
        return torch.nn.utils.clip_grad_norm_(self._unscaled_params(optimizers), max_norm, norm_type=norm_type, foreach=True)

    def grad_norm(self, optimizers: Iterable[Optimizer], norm_type: float = 2.0) -> torch.Tensor:
        """Unscale, then measure the global gradient norm without touching the gradients (for logging:
        clipping at an infinite limit would still rewrite every gradient)."""
        grads = [p.grad for p in self._unscaled_params(optimizers)]
        return torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)

    def _unscaled_params(self, optimizers: Iterable[Optimizer]) -> list[nn.Parameter]:
        params = []
        for optimizer in optimizers:
            self.unscale_(optimizer)
            params.extend(p for p in self.master_params(optimizer) if p.grad is not None)
        return params
