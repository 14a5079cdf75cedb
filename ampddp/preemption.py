"""Stop cleanly when the cluster asks: finish the step, checkpoint, exit with a code that says so.

Schedulers announce preemption with SIGTERM (Kubernetes, most batch systems) or a chosen signal
before the time limit (SLURM ``--signal=USR1@120``). While ``StopSignals`` is active, those signals
only set a flag; the trainer shares it with the other ranks in the all-reduce it makes at every
optimizer step anyway, so all ranks stop after the same step, save a checkpoint and return. A second signal during the save changes nothing.

``EarlySignals`` covers the seconds before that: the command line installs it before importing
torch or reading the recipe, and the ``StopSignals`` of the run takes over what it caught. This
module imports nothing heavy, so that it can be first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

from ampddp.errors import ConfigError

EXIT_PREEMPTED = 75
"""Exit status of ``ampddp train`` after a signal-triggered checkpoint-and-stop (EX_TEMPFAIL: retry)."""
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
EARLY_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
"""What ``EarlySignals`` holds until the recipe is read: the signals a recipe may configure to stop a run
(SIGINT stays Python's KeyboardInterrupt until then)."""


def _lookup(name: str) -> signal.Signals | None:
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        return None


def parse_signals(names: tuple[str, ...] | list[str]) -> tuple[signal.Signals, ...]:
    """'SIGTERM' or 'TERM' -> signal.SIGTERM; a name that is no signal is a ConfigError naming it."""
    parsed = []
    for name in names:
        sig = _lookup(name)
        if sig is None:
            raise ConfigError(f"stop signal {name!r} is not a signal name; valid examples: SIGTERM, SIGUSR1, SIGUSR2, SIGINT")
        parsed.append(sig)
    return tuple(parsed)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def blocked_signals(signals: Iterable[signal.Signals]) -> Iterator[None]:
    """Hold ``signals`` pending in this thread for the block (processes started meanwhile inherit the
    mask); on leaving, the old mask returns and one that came is delivered. A no-op without POSIX masks."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class EarlySignals:
    """Context manager holding SIGTERM, SIGUSR1 and SIGUSR2 from a command's first line until the recipe says which stop the run.

    It only records what arrives. ``StopSignals(..., early=this)`` takes over the signals it
    configures, keeping one that already arrived; ``release`` (and leaving the block) gives every
    other signal its previous disposition back and delivers it again if it arrived, so the process
    then acts as if it had never been caught.
    """

    def __init__(self) -> None:
        self._previous: dict[signal.Signals, Any] = {}
        self.received: list[signal.Signals] = []

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum not in self.received:
            self.received.append(signal.Signals(signum))

    def __enter__(self) -> EarlySignals:
        if _in_main_thread():
            for sig in filter(None, map(_lookup, EARLY_SIGNALS)):
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def take(self, sig: signal.Signals) -> tuple[Any, bool] | None:
        """Stop holding ``sig`` for a new handler: its previous disposition and whether it arrived; None if not held."""
        if sig not in self._previous:
            return None
        return self._previous.pop(sig), sig in self.received

    def release(self, keep: Iterable[str] = ()) -> None:
        """Give back every held signal not named in ``keep``; one that already arrived is raised again."""
        kept = {_lookup(name) for name in keep}
        for sig in [sig for sig in self._previous if sig not in kept]:
            signal.signal(sig, self._previous.pop(sig))
            if sig in self.received:
                signal.raise_signal(sig)


class StopSignals:
    """Context manager turning the given signals into a stop request (main thread only).

    With ``early``, it takes those signals over from an ``EarlySignals`` (one already caught counts
    as received) and releases the rest. It unblocks them too: ``launch_local`` starts its workers with
    the forwarded signals blocked, so that one forwarded before a worker is ready waits for this handler.
    """

    def __init__(self, names: tuple[str, ...] | list[str] = DEFAULT_STOP_SIGNALS, early: EarlySignals | None = None) -> None:
        self.signals = parse_signals(names)
        self._early = early
        self._previous: dict[signal.Signals, Any] = {}
        self._mask: set[signal.Signals] | None = None
        self.received: str | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if not _in_main_thread():
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if hasattr(signal, "pthread_sigmask"):
            self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        if self._early is not None:
            self._take_over(self._early)
        return self

    def _take_over(self, early: EarlySignals) -> None:
        arrived_early = []
        for sig in self.signals:
            held = early.take(sig)
            if held is not None:
                self._previous[sig], arrived = held
                arrived_early += [sig] if arrived else []
        if arrived_early:  # they came before any signal this handler saw
            self.received = min(arrived_early, key=early.received.index).name
        early.release()

    def __exit__(self, *exc_info: Any) -> None:
        # The mask first: a spawned worker started with these signals blocked gets them blocked
        # again, so one forwarded after training waits instead of killing it before it reports.
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
            self._mask = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
