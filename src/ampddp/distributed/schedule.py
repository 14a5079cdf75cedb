"""The step's schedule: who runs a window's forwards and backwards, and in which order.

The training loop owns the step (counts, loss agreement, the optimizer step), not the order of its
micro-batches: a pipeline schedule runs forwards and backwards itself, micro-batch by micro-batch
across stages, and computes the loss on the last stage only. So the loop asks the schedule its
strategy gives: ``forward_backward`` for a window's gradients, ``forward`` for a forward of the
whole model outside training (the last-batch check, the diagnosis of a non-finite step, evaluation).
``MicroBatches``, every strategy's but a pipeline's, runs each micro-batch's forward then backward on this
rank, the gradient sync only on the last, and hands the loop the window's loss before that last backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ampddp.distributed.wrap import GradSync

Result = TypeVar("Result")


class LossOf(Protocol):
    """The loop's forward and loss of a micro-batch."""

    def __call__(self, index: int, batch: Any) -> tuple[torch.Tensor, int]:
        """(micro-batch index, batch) -> (its mean loss, its sample count), through the loop's model."""

    def forward(self, module: nn.Module, batch: Any) -> Any:
        """``module``'s outputs on ``batch`` as the loop feeds a model (on the device, the batch adapter's way), for a
        schedule whose first stage reads the inputs itself (a pipeline's)."""


class Backward(Protocol):
    """The loop's backward of a micro-batch's loss, weighted by its share of the global batch (``count`` samples)."""

    def __call__(self, loss: torch.Tensor, count: int) -> None:
        """Weight ``loss`` and run the engine's backward of it."""

    def scaled(self, loss: torch.Tensor, count: int) -> torch.Tensor:
        """The weighted loss as the engine scales it, for a schedule that runs the backward itself (a pipeline's)."""

    def done(self) -> None:
        """Say the schedule ran its backwards (a pipeline stage without a loss of its own says so too)."""

    def losses_known(self, loss_sum: torch.Tensor) -> None:
        """This rank's sum of per-sample losses of the window, known before its last backward runs: the loop may start
        agreeing on the step then (its reduce travels while the backward computes). A schedule calls it on every rank
        at the same point of the window, or not at all (the loop then starts after ``forward_backward``). Optional: a
        backward without it (a plain function of a ``prepare`` user) is not told."""


class StepSchedule(Protocol):
    """How a window of micro-batches becomes gradients, and how a whole-model forward is run."""

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        """The window's gradients; returns this rank's sum of per-sample losses (what it computed)."""

    def forward(self, run: Callable[[], Result]) -> Result:
        """``run`` (a forward of the whole model) as this schedule runs one."""

    def loss_copies(self, ranks_per_data_rank: int) -> int:
        """How many of the ``ranks_per_data_rank`` ranks sharing a data coordinate return its loss (each counts it once)."""


class MicroBatches:
    """Each micro-batch's forward then its backward, in order, the gradient sync (``grad_sync``) only
    on the window's last."""

    def __init__(self, grad_sync: GradSync) -> None:
        self.grad_sync = grad_sync

    def forward_backward(self, window: Sequence[Any], loss_of: LossOf, backward: Backward) -> torch.Tensor:
        loss_sum: torch.Tensor | None = None
        for index, batch in enumerate(window):
            last = index == len(window) - 1
            with self.grad_sync.micro_step(is_last=last):
                loss, count = loss_of(index, batch)
                share = loss.detach().float() * count
                loss_sum = share if loss_sum is None else loss_sum + share
                if last and hasattr(backward, "losses_known"):  # a plain function (a prepare user's) has none
                    backward.losses_known(loss_sum)
                backward(loss, count)
        if loss_sum is None:
            raise ValueError("a step's window holds no micro-batch")
        return loss_sum

    def forward(self, run: Callable[[], Result]) -> Result:
        return run()

    def loss_copies(self, ranks_per_data_rank: int) -> int:
        """Every rank of a data coordinate (its tensor-parallel ranks) computes the loss."""
        return ranks_per_data_rank
