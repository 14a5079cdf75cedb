"""``precision: auto`` resumed keeps the mode its checkpoint trained in.

``auto`` picks per device, so a run started on a bf16 GPU and resumed on a machine where ``auto``
would pick another mode would otherwise change its numerics mid-run. The checkpoint's manifest
records the concrete mode; a resumed ``auto`` run reads it before its set-up is built and keeps it,
unless this device cannot run it (``ampddp.precision.hardware.unsupported``). A mode named in the
settings is always obeyed (a change is then a deliberate one, converted and reported as such).
"""

from __future__ import annotations

from pathlib import Path

from ampddp.checkpoint import keys
from ampddp.checkpoint.manifest import read_manifest
from ampddp.choices import AUTO_PRECISION
from ampddp.distributed.data import broadcast_from_main
from ampddp.distributed.env import DistEnv
from ampddp.errors import CheckpointError
from ampddp.precision.choice import CONCRETE_MODES, Precision
from ampddp.training.resume.source import resume_candidates


def checkpoint_precision_mode(run_dir: str | Path | None, resume: str | Path) -> str | None:
    """The concrete mode of the newest checkpoint a resume would find whose manifest reads (None: no
    such checkpoint, or one written before manifests recorded it)."""
    for ref in resume_candidates(run_dir, resume):
        try:
            run = read_manifest(ref.path).run
        except CheckpointError:
            continue  # the resume passes over it too
        mode = run.get(keys.RUN_PRECISION_MODE) if isinstance(run, dict) else None
        return mode if mode in CONCRETE_MODES else None  # anything else: the resume converts what the checkpoint holds
    return None


def kept_precision(precision: Precision, run_dir: str | Path | None, resume: str | Path, env: DistEnv) -> Precision:
    """``precision`` for a run about to resume: ``auto`` carries the checkpoint's mode (rank 0 reads it,
    so every rank keeps the same one); any other mode is itself."""
    if precision.mode != AUTO_PRECISION:
        return precision
    mode = broadcast_from_main(checkpoint_precision_mode(run_dir, resume) if env.is_main else None, env)
    return precision.continuing(mode)
