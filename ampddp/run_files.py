"""The files a run writes in its run dir besides checkpoints, and reading its summary back.

Torch-free: a start of a finished run reads the summary before torch is imported
(``ampddp.finished_run``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILES = ("loss.png", "eval_accuracy.png", "loss_scale.png")


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The summary a run wrote (empty when there is none or it does not parse)."""
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}
