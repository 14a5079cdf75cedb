"""Where a non-finite loss or a skipped step came from, and when to stop trying (apex issue 318)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ampddp.errors import NonFiniteGradientsError
from ampddp.precision.casting import map_tensors
from ampddp.precision.diagnostics import first_non_finite_module

logger = logging.getLogger("ampddp.trainer")


class NonFiniteGuard:
    """Names the module whose forward made inf/NaN, and stops the run after ``limit`` non-finite
    losses in a row instead of training on with a broken model."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_a_row = 0
        self._first_where = ""

    @staticmethod
    def diagnose(
        module: nn.Module,
        forward: Callable[[], Any],
        context: AbstractContextManager[Any],
        last_overflow: str | None,
        bad_inputs: str | None = None,
    ) -> str:
        """The data's fault when ``bad_inputs`` names samples holding inf/NaN (``blame_inputs``), else
        the first module whose output in ``forward()`` is non-finite, else where gradients overflowed."""
        if bad_inputs is not None:
            return bad_inputs
        culprit = first_non_finite_module(module, forward, context)
        if culprit is not None:
            return f"the forward pass of module '{culprit}' produced inf/NaN"
        return f"gradients overflowed from {last_overflow or 'another rank (finite on this one)'}"

    def check(self, finite: bool, step: int, diagnose: Callable[[], str]) -> None:
        """Count a non-finite global loss at ``step`` (``finite`` False; warning with its origin); raise at the limit."""
        if finite:
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


def non_finite_rows(batch: Any) -> list[int]:
    """The rows (samples) of ``batch`` holding inf/NaN in a floating input. Looked at only after a
    non-finite loss, so a good step pays nothing."""
    rows: set[int] = set()

    def note(value: torch.Tensor) -> torch.Tensor:
        if value.is_floating_point() and value.dim() > 0 and not bool(torch.isfinite(value).all()):
            bad = ~torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)
            rows.update(int(row) for row in bad.nonzero().flatten().tolist())
        return value

    map_tensors(batch, note)
    return sorted(rows)


def blame_inputs(samples: list[str]) -> str | None:
    """The diagnosis when ``samples`` (the bad inputs, named) is not empty: the data, not the model."""
    if not samples:
        return None
    return f"the input batch itself holds inf/NaN ({'; '.join(samples)}): the data's fault, not the model's; check those samples"
