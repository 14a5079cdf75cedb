"""The interface every metric logger implements: start (or resume) a tracked run, log, close.

The ``RunObserver`` calls loggers on rank 0 only, with the same records it writes to metrics.jsonl:
``kind`` ``train`` (loss, lr, grad norm, samples/s, data wait; loss scale and skipped steps in
modes that scale the loss), ``eval`` (the evaluation's metrics) or ``compile`` (compile time).
A logger whose tracker has runs of its own (W&B, MLflow) returns the run's id from ``start``; the id
is saved with every checkpoint, and a resumed run hands it back, so the tracked run continues.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from ampddp.errors import ConfigError


class MetricLogger(ABC):
    """One destination of a run's records."""

    name: ClassVar[str]
    """The name recipes use for it (``observe.loggers``) and under which its run id is saved."""
    requires: ClassVar[tuple[str, str] | None] = None
    """(package, ampddp extra that installs it) for a logger built on an optional package."""

    def check_installed(self) -> None:
        """ConfigError saying which extra to install, when the package this logger needs is missing."""
        if self.requires is not None and importlib.util.find_spec(self.requires[0]) is None:
            package, extra = self.requires
            raise ConfigError(f"logger {self.name} needs the {package} package: pip install 'ampddp[{extra}]'")

    def start(self, run_dir: Path, config: Mapping[str, Any] | None, run_id: str | None, step: int) -> str | None:
        """Open for a run that starts (or resumes) at ``step``; ``run_id``: the tracked run to continue
        (saved by an earlier part of this run). Returns the id to save with checkpoints, or None."""
        return None

    @abstractmethod
    def log(self, kind: str, values: Mapping[str, float], step: int) -> None:
        """Record ``values`` (finite numbers, named without the kind) of a ``kind`` record at optimizer step ``step``."""

    def close(self, failed: bool = False) -> None:  # noqa: B027 - loggers without anything to flush
        """Flush and end: the run finished or stopped to resume later, or (``failed``) raised."""


NOT_LOGGED = ("kind", "step", "epoch", "world_size")
"""Record fields that are not values over time: the axes, and the process count (in the tracker's config)."""


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record that loggers plot (not ``NOT_LOGGED``)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in NOT_LOGGED and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


def import_extra(logger: MetricLogger) -> Any:
    """Import the optional package ``logger`` is built on (``check_installed`` says what to install)."""
    logger.check_installed()
    return importlib.import_module(logger.requires[0])


def route_to_the_run(*names: str) -> Callable[[], None]:
    """Send the records of loggers ``names`` (libraries that print through handlers of their own, as
    MLflow and alembic do, past the root's) through the root's handlers — the console's one line per
    error, the run's log file — until the returned function puts their own handlers back."""
    saved = []
    for name in names:
        library_logger = logging.getLogger(name)
        saved.append((library_logger, list(library_logger.handlers), library_logger.propagate))
        for handler in list(library_logger.handlers):
            library_logger.removeHandler(handler)
        library_logger.propagate = True

    def restore() -> None:
        for library_logger, handlers, propagate in saved:
            for handler in handlers:
                library_logger.addHandler(handler)
            library_logger.propagate = propagate

    return restore
