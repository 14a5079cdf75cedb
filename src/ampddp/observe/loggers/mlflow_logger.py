"""MLflow: one MLflow run per ampddp run, continued after a resume."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ampddp.observe.loggers.base import MetricLogger, import_extra, route_to_the_run
from ampddp.rundir.beneath import refuse_links

logger = logging.getLogger("ampddp.observe.loggers")

DATABASE_FILE = "mlflow.db"
MAX_PARAM_LENGTH = 6000
"""MLflow refuses longer parameter values; a longer setting is logged cut to this length."""


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"trainer": {"max_steps": 5}}`` -> ``{"trainer.max_steps": "5"}`` (MLflow params are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LENGTH]
    return flat


class MlflowLogger(MetricLogger):
    """Logs ``<kind>/<name>`` at the optimizer step, and the recipe's settings as parameters.

    ``tracking_uri``: an MLflow server (``http://host:5000``) or store; None: ``MLFLOW_TRACKING_URI``
    if set, else a local SQLite store, ``<run_dir>/mlflow.db`` (``mlflow ui --backend-store-uri
    sqlite:///<run_dir>/mlflow.db``). It talks to MLflow through its own ``MlflowClient``: no
    process-wide active run is set, so a script's own ``mlflow.start_run`` is untouched.
    """

    name = "mlflow"
    requires = ("mlflow", "mlflow")

    def __init__(self, tracking_uri: str | None = None, experiment: str = "ampddp", run_name: str | None = None) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self._client: Any = None
        self._run_id: str | None = None
        self._metric: Any = None
        self._own_console_back: Callable[[], None] | None = None

    def start(self, run_dir: Path, config: Mapping[str, Any] | None, run_id: str | None, step: int) -> str | None:
        import os

        import_extra(self)
        from mlflow.entities import Metric, Param

        self._own_console_back = route_to_the_run("mlflow", "alembic")  # its errors: a line on the console, the report in the log
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or self._local_store(run_dir)
        self._client, self._metric = MlflowClient(tracking_uri=uri), Metric
        if run_id is not None and self._continue(run_id, uri):
            return run_id
        experiment = self._client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment is not None else self._client.create_experiment(self.experiment)
        self._run_id = self._client.create_run(experiment_id, run_name=self.run_name or run_dir.name).info.run_id
        params = [Param(key, value) for key, value in flatten(config or {}).items()]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self._client.log_batch(self._run_id, params=params[first : first + 100])
        return self._run_id

    @staticmethod
    def _local_store(run_dir: Path) -> str:
        """``sqlite:///<run_dir>/mlflow.db``, refused (ConfigError) when a link or a special file stands
        there: SQLite opens the path it is given and would write the database wherever a link points."""
        return f"sqlite:///{refuse_links(run_dir, run_dir / DATABASE_FILE).resolve()}"

    def _continue(self, run_id: str, uri: str) -> bool:
        """Continue run ``run_id``; False (with a warning: a fresh run follows) when this store has no such run."""
        from mlflow.exceptions import MlflowException

        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException as error:
            logger.warning("MLflow run %s is not in %s (%s): logging to a new run", run_id, uri, str(error).splitlines()[0])
            return False
        self._run_id = run_id
        return True

    def log(self, kind: str, values: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(f"{kind}/{key}", value, now, step) for key, value in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        try:
            if self._run_id is not None:
                self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")
                self._run_id = None
        finally:
            if self._own_console_back is not None:
                self._own_console_back()
                self._own_console_back = None
