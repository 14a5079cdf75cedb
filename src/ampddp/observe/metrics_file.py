"""metrics.jsonl read back: the run's history as it applies to the final model (a resumed run's
repeated steps dropped, a torn last record skipped)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ampddp.rundir import strict_json
from ampddp.rundir.files import METRICS_FILE, open_no_follow

logger = logging.getLogger("ampddp.observe")


MAX_RECORD_BYTES = 2**20
"""The longest line read as one record (ampddp writes a few hundred bytes; an O6 run's layer list a few
KiB): a longer one is skipped unread, with a warning, so a planted line never fills memory."""


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's history as it applies to the final model.

    metrics.jsonl is append-only; a run that died after logging step k+n but whose last checkpoint
    was step k logged those n steps again after resuming. Each ``start`` record drops the earlier
    records of steps beyond it, so every optimizer step appears once, as it was really applied.
    The file is read a line at a time (a link or a special file there is refused, ConfigError).
    """
    path = Path(run_dir) / METRICS_FILE
    try:
        handle = os.fdopen(open_no_follow(path, os.O_RDONLY), "rb")
    except FileNotFoundError:
        return []
    history: list[dict[str, Any]] = []
    with handle:
        for number, line in enumerate(_lines(handle, path), start=1):
            record = _record(line, path, number)
            if record is None:
                continue
            if record.get("kind") == "start":
                history = [kept for kept in history if kept.get("kind") == "start" or kept["step"] <= record["step"]]
            history.append(record)
    return history


def _lines(handle: BinaryIO, path: Path) -> Iterator[bytes | None]:
    """Each line of ``handle``; None for one longer than ``MAX_RECORD_BYTES`` (skipped, with a warning)."""
    number = 0
    while line := handle.readline(MAX_RECORD_BYTES + 1):
        number += 1
        if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
            while (rest := handle.readline(MAX_RECORD_BYTES)) and not rest.endswith(b"\n"):
                pass
            logger.warning("%s: line %d is longer than %d bytes, no record ampddp writes; skipped", path, number, MAX_RECORD_BYTES)
            yield None
            continue
        yield line


def _record(line: bytes | None, path: Path, number: int) -> dict[str, Any] | None:
    """The record on one line, or None (with a warning) for a torn or foreign one."""
    if line is None or not line.strip():
        return None
    try:
        record = strict_json.loads(line.decode("utf-8", errors="replace"))
    except ValueError:  # a record torn by a crash or a full disk: everything before it stands
        logger.warning("%s: line %d is not a whole record (torn by a crash or a full disk); skipped", path, number)
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        logger.warning("%s: line %d is not a metrics record; skipped", path, number)
        return None
    return record
