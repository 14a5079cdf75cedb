"""Stop cleanly when the cluster (or the user) asks: finish the step, checkpoint, exit with a code that says so.

Schedulers announce preemption with SIGTERM (Kubernetes, most batch systems) or a chosen signal
before the time limit (SLURM ``--signal=USR1@120``); a user at a terminal presses Ctrl-C (SIGINT), or
closes it (SIGHUP, a stop like SIGTERM; ignored as before under ``nohup``, which asks for that).
While ``StopSignals`` is active and training has begun, those signals only set a flag; the trainer
shares it with the other ranks in the all-reduce it makes at every optimizer step anyway, so all
ranks stop after the same step, save a checkpoint and return. A second SIGTERM during the save
changes nothing; a second Ctrl-C stops at once.

Before training begins there is nothing new to save, so a signal ends the command at once:
``EarlySignals`` covers the command's first line to the recipe (parsing, checks), the run's
``StopSignals`` the set-up. This module imports nothing heavy, so that it can be first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

from ampddp.errors import ConfigError

logger = logging.getLogger("ampddp.trainer")

EXIT_PREEMPTED = 75
"""Exit status of ``ampddp train`` after a signal-triggered checkpoint-and-stop (EX_TEMPFAIL: retry)."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), with or without a checkpoint: 128 + SIGINT, as a shell reports it."""
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
EARLY_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""What ``EarlySignals`` catches until the recipe is read: the signals a recipe may configure to stop a run."""


class StopRequested(BaseException):
    """A stop signal before training began, or a second Ctrl-C: the command ends at once (nothing new
    to save, or the user asked not to wait for it). A ``BaseException``, as ``KeyboardInterrupt`` is:
    it is raised wherever the signal lands, and an ``except Exception`` there must not swallow it."""

    exit_code = EXIT_PREEMPTED


class Interrupted(StopRequested, KeyboardInterrupt):
    """``StopRequested`` by SIGINT (Ctrl-C); a ``KeyboardInterrupt`` too, for code (a notebook, a
    script's own ``except KeyboardInterrupt``) that expects Ctrl-C as one."""

    exit_code = EXIT_INTERRUPTED


def stopped_at_once(sig: signal.Signals, why: str) -> StopRequested:
    """The exception a signal ``sig`` raises to end the command now; ``why``: what is kept."""
    kind = Interrupted if sig == signal.SIGINT else StopRequested
    return kind(f"stopped by {sig.name} {why}")


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside an import (an import system frame on its stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def raise_when_safe(error: StopRequested, frame: FrameType | None) -> None:
    """Raise ``error`` from a signal handler that interrupted ``frame``: at once, or, inside an import,
    at the first call after it. An exception in the middle of an extension module's import can abort
    the interpreter (torch's does: SIGABRT, a C++ stack dump) instead of ending it in one line; the
    imports of a start take seconds, so the stop still comes within seconds."""
    if not _importing(frame):
        raise error
    previous = sys.gettrace()

    def after_the_import(called: FrameType, event: str, arg: Any) -> None:
        if event == "call" and not _importing(called):
            sys.settrace(previous)
            raise error

    sys.settrace(after_the_import)


def end_now(line: str, exit_code: int) -> None:
    """End the process at once with ``line`` on stderr and ``exit_code``, from a signal handler that
    interrupted an import: raising there can abort the interpreter (torch's import: SIGABRT and a C++
    stack dump), and waiting for the import to finish took 27-36 s on a loaded machine. Only for the
    command's first phase, where nothing has been written yet (``EarlySignals``)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"{line}\n".encode())
    os._exit(exit_code)


SAME_PRESS_S = 1.0
"""A SIGINT this soon after the first is the same Ctrl-C arriving twice (a terminal sends it to every
process of the job, and a launching process forwards it too), not a second press."""
BEFORE_TRAINING = "before training began: nothing new to save; the same command starts (or resumes) the run again"


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


def ignored_by_nohup(sig: signal.Signals) -> bool:
    """SIGHUP ignored by whoever started this process (``nohup``): it asked for the run to outlive its
    terminal, so SIGHUP is left ignored instead of caught."""
    return sig.name == "SIGHUP" and signal.getsignal(sig) is signal.SIG_IGN


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
    """Context manager ending the command at once on SIGTERM, SIGINT, SIGUSR1 or SIGUSR2, from its
    first line until the recipe says which signals stop the run.

    The handler raises ``StopRequested`` (``Interrupted`` for SIGINT), so a signal ends recipe
    parsing, the start-up checks or a blocking open at once, with exit status 75 (130), where the
    default disposition would kill without a word and Ctrl-C would print a traceback; one that lands
    inside an import (torch's takes seconds) ends the process there, with the same line and status.
    ``StopSignals(..., early=this)`` takes over the signals it configures; ``release`` (and leaving
    the block) gives every other signal its previous disposition back.
    """

    def __init__(self) -> None:
        self._previous: dict[signal.Signals, Any] = {}
        self.command = "ampddp"
        """The command, for the line a signal inside an import ends it with (``ampddp train``, once known)."""

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        error = stopped_at_once(signal.Signals(signum), BEFORE_TRAINING)
        if _importing(frame):
            end_now(f"{self.command}: {error}", error.exit_code)
        raise error

    def __enter__(self) -> EarlySignals:
        if _in_main_thread():
            for sig in filter(None, map(_lookup, EARLY_SIGNALS)):
                if not ignored_by_nohup(sig):
                    self._previous[sig] = signal.signal(sig, self._stop)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def take(self, sig: signal.Signals) -> Any:
        """Stop catching ``sig`` for a new handler: its previous disposition; None if not caught here."""
        return self._previous.pop(sig, None)

    def release(self, keep: Iterable[str] = ()) -> None:
        """Give back every caught signal not named in ``keep``."""
        kept = {_lookup(name) for name in keep}
        for sig in [sig for sig in self._previous if sig not in kept]:
            signal.signal(sig, self._previous.pop(sig))


class StopSignals:
    """Context manager turning the given signals into a stop request (main thread only).

    Until ``begin_training`` a signal ends the process at once (``StopRequested``: there is nothing
    new to save, and a set-up that builds a large model or reads a large data set would otherwise
    outlast a scheduler's grace period); from then on it sets ``received`` (and counts ``requests``),
    and the training loop checkpoints after the step and stops. A second Ctrl-C (``SAME_PRESS_S`` or
    more after the first) does not wait: it raises ``Interrupted`` at once (a save it interrupts is
    abandoned atomically, the newest complete checkpoint stays).

    With ``early``, it takes those signals over from an ``EarlySignals``. It unblocks them too:
    ``launch_local`` starts its workers with the forwarded signals blocked, so that one forwarded
    before a worker is ready waits for this handler.
    """

    def __init__(self, names: tuple[str, ...] | list[str] = DEFAULT_STOP_SIGNALS, early: EarlySignals | None = None) -> None:
        self.signals = parse_signals(names)
        self._early = early
        self._previous: dict[signal.Signals, Any] = {}
        self._mask: set[signal.Signals] | None = None
        self._training = False
        self._pressed_at: float | None = None
        self.received: str | None = None
        """The first stop signal since training began (its name)."""
        self.requests = 0
        """Stop signals received since training began (a Ctrl-C delivered twice counts once)."""

    def begin_training(self) -> None:
        """From now on a signal asks for a checkpoint-and-stop after the current step."""
        self._training = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if not self._training:
            raise_when_safe(stopped_at_once(sig, BEFORE_TRAINING), frame)
            return
        if sig == signal.SIGINT:
            now = time.monotonic()
            if self._pressed_at is not None and now - self._pressed_at < SAME_PRESS_S:
                return  # the same press, delivered twice
            if self._pressed_at is not None:
                again = "again: stopped at once; the newest complete checkpoint is kept, the same command resumes from it"
                raise_when_safe(stopped_at_once(sig, again), frame)
                return
            self._pressed_at = now
            logger.warning("SIGINT: stopping after this step with a checkpoint; press Ctrl-C again to stop at once without it")
        self.requests += 1
        if self.received is None:
            self.received = sig.name

    def __enter__(self) -> StopSignals:
        if not _in_main_thread():
            return self
        try:
            for sig in self.signals:
                if ignored_by_nohup(sig):
                    continue
                previous = signal.signal(sig, self._handle)
                held = self._early.take(sig) if self._early is not None else None
                self._previous[sig] = previous if held is None else held
            if self._early is not None:
                self._early.release()
            if hasattr(signal, "pthread_sigmask"):
                self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)  # a pending one is handled here
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        # The mask first: a spawned worker started with these signals blocked gets them blocked
        # again, so one forwarded after training waits instead of killing it before it reports.
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
            self._mask = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
