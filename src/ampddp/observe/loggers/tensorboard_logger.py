"""TensorBoard event files under ``<run_dir>/tensorboard``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampddp.observe.loggers.base import MetricLogger, import_extra
from ampddp.rundir.beneath import checked_folder


class TensorBoardLogger(MetricLogger):
    """Scalars as ``<kind>/<name>`` at the optimizer step (``tensorboard --logdir <run_dir>/tensorboard``)."""

    name = "tensorboard"
    requires = ("tensorboard", "tensorboard")

    def __init__(self) -> None:
        self._writer: Any = None

    def start(self, run_dir: Path, config: Mapping[str, Any] | None, run_id: str | None, step: int) -> str | None:
        import_extra(self)
        from torch.utils.tensorboard import SummaryWriter

        folder = checked_folder(run_dir, run_dir / "tensorboard")  # no link on the way: the events stay in the run dir
        self._writer = SummaryWriter(str(folder), purge_step=step + 1 if step > 0 else None)
        return None

    def log(self, kind: str, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
