"""The console's streams never decide a run's fate.

``ampddp train ... | head -5`` closes stdout after five lines; a console redirected to a full device
(``> /dev/full``) or a terminal that went away (SIGHUP, then EIO) fails every write. A run must not
end for that: the stream that cannot be written any more is pointed at the null device (so no later
write fails, Python's exit-time flush included), the run says so once — on the other stream when it
still works, and in the run's log file either way — and training goes on. Torch-free: the command
line sets it up first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO

logger = logging.getLogger("ampddp.observe")


def write_line(text: str, stream: TextIO | None = None) -> None:
    """``print(text)`` to ``stream`` (default: stdout), flushed; a stream that cannot be written goes
    quiet (``went_quiet``) instead of raising."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except OSError as error:  # BrokenPipeError, a full device, a terminal gone (EIO)
        went_quiet(stream, error)


def went_quiet(stream: TextIO, error: OSError) -> None:
    """``stream`` can no longer be written: its file descriptor is pointed at the null device, and one
    warning says so (on the console's other stream while it works; in the run's log always)."""
    name = _name(stream)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's captured stream): nothing to silence
        return
    _drop_pending(stream)
    reason = f"{error.strerror or type(error).__name__}, errno {error.errno}" if error.errno else type(error).__name__
    logger.warning("the console's %s cannot be written (%s): nothing more is shown there; the run goes on, and its run dir "
                   "keeps what it would have shown (metrics.jsonl, ampddp.log)", name, reason)  # fmt: skip


def _name(stream: TextIO) -> str:
    if stream is sys.__stdout__ or stream is sys.stdout:
        return "stdout"
    if stream is sys.__stderr__ or stream is sys.stderr:
        return "stderr"
    return getattr(stream, "name", "output")


def _drop_pending(stream: TextIO) -> None:
    """Write what the failed write left buffered, now to the null device, so the stream is clean."""
    with contextlib.suppress(OSError, ValueError):
        stream.flush()


class ConsoleHandler(logging.StreamHandler):
    """The console's log handler: a record it cannot write silences its stream (``went_quiet``)
    instead of printing logging's "--- Logging error ---" traceback for it and every later record."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            went_quiet(self.stream, error)
            return
        super().handleError(record)
