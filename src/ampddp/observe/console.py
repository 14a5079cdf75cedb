"""What each process of a run prints: one voice per job.

Under several processes every rank would otherwise print every warning (and torch's own
``warnings``) once per rank. While ``rank_console`` is active, rank 0 prints as usual; the other
ranks print only errors, each line prefixed with ``[rank N]`` so a failure on one of them is still
seen and attributed. Everything is undone on exit: the handlers and warning capture it added, and
the filters it put on existing handlers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

from ampddp.choices import LOG_LEVEL_VARIABLE
from ampddp.distributed.env import DistEnv
from ampddp.observe.command_console import console_handler


class OtherRankFilter(logging.Filter):
    """Drops records below ERROR and prefixes the rest with the rank (for ranks other than 0)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return False
        message = record.getMessage()
        if not message.startswith(self.prefix):
            record.msg, record.args = self.prefix + message, None
        return True


@contextlib.contextmanager
def rank_console(env: DistEnv) -> Iterator[None]:
    """Route this process's log records and Python warnings by rank for the duration of a run.

    A process without logging handlers (a spawned worker) gets one on stderr for the run, so rank
    0's warnings and every rank's errors are printed in each launch mode alike.
    """
    root = logging.getLogger()
    added: logging.Handler | None = None
    if not root.handlers:  # a spawned worker: the console the command line set up in its parent
        added = console_handler(sys.stderr, verbose=os.environ.get(LOG_LEVEL_VARIABLE, "").upper() == "DEBUG")
        root.addHandler(added)
    previous_level = root.level
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    quiet = OtherRankFilter(env.rank) if env.distributed and env.rank != 0 else None
    if quiet is not None:
        for handler in root.handlers:
            handler.addFilter(quiet)
    ours = logging.getLogger("ampddp")
    ours_before = ours.level
    if os.environ.get(LOG_LEVEL_VARIABLE, "").upper() == "DEBUG":
        ours.setLevel(logging.DEBUG)
    captured_before = _capturing_warnings()
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(captured_before)  # an application that routes warnings to logging keeps doing so
        if quiet is not None:
            for handler in root.handlers:
                handler.removeFilter(quiet)
        if added is not None:
            root.removeHandler(added)
        root.setLevel(previous_level)
        ours.setLevel(ours_before)


def _capturing_warnings() -> bool:
    """Whether ``logging.captureWarnings(True)`` is in effect. logging has no public getter; it keeps
    the replaced ``showwarning`` while capturing (even if something wrapped its own since)."""
    if hasattr(logging, "_warnings_showwarning"):
        return logging._warnings_showwarning is not None
    return warnings.showwarning is getattr(logging, "_showwarning", None)


class _HeldNotes(logging.Filter):
    """Holds back the records below WARNING that reach the root handlers (their first look at a record)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self.seen: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if id(record) not in self.seen:
            self.seen.add(id(record))
            self.held.append(record)
        return False


@contextlib.contextmanager
def notes_held_until_done() -> Iterator[None]:
    """Informational lines logged inside are printed when the block succeeds, dropped when it raises:
    a run refused while it is being built says one line (its error; warnings still pass at once),
    and a run that builds says what it chose (``precision auto -> ...``) as before."""
    handlers = list(logging.getLogger().handlers)
    held = _HeldNotes()
    for handler in handlers:
        handler.addFilter(held)
    try:
        yield
    except BaseException:
        held.held.clear()
        raise
    finally:
        for handler in handlers:
            handler.removeFilter(held)
    for record in held.held:
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


@contextlib.contextmanager
def library_console(env: DistEnv, shown: bool = True) -> Iterator[None]:
    """ampddp's own notes (the precision it chose, where a run writes, "already complete") on stderr
    for the block, when the application has not configured logging: Python would otherwise drop every
    record below WARNING, and a script using the Trainer would learn nothing the command line says.
    Nothing changes when the application configured logging (a root handler, or handlers or a level
    on the ``ampddp`` logger: theirs decides), or when ``shown`` is False (``report=None``: silent).
    Other ranks than 0 show only errors, as under ``rank_console``."""
    ours = logging.getLogger("ampddp")
    configured = logging.getLogger().handlers or ours.handlers or ours.level != logging.NOTSET
    if not shown or configured:
        yield
        return
    handler = console_handler(sys.stderr, verbose=False)
    if env.distributed and env.rank != 0:
        handler.addFilter(OtherRankFilter(env.rank))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        ours.removeHandler(handler)
        ours.setLevel(logging.NOTSET)
