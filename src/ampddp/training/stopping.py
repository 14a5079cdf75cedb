"""The run's stop signals as a part of the loop: caught while training runs, voted on in the step's one
all-reduce, and obeyed by an evaluation.

A signal only sets a flag (``ampddp.preemption.StopSignals``); every rank adds its vote to the
all-reduce the step makes anyway (beside the loss), so all ranks stop after the same step, checkpoint
it and return. An evaluation asks before each batch: one cut short stops training after the step (with
its checkpoint); the final evaluation instead ends the run at once, keeping the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

from ampddp.preemption import StopSignals, stopped_at_once

logger = logging.getLogger("ampddp.trainer")
ANOTHER_RANK = "a stop signal on another rank"


class StopAgreement:
    """``signals``: names to catch while training runs, or a ``StopSignals`` already catching (the caller's)."""

    def __init__(self, signals: tuple[str, ...] | StopSignals = ()) -> None:
        self.signals = signals
        self._stop: StopSignals | None = None
        """The stop signals while training runs."""
        self.evaluation_stopped = False
        """An evaluation was cut short by a signal: training stops after this step, with its checkpoint."""

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Signals stop the run after a step from here on (before, they ended the set-up at once)."""
        own = not isinstance(self.signals, StopSignals)
        stop = StopSignals(self.signals) if own else self.signals
        with stop if own else contextlib.nullcontext():
            stop.begin_training()
            self._stop = stop
            try:
                yield
            finally:
                self._stop = None

    def vote(self) -> float:
        """This rank's vote for the step's all-reduce: 1 when it received a signal."""
        return float(self._stop is not None and self._stop.received is not None)

    def reason(self) -> str:
        """Why the run stops: this rank's signal, or another rank's."""
        return (self._stop.received if self._stop is not None else None) or ANOTHER_RANK

    def evaluation_asks(self, final: bool) -> Callable[[], bool] | None:
        """What an evaluation asks before each batch: whether a signal came (for the final evaluation,
        one since it began: one before it let the run end evaluated); None outside training."""
        stop = self._stop
        if stop is None:
            return None
        before = stop.requests if final else 0
        return lambda: stop.requests > before

    def stop_evaluating(self, step: int, final: bool, kept: int | None) -> None:
        """A signal cut the evaluation at ``step`` short: training stops after the step, with its
        checkpoint; the final evaluation ends the run at once, keeping the newest checkpoint (``kept``,
        from which a resume evaluates: a finished run's checkpoint always follows its final evaluation)."""
        name = self._stop.received if self._stop is not None and self._stop.received else "SIGTERM"
        if final:
            raise stopped_at_once(signal.Signals[name], (
                f"during the final evaluation (step {step}): the newest checkpoint (step {kept}) is kept and the same "
                "command resumes from it and evaluates" if kept is not None else
                f"during the final evaluation (step {step}), before any checkpoint: the same command trains the run again"))  # fmt: skip
        logger.warning("evaluation at step %d stopped by %s (not recorded); checkpointing this step and stopping", step, name)
        self.evaluation_stopped = True
