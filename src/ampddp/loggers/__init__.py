"""The loggers' old path, kept for code that imports them from here (``from ampddp.loggers import
WandbLogger``); they live in ``ampddp.observe.loggers``."""

from ampddp.observe.loggers import LOGGERS, CsvLogger, MetricLogger, MlflowLogger, TensorBoardLogger, WandbLogger, logger_named

__all__ = ["LOGGERS", "CsvLogger", "MetricLogger", "MlflowLogger", "TensorBoardLogger", "WandbLogger", "logger_named"]
