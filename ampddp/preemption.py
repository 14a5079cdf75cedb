"""Stop cleanly when the cluster asks: finish the step, checkpoint, exit with a code that says so.

Schedulers announce preemption with SIGTERM (Kubernetes, most batch systems) or a chosen signal
before the time limit (SLURM ``--signal=USR1@120``). While ``StopSignals`` is active, those signals
only set a flag; the trainer shares it with the other ranks in the all-reduce it makes at every
optimizer step anyway, so all ranks stop after the same step, save a checkpoint and return. A second signal during the save changes nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from ampddp.errors import ConfigError

EXIT_PREEMPTED = 75
"""Exit status of ``ampddp train`` after a signal-triggered checkpoint-and-stop (EX_TEMPFAIL: retry)."""
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


def parse_signals(names: tuple[str, ...] | list[str]) -> tuple[signal.Signals, ...]:
    parsed = []
    for name in names:
        try:
            parsed.append(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            raise ConfigError(f"stop signal {name!r} is not a signal name; valid examples: SIGTERM, SIGUSR1, SIGUSR2, SIGINT") from None
    return tuple(parsed)


class StopSignals:
    """Context manager turning the given signals into a stop request (main thread only)."""

    def __init__(self, names: tuple[str, ...] | list[str] = DEFAULT_STOP_SIGNALS) -> None:
        self._signals = parse_signals(names)
        self._previous: dict[signal.Signals, Any] = {}
        self.received: str | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
