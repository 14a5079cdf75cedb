"""Where a run's records go besides metrics.jsonl: TensorBoard, CSV, Weights & Biases, MLflow.

Each is a ``MetricLogger`` (``base.py``); recipes name them in ``observe.loggers``, code passes
them (or their names) to ``Reporting(loggers=...)``. W&B and MLflow are optional extras
(``pip install 'ampddp[wandb]'`` / ``'ampddp[mlflow]'``); a missing one is refused when the run is
checked, before anything is written.
"""

from __future__ import annotations

from ampddp.errors import choice_error
from ampddp.observe.loggers.base import MetricLogger
from ampddp.observe.loggers.csv_logger import CsvLogger
from ampddp.observe.loggers.mlflow_logger import MlflowLogger
from ampddp.observe.loggers.tensorboard_logger import TensorBoardLogger
from ampddp.observe.loggers.wandb_logger import WandbLogger

LOGGERS: dict[str, type[MetricLogger]] = {cls.name: cls for cls in (TensorBoardLogger, CsvLogger, WandbLogger, MlflowLogger)}
"""Every logger by the name recipes use."""


def logger_named(name: str) -> MetricLogger:
    """A logger with its default settings, by name."""
    if name not in LOGGERS:
        raise choice_error("logger", name, LOGGERS)
    return LOGGERS[name]()


__all__ = ["LOGGERS", "CsvLogger", "MetricLogger", "MlflowLogger", "TensorBoardLogger", "WandbLogger", "logger_named"]
