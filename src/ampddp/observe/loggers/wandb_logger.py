"""Weights & Biases: one W&B run per ampddp run, continued after a resume."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampddp.errors import ConfigError
from ampddp.observe.loggers.base import MetricLogger, import_extra
from ampddp.rundir.beneath import checked_folder

WANDB_MODES = ("online", "offline", "disabled")


class WandbLogger(MetricLogger):
    """Logs ``<kind>/<name>`` against the ``step`` metric (the optimizer step) to a W&B run.

    ``mode``: ``online``, ``offline`` (written under ``<run_dir>/wandb``; ``wandb sync`` uploads it)
    or ``disabled``; None: W&B's own choice (``WANDB_MODE``, else online). The run's id is saved
    with the checkpoints and a resume continues that run. Values are plotted against ``step``
    rather than W&B's own step counter, so the steps a resumed run logs again (the run that died
    logged them, but its checkpoint was older) are not refused as going backwards.
    """

    name = "wandb"
    requires = ("wandb", "wandb")

    def __init__(self, project: str | None = None, entity: str | None = None, mode: str | None = None, run_name: str | None = None) -> None:
        if mode is not None and mode not in WANDB_MODES:
            raise ConfigError(f"observe.wandb_mode={mode!r} is not valid; valid: {', '.join(WANDB_MODES)} (or null: W&B's default)")
        self.project, self.entity, self.mode, self.run_name = project, entity, mode, run_name
        self._run: Any = None

    def start(self, run_dir: Path, config: Mapping[str, Any] | None, run_id: str | None, step: int) -> str | None:
        wandb = import_extra(self)
        settings = wandb.Settings(silent=True, console="off")
        self._run = wandb.init(
            project=self.project or "ampddp", entity=self.entity, name=self.run_name or run_dir.name, dir=str(self._folder(run_dir)),
            mode=self.mode, id=run_id, resume="allow" if run_id else None, config=dict(config or {}),
            settings=settings, reinit="create_new",
        )  # fmt: skip
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        return str(self._run.id)

    @staticmethod
    def _folder(run_dir: Path) -> Path:
        """The run dir W&B is given: it writes ``wandb/`` there, so that folder must be no link (ConfigError)."""
        checked_folder(run_dir, run_dir / "wandb")
        return run_dir

    def log(self, kind: str, values: Mapping[str, float], step: int) -> None:
        self._run.log({"step": step, **{f"{kind}/{key}": value for key, value in values.items()}})

    def close(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None
