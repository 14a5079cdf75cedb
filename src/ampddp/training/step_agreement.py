"""A step's agreement: its loss, the stop vote and its tokens, summed over every rank in one all-reduce.

After a step's backward every rank must take the same decisions (stop on a signal, trace a non-finite loss while the
weights are still those that made it, log one loss), so the loop sums three numbers over the ranks before the
optimizer step. Started as late as possible, that reduce is a second wait beside the gradients' (1 ms a step of a
3.8 ms step on two CPU processes, measured in ``benchmarks/peers.py``'s ``tiny`` groups). A schedule that knows its
rank's loss before the window's last backward (``MicroBatches``) says so (``Backward.losses_known``), and the reduce
travels while that backward computes, issued on every rank at the same point (under DDP, ahead of the gradients'
buckets); a pipeline's loss is known after its schedule, and the reduce starts then. The values stay on the device
(no host read before the backward is queued).
"""

from __future__ import annotations

import torch

from ampddp.distributed.data import PendingSum
from ampddp.distributed.env import DistEnv
from ampddp.training.stopping import StopAgreement


class StepAgreement:
    """One step's reduce. ``readers``: the ranks of one data coordinate (they read the same batches: tokens counted
    once); ``loss_copies``: how many of them hold its loss (each counted once)."""

    def __init__(self, env: DistEnv, stopping: StopAgreement, tokens: int, readers: int, loss_copies: int) -> None:
        self.env, self.stopping, self.tokens = env, stopping, tokens
        self.readers, self.loss_copies = readers, loss_copies
        self._pending: PendingSum | None = None
        self._loss_sum: torch.Tensor | None = None

    def start(self, loss_sum: torch.Tensor) -> None:
        """Begin the reduce of this rank's sum of per-sample losses with its vote and tokens (the vote as it stands
        now: a signal after this counts at the next step); a second call does nothing."""
        if self._loss_sum is not None:
            return
        self._loss_sum = loss_sum.detach()
        if self.env.distributed:
            votes = torch.tensor([self.stopping.vote(), float(self.tokens)], dtype=torch.float64, device=loss_sum.device)
            self._pending = PendingSum(torch.cat([self._loss_sum.double().reshape(1), votes]))

    def result(self, total: float) -> tuple[float, bool, float]:
        """The global mean loss over ``total`` samples, whether any rank voted to stop, and the step's tokens."""
        if self._loss_sum is None:
            raise RuntimeError("a step's agreement was read before it started")
        if self._pending is None:  # one process: its own vote, read now
            return self._loss_sum.item() / max(total, 1.0), self.stopping.vote() > 0, float(self.tokens)
        loss, votes, tokens = self._pending.result().tolist()
        return loss / self.loss_copies / max(total, 1.0), votes > 0, tokens / self.readers
