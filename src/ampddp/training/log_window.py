"""What happened between two records of a run: the steps' mean loss and the tokens trained on.

A record is written every ``log_every`` steps; one batch's loss at that step is noisy (a plot of it
jumps 0.64 -> 1.12 -> 1.03), so each record also carries the mean over the steps since the previous
one (``loss_mean``: the finite losses, the way a smoothed curve reads), which the console prints and
the plots draw, while ``loss`` keeps the step's own value.

Each rank keeps its own part of those sums, and they are summed over the ranks once, when a record is
written: the steps between records need no collective for them (``step_agreement`` says why that matters).
"""

from __future__ import annotations

from typing import Any

from ampddp.distributed.data import PendingSum


class LogWindow:
    """This rank's sums over the steps since the last record, summed over the ranks and reset by ``take``."""

    def __init__(self) -> None:
        self._shares, self._losses, self._tokens = 0.0, 0, 0.0
        self._step: tuple[float, int, float] = (0.0, 1, 1.0)

    def add(self, loss_sum: float, copies: int, samples: float, finite: bool, tokens: float) -> None:
        """One optimizer step: this rank's sum of per-sample losses (``copies`` ranks hold each data coordinate's, of
        ``samples`` in the global batch), whether the step's loss was finite on every rank (a non-finite one is left out
        of the mean) and the tokens this rank read."""
        self._step = (loss_sum, copies, max(samples, 1.0))
        if finite:
            self._shares += loss_sum / copies / max(samples, 1.0)
            self._losses += 1
        self._tokens += tokens

    def take(self, readers: int) -> dict[str, Any]:
        """The last step's ``loss`` (its global batch's mean), ``loss_mean`` (None when every step since was
        non-finite) and ``tokens`` (when any; ``readers`` ranks read each data coordinate's), then start over. Every
        rank calls it at the same step (one all-reduce)."""
        loss_sum, copies, samples = self._step
        step_sum, shares, tokens = PendingSum([loss_sum, self._shares, self._tokens]).result()
        taken: dict[str, Any] = {"loss": step_sum / copies / samples, "loss_mean": shares / self._losses if self._losses else None}
        if tokens:
            taken["tokens"] = int(tokens / readers)
        self._shares, self._losses, self._tokens = 0.0, 0, 0.0
        return taken
