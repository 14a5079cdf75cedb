"""Fixed points of the loop where other parts look in: logging, progress, user hooks.

A callback never changes training; it receives the run's progress and records. ``Callbacks`` calls
each in order; the summaries returned at the end are merged (later callbacks win on equal keys).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ampddp.errors import ConfigError
from ampddp.observe.observer import RunObserver
from ampddp.training.progress import Progress


class Callback:
    """Override the hooks you need; each default does nothing."""

    def on_start(self, progress: Progress) -> None:
        """Training starts (or resumes) at ``progress``."""

    def on_compiled(self, progress: Progress, seconds: float, mode: str, backend: str) -> None:
        """The first compiled forward and backward took ``seconds`` (inside the step about to be counted)."""

    def on_step(self, progress: Progress, record: dict[str, Any] | None) -> None:
        """An optimizer step ended; ``record`` (loss, lr, loss scale, ...) on logging and skipped steps, else None."""

    def on_evaluation(self, progress: Progress, metrics: dict[str, float]) -> None:
        """An evaluation ended with ``metrics``."""

    def on_end(self, progress: Progress) -> dict[str, Any]:
        """Training ended (finished or stopped by a signal); return what to add to the run's summary."""
        return {}

    def on_already_complete(self, progress: Progress) -> dict[str, Any]:
        """A finished run was started again and trained nothing; return the summary to report."""
        return {}

    def on_exception(self, progress: Progress, error: BaseException) -> None:
        """Training raised ``error`` (it propagates after every callback has seen it): release what
        ``on_start`` opened. Optional: a callback without it is skipped."""


HOOKS = ("on_start", "on_compiled", "on_step", "on_evaluation", "on_end", "on_already_complete")
"""The hooks every callback has (``on_exception`` is optional)."""


class Callbacks(Callback):
    """Several callbacks called in order, as one."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)

    def on_start(self, progress: Progress) -> None:
        for callback in self.callbacks:
            callback.on_start(progress)

    def on_compiled(self, progress: Progress, seconds: float, mode: str, backend: str) -> None:
        for callback in self.callbacks:
            callback.on_compiled(progress, seconds, mode, backend)

    def on_step(self, progress: Progress, record: dict[str, Any] | None) -> None:
        for callback in self.callbacks:
            callback.on_step(progress, record)

    def on_evaluation(self, progress: Progress, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_evaluation(progress, metrics)

    def on_end(self, progress: Progress) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        for callback in self.callbacks:
            summary.update(callback.on_end(progress))
        return summary

    def on_already_complete(self, progress: Progress) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        for callback in self.callbacks:
            summary.update(callback.on_already_complete(progress))
        return summary

    def on_exception(self, progress: Progress, error: BaseException) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, "on_exception", None)
            if hook is not None:
                hook(progress, error)


class ObserverCallback(Callback):
    """A ``RunObserver`` (progress, metrics.jsonl, summary.json, plots, loggers) as a callback."""

    def __init__(self, observer: RunObserver, epoch_samples: int | None = None) -> None:
        """``epoch_samples``: samples per epoch, for the console's fractional epoch (None: whole epochs)."""
        self.observer = observer
        self.epoch_samples = epoch_samples

    def _shown_epoch(self, progress: Progress) -> float | None:
        if not self.epoch_samples:
            return None
        return progress.epoch + min(progress.epoch_position / self.epoch_samples, 1.0)

    def on_start(self, progress: Progress) -> None:
        self.observer.started(progress.global_step, progress.epoch, progress.samples_seen)

    def on_compiled(self, progress: Progress, seconds: float, mode: str, backend: str) -> None:
        self.observer.compiled(progress.global_step + 1, progress.epoch, seconds, mode, backend)

    def on_step(self, progress: Progress, record: dict[str, Any] | None) -> None:
        self.observer.advance()
        if record is not None:
            self.observer.log_step(record, progress.samples_seen, self._shown_epoch(progress))

    def on_evaluation(self, progress: Progress, metrics: dict[str, float]) -> None:
        self.observer.evaluation(progress.global_step, progress.epoch, metrics, self._shown_epoch(progress))

    def on_end(self, progress: Progress) -> dict[str, Any]:
        return self.observer.close(progress.state_dict())

    def on_already_complete(self, progress: Progress) -> dict[str, Any]:
        return self.observer.close_unchanged(progress.state_dict())

    def on_exception(self, progress: Progress, error: BaseException) -> None:
        self.observer.abandon()


def as_callbacks(items: Iterable[Callback]) -> list[Callback]:
    """The callbacks in order, each checked to have every hook (a ``Callback`` subclass, or any object with them)."""
    callbacks: list[Callback] = []
    for index, item in enumerate(items):
        if isinstance(item, RunObserver):
            raise ConfigError(
                f"callbacks[{index}] is a RunObserver: the Trainer builds its own from report=Reporting(progress=..., loggers=[...]) "
                "(it saves the trackers' run ids with the checkpoints); pass report=None for none"
            )
        if not (isinstance(item, Callback) or all(callable(getattr(item, hook, None)) for hook in HOOKS)):
            missing = [hook for hook in HOOKS if not callable(getattr(item, hook, None))]
            raise ConfigError(
                f"callbacks[{index}] is a {type(item).__name__} without {', '.join(missing)}; valid: a subclass of "
                "ampddp.training.callbacks.Callback (override the hooks you need)"
            )
        callbacks.append(item)
    return callbacks
