"""A re-run of a finished run answers "already complete" from its files, before torch is imported.

``ampddp train`` on a run dir whose newest checkpoint ended the run would otherwise import torch,
build the datasets, the model and the optimizer and load the checkpoint, only to report that there
is nothing to train (15 s measured on a busy 2-core machine). The newest checkpoint's manifest
records the run's progress, a digest of its settings and the ampddp version; when they match this
start (same recipe and overrides, same ampddp, same number of processes), the progress is past the
horizon, and every file the manifest lists verifies, the answer needs none of that.

Anything else goes the full way, which decides and reports as before: a manifest written before
these facts, changed settings, a checkpoint that does not verify (the full way falls back to an
older one), a run dir in use (the full way names its holder), ``resume: never`` or ``resume_from``,
or a start under a launcher (each rank joins its process group there).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ampddp.checkpoint.manifest import complete_folders, config_digest, read_manifest, verify_folder
from ampddp.config import RunConfig
from ampddp.errors import CheckpointError
from ampddp.rundir.files import read_summary
from ampddp.rundir.run_dir import RunDir
from ampddp.training.progress import Progress, finished

logger = logging.getLogger("ampddp.trainer")

LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def finished_run_summary(config: RunConfig, environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The summary a start of this already finished run reports, or None when only the full start can tell."""
    environ = dict(os.environ) if environ is None else environ
    if config.checkpoint.resume != "auto" or config.checkpoint.resume_from or any(name in environ for name in LAUNCHER_VARIABLES):
        return None
    run_dir = RunDir(config.trainer.run_dir, "trainer.run_dir")
    folders = complete_folders(run_dir.checkpoints)
    if not folders:
        return None
    folder = folders[-1][1]
    try:
        manifest = read_manifest(folder)
    except CheckpointError:
        return None
    progress = _finished_progress(manifest.run, config)
    if progress is None or not manifest.verifiable or manifest.world_size != config.distributed.nproc_per_node:
        return None
    with run_dir.lock():
        try:
            verify_folder(folder, manifest)
        except CheckpointError:
            return None
        summary = read_summary(run_dir.path)
    if summary.get("steps") != progress.global_step:
        return None  # its summary was not written whole: the full start rebuilds it (and the plots)
    logger.info("already complete at step %d (epoch %d): nothing to train (%s verified)", progress.global_step, progress.epoch, folder)
    return {**summary, "already_complete": True, "preempted": None}


def _finished_progress(run: dict[str, Any] | None, config: RunConfig) -> Progress | None:
    """The recorded progress when the manifest's facts match this start and it is past the horizon."""
    from ampddp import __version__

    if run is None or run.get("ampddp") != __version__ or run.get("config_sha256") != config_digest(config.to_dict()):
        return None
    progress = Progress()
    try:
        progress.load_state_dict(run["progress"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return progress if finished(progress, config.trainer.max_steps, config.trainer.max_epochs) else None
