"""What happened between two records of a run: the steps' mean loss and the tokens trained on.

A record is written every ``log_every`` steps; one batch's loss at that step is noisy (a plot of it
jumps 0.64 -> 1.12 -> 1.03), so each record also carries the mean over the steps since the previous
one (``loss_mean``: the finite losses, the way a smoothed curve reads), which the console prints and
the plots draw, while ``loss`` keeps the step's own value.
"""

from __future__ import annotations

import math
from typing import Any


class LogWindow:
    """Sums over the steps since the last record, handed over (and reset) by ``take``."""

    def __init__(self) -> None:
        self._loss_sum, self._losses, self._tokens = 0.0, 0, 0

    def add(self, loss: float, tokens: float) -> None:
        """One optimizer step: its agreed loss (a non-finite one is left out of the mean) and tokens."""
        if math.isfinite(loss):
            self._loss_sum += loss
            self._losses += 1
        self._tokens += int(tokens)

    def take(self) -> dict[str, Any]:
        """``loss_mean`` (None when every step since was non-finite) and ``tokens`` (when any), then start over."""
        taken: dict[str, Any] = {"loss_mean": self._loss_sum / self._losses if self._losses else None}
        if self._tokens:
            taken["tokens"] = self._tokens
        self._loss_sum, self._losses, self._tokens = 0.0, 0, 0
        return taken
