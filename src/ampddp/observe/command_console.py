"""The console of an ``ampddp`` command: ampddp's own notes, and only the warnings and errors of the
libraries it runs (torch, MLflow, W&B, ...), whose INFO lines would otherwise bury the run's own.
``--verbose`` shows everything. Torch-free: the command line sets it up before anything heavy loads.
"""

from __future__ import annotations

import logging

FORMAT = "%(message)s"
OWN_LOGGERS = "ampddp"


class OwnNotesOnly(logging.Filter):
    """Passes every record of ampddp's loggers, and other loggers' records from WARNING up but their
    deprecation notices (torch's ``register_constant() ... deprecated``: for the library's authors,
    not for a user training a model)."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN_LOGGERS or record.name.startswith(f"{OWN_LOGGERS}.")
        return own or (record.levelno >= logging.WARNING and "deprecat" not in record.getMessage().lower())


def set_up_command_console(verbose: bool) -> None:
    """Log INFO records to stderr as bare lines; other libraries' notes only when ``verbose``."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(OwnNotesOnly())
