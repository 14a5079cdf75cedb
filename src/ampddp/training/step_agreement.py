"""A step's agreement: whether any rank's loss is non-finite and whether any rank was asked to stop.

After a step's backward every rank must take the same decisions before any steps (stop on a signal, trace a
non-finite loss while the weights are still those that made it), so the loop sums two flags over the ranks every
step. The loss and the tokens are summed only when a record is written (``log_window.LogWindow``): the flags alone
must travel every step. Where the strategy offers it (torch DDP over gloo: ``Strategy.gradient_rider``), they
ride one of the gradients' all-reduce buckets (the smallest, up to 2 MiB), so a step makes no collective of its own:
on two CPU processes (Intel Xeon with AMX, 2 cores) a second all-reduce cost 0.6-0.9 ms a step, more than a small
model's whole step (``benchmarks/peers.py``'s ``tiny`` groups).
Otherwise (no rider, or a smallest bucket over 2 MiB) they travel in one small all-reduce, started before the window's
last backward where the schedule knows the loss by then (``Backward.losses_known``: every strategy's but a pipeline's),
so it travels while the backward computes (left until after it, it cost the MLP of ``benchmarks/peers.py`` 4% of its
two-process O5 step). On an accelerator the flags stay on the device until read (no host read before the backward
is queued); on the host the loss is read where the flags are made (``_flags``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ampddp.distributed.data import PendingSum
from ampddp.distributed.env import DistEnv
from ampddp.distributed.gradient_rider import GradientRider
from ampddp.training.stopping import StopAgreement


class StepVerdict(NamedTuple):
    """What every rank decides the same way after a step's backward, and this rank's loss read on the host."""

    finite: bool
    """The loss was finite on every rank."""
    stop: bool
    """Some rank received a stop signal."""
    loss_sum: float
    """This rank's sum of per-sample losses (summed over the ranks only for a record: ``log_window``)."""


class StepAgreement:
    """One step's two flags, agreed over every rank of ``env`` (riding ``rider`` where there is one)."""

    def __init__(self, env: DistEnv, stopping: StopAgreement, rider: GradientRider | None = None) -> None:
        self.env, self.stopping, self.rider = env, stopping, rider
        self._loss_sum: torch.Tensor | None = None
        self._flags: torch.Tensor | None = None
        self._pending: PendingSum | None = None

    def start(self, loss_sum: torch.Tensor, backward_pending: bool = False) -> None:
        """Begin agreeing on this rank's loss (its sum of per-sample losses) and its vote as it stands now (a signal after
        this counts at the next step); ``backward_pending``: the window's last backward has not run yet, so the flags
        may ride its gradients. A second call does nothing."""
        if self._loss_sum is not None:
            return
        self._loss_sum = loss_sum.detach()
        if not self.env.distributed:
            return  # one process: its own vote and loss, read at the verdict
        self._flags = _flags(self.stopping.vote(), self._loss_sum)
        if not (backward_pending and self.rider is not None and self.rider.board(self._flags)):
            self._pending = PendingSum(self._flags)

    def verdict(self) -> StepVerdict:
        """The flags summed over the ranks (waits for them)."""
        if self._loss_sum is None:
            raise RuntimeError("a step's agreement was read before it started")
        if self._flags is None:
            loss_sum = self._loss_sum.item()
            return StepVerdict(finite=math.isfinite(loss_sum), stop=self.stopping.vote() > 0, loss_sum=loss_sum)
        if self._pending is None:  # riding: landed with the gradients
            landed = self.rider.landed() if self.rider is not None else None
            # No bucket took them (no backward synced): the same on every rank, so every rank reduces them here instead.
            self._pending = PendingSum(self._flags) if landed is None else PendingSum(landed, reduce=False)
        votes, non_finite = self._pending.result()
        return StepVerdict(finite=non_finite == 0, stop=votes > 0, loss_sum=self._loss_sum.item())


def _flags(vote: float, loss_sum: torch.Tensor) -> torch.Tensor:
    """[this rank's stop vote, 1 if its loss is not finite], where the loss is. On the host its value is there to read:
    one small tensor made from two numbers (five operations on the loss cost 35-40 us more a step, two gloo processes on
    an Intel Xeon with AMX, 2% of the tiny model's step); on an accelerator reading it would wait for the forward, so the
    flag is computed there."""
    if loss_sum.device.type == "cpu":
        return torch.tensor([vote, 0.0 if math.isfinite(loss_sum.item()) else 1.0])
    return torch.stack([torch.tensor(vote, device=loss_sum.device), (~torch.isfinite(loss_sum)).to(torch.float32)])
