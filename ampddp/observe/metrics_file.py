"""metrics.jsonl read back: the run's history as it applies to the final model (a resumed run's
repeated steps dropped, a torn last record skipped)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ampddp.rundir.files import METRICS_FILE

logger = logging.getLogger("ampddp.observe")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's history as it applies to the final model.

    metrics.jsonl is append-only; a run that died after logging step k+n but whose last checkpoint
    was step k logged those n steps again after resuming. Each ``start`` record drops the earlier
    records of steps beyond it, so every optimizer step appears once, as it was really applied.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    history: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a record torn by a crash or a full disk: everything before it stands
            logger.warning("%s: line %d is not a whole record (torn by a crash or a full disk); skipped", path, number)
            continue
        if not isinstance(record, dict) or "step" not in record:
            logger.warning("%s: line %d is not a metrics record; skipped", path, number)
            continue
        if record.get("kind") == "start":
            history = [kept for kept in history if kept.get("kind") == "start" or kept["step"] <= record["step"]]
        history.append(record)
    return history
