"""The step's schedule: who runs a window's forwards and backwards, and in which order.

The training loop owns the step (counts, loss agreement, the optimizer step), not the order of its
micro-batches: a pipeline schedule runs forwards and backwards itself, micro-batch by micro-batch
across stages, and computes the loss on the last stage only. So the loop asks the schedule its
strategy gives: ``forward_backward`` for a window's gradients, ``forward`` for a forward of the
whole model outside training (the last-batch check, the diagnosis of a non-finite step, evaluation).
``MicroBatches``, every strategy's today, runs each micro-batch's forward then backward on this
rank, the gradient sync only on the last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from ampddp.distributed.wrap import GradSync

Result = TypeVar("Result")
LossOf = Callable[[int, Any], tuple[torch.Tensor, int]]
"""(micro-batch index, batch) -> (its mean loss, its sample count): the loop's forward and loss."""
Backward = Callable[[torch.Tensor, int], None]
"""(a micro-batch's mean loss, its sample count) -> None: the loop weights it and runs the engine's backward."""


class StepSchedule(Protocol):
    """How a window of micro-batches becomes gradients, and how a whole-model forward is run."""

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        """The window's gradients; returns this rank's sum of per-sample losses (what it computed)."""

    def forward(self, run: Callable[[], Result]) -> Result:
        """``run`` (a forward of the whole model) as this schedule runs one."""


class MicroBatches:
    """Each micro-batch's forward then its backward, in order, the gradient sync (``grad_sync``) only
    on the window's last."""

    def __init__(self, grad_sync: GradSync) -> None:
        self.grad_sync = grad_sync

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        loss_sum: torch.Tensor | None = None
        for index, batch in enumerate(window):
            with self.grad_sync.micro_step(is_last=index == len(window) - 1):
                loss, count = loss_of(index, batch)
                backward(loss, count)
            share = loss.detach().float() * count
            loss_sum = share if loss_sum is None else loss_sum + share
        if loss_sum is None:
            raise ValueError("a step's window holds no micro-batch")
        return loss_sum

    def forward(self, run: Callable[[], Result]) -> Result:
        return run()
