"""The run's log file, ``<run_dir>/ampddp.log``: every record the console shows and what it leaves off
(other libraries' notes, deprecation notices), with time, level and source, from rank 0.

The console stays short; the file keeps the whole story of each start of the run (appended: a
resumed run adds to it). Nothing is written before the run dir is claimed: the records of the
build are kept in memory and written first when the file opens (a run refused while it is built
writes nothing). It follows the run dir's file rules (no link followed, no special file opened) and
never stops the run: a write that fails (a full disk) drops the file with one warning.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ampddp.distributed.env import DistEnv
from ampddp.rundir.files import open_for_append
from ampddp.rundir.run_dir import RunDir

LOG_FILE = "ampddp.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
logger = logging.getLogger("ampddp.observe")


class _Kept(logging.Handler):
    """Keeps records in memory until the log file can be opened."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RunLogHandler(logging.StreamHandler):
    """A stream handler that, when a write fails, removes itself with one warning instead of printing
    logging's traceback for every later record."""

    def handleError(self, record: logging.LogRecord) -> None:
        logging.getLogger().removeHandler(self)
        with contextlib.suppress(OSError):
            self.close()
        logger.warning("%s: cannot write the run's log file any more; the run goes on without it", getattr(self.stream, "name", LOG_FILE))


class RunLog:
    """Context manager: from entering, this process's log records (rank 0's) are kept; :meth:`open`
    writes them to ``<run_dir>/ampddp.log`` and appends every later one until leaving."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self._kept: _Kept | None = None
        self._handler: RunLogHandler | None = None

    def __enter__(self) -> RunLog:
        if self.env.is_main:
            self._kept = _Kept()
            logging.getLogger().addHandler(self._kept)
        return self

    def open(self, place: RunDir) -> None:
        """The run dir is the run's now: write what was kept, then every record as it comes."""
        if self._kept is None:
            return
        root = logging.getLogger()
        handler = RunLogHandler(open_for_append(place.path / LOG_FILE, place.path))
        handler.setFormatter(logging.Formatter(FORMAT))
        root.removeHandler(self._kept)
        for record in self._kept.records:
            handler.handle(record)
        self._kept = None
        root.addHandler(handler)
        self._handler = handler

    def __exit__(self, *exc_info: Any) -> None:
        root = logging.getLogger()
        if self._kept is not None:
            root.removeHandler(self._kept)
            self._kept = None
        if self._handler is not None:
            root.removeHandler(self._handler)
            with contextlib.suppress(OSError):
                self._handler.close()
            self._handler = None
