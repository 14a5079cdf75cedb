"""Where a non-finite loss or a skipped step came from, and when to stop trying (apex issue 318)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from ampddp.diagnostics import first_non_finite_module
from ampddp.errors import NonFiniteGradientsError

logger = logging.getLogger("ampddp.trainer")


class NonFiniteGuard:
    """Names the module whose forward made inf/NaN, and stops the run after ``limit`` non-finite
    losses in a row instead of training on with a broken model."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_a_row = 0
        self._first_where = ""

    @staticmethod
    def diagnose(module: nn.Module, forward: Callable[[], Any], context: AbstractContextManager[Any], last_overflow: str | None) -> str:
        """The first module whose output in ``forward()`` is non-finite, else where gradients overflowed."""
        culprit = first_non_finite_module(module, forward, context)
        if culprit is not None:
            return f"the forward pass of module '{culprit}' produced inf/NaN"
        return f"gradients overflowed from {last_overflow}"

    def check(self, loss_value: float, step: int, diagnose: Callable[[], str]) -> None:
        """Count a non-finite global loss at ``step`` (warning with its origin); raise at the limit."""
        if math.isfinite(loss_value):
            self._in_a_row = 0
            return
        self._in_a_row += 1
        where = diagnose()
        logger.warning("step %d has a non-finite loss: %s", step, where)
        if self._in_a_row == 1:
            self._first_where = where
        if self._in_a_row >= self.limit:
            raise NonFiniteGradientsError(
                f"the loss was non-finite for {self._in_a_row} consecutive steps (first: {self._first_where}); "
                "training stopped instead of continuing with a broken model. Check that module's inputs and weights, the loss, "
                "and the learning rate."
            )
