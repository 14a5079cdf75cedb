"""The console of an ``ampddp`` command: ampddp's own notes, and only the warnings and errors of the
libraries it runs (torch, MLflow, W&B, ...), whose INFO lines would otherwise bury the run's own.
Another library's error is one line there, once per library (its whole report, traceback included,
goes to the run's log file). ``--verbose`` shows everything. Torch-free: the command line sets it up
before anything heavy loads.
"""

from __future__ import annotations

import logging

from ampddp.observe.console_streams import ConsoleHandler

FORMAT = "%(message)s"
OWN_LOGGERS = "ampddp"


def is_own(record: logging.LogRecord) -> bool:
    return record.name == OWN_LOGGERS or record.name.startswith(f"{OWN_LOGGERS}.")


def library(record: logging.LogRecord) -> str:
    """The library a record comes from: its logger's first name (``mlflow`` for ``mlflow.store.db``)."""
    return record.name.split(".", 1)[0]


class OwnNotesOnly(logging.Filter):
    """Passes every record of ampddp's loggers, and other loggers' records from WARNING up but their
    deprecation notices (torch's ``register_constant() ... deprecated``: for the library's authors,
    not for a user training a model) and all but the first error of each library."""

    def __init__(self) -> None:
        super().__init__()
        self._erred: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if is_own(record):
            return True
        if record.levelno < logging.WARNING or "deprecat" in record.getMessage().lower():
            return False
        if record.levelno >= logging.ERROR:
            first = library(record) not in self._erred
            self._erred.add(library(record))
            return first
        return True


class ConsoleFormatter(logging.Formatter):
    """ampddp's records as they are; another library's error as one line naming it, its report (a
    traceback of 60 lines, say) left to the run's log file."""

    def format(self, record: logging.LogRecord) -> str:
        if is_own(record) or record.levelno < logging.ERROR:
            return super().format(record)
        said = next((line.strip() for line in record.getMessage().splitlines() if line.strip()), "")
        return (f"{library(record)} reported an error: {said[:300]}; the run goes on (its full report is in the run's log file, "
                "ampddp.log in the run dir; further errors of it only there)")  # fmt: skip


def console_handler(stream: object, verbose: bool) -> logging.Handler:
    """The console's handler on ``stream`` (see ``ConsoleHandler``): bare lines, and, unless ``verbose``,
    ampddp's notes with only the warnings and first errors of other libraries."""
    handler = ConsoleHandler(stream)
    handler.setFormatter(logging.Formatter(FORMAT) if verbose else ConsoleFormatter(FORMAT))
    if not verbose:
        handler.addFilter(OwnNotesOnly())
    return handler


def set_up_command_console(verbose: bool) -> None:
    """Log INFO records to stderr as bare lines; other libraries' notes only when ``verbose``."""
    import sys

    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(console_handler(sys.stderr, verbose))
    root.setLevel(logging.INFO)
