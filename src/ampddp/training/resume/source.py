"""Which checkpoint a run continues from, and what it sets aside: the resume decision.

``ampddp.checkpoint`` stores, verifies and finds checkpoints; this module decides with them where a
run resumes (``resume``: auto, never, a step folder or a run dir), which of this run's newer step
folders go to ``abandoned/`` and which starts it refuses, in the recipe's words (``resume_from``,
``run_dir``). Rank 0 decides (:func:`plan_resume`, read-only); the ranks apply it together.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ampddp.checkpoint import keys
from ampddp.checkpoint.manifest import step_of
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore, find_checkpoint, resume_source
from ampddp.errors import CheckpointError, ConfigError

logger = logging.getLogger("ampddp.checkpoint")


def plan_resume(store: CheckpointStore | None, resume: str | Path, passed_over: Collection[str] = ()) -> dict[str, Any]:
    """Rank 0's resume decision as plain data to broadcast, reading only (nothing moves): ``start``
    (a folder or None), ``shards_verified`` (False: a sharded checkpoint's shards were checked by
    size alone, the ranks hash them together before reading), ``set_aside`` (this run's newer step
    folders, moved into ``<run_dir>/abandoned/`` by :func:`set_aside_newer` when the resume is
    applied), ``warnings`` (lines already logged), ``error`` ((kind, message) or None).

    ``"auto"``: the newest checkpoint of ``store`` that verifies; each newer one that does not (or is
    in ``passed_over``: found bad by the ranks) is reported and left on disk. A step folder: that
    checkpoint (it must verify); when it belongs to ``store``, newer step folders are set aside. A run
    dir: its newest checkpoint that verifies. ``store`` (this run's, or None) must otherwise hold
    nothing newer.
    """
    try:
        return {"start": None, "error": None, "shards_verified": True, "set_aside": [], **_plan(store, resume, passed_over)}
    except (CheckpointError, ConfigError) as error:
        return {"start": None, "warnings": [], "set_aside": [], "error": (type(error).__name__, str(error))}


def _plan(store: CheckpointStore | None, resume: str | Path, passed_over: Collection[str]) -> dict[str, Any]:
    ref, warnings = _chosen(store, resume, passed_over)
    for line in warnings:
        logger.warning(line)
    if store is None or resume == "auto":
        return {"start": str(ref.path) if ref is not None else None, "warnings": warnings, "shards_verified": resume != "auto"}
    return {"start": str(ref.path) if ref is not None else None, "warnings": warnings, "set_aside": _newer_to_set_aside(store, ref)}


def _chosen(store: CheckpointStore | None, resume: str | Path, passed_over: Collection[str]) -> tuple[CheckpointRef | None, list[str]]:
    """The checkpoint ``resume`` names (verified; sized-only shards for ``auto``) and the lines saying
    which newer ones were passed over."""
    if resume == "auto":
        return store.newest_verified(shards_sized_only=True, passed_over=passed_over) if store is not None else (None, [])
    if resume == "never":
        return None, []
    source = resume_source(resume)
    if source.step is not None:
        ref = find_checkpoint(source.path)
        ref.verify()
        return ref, []
    if not source.path.exists():
        raise CheckpointError(f"{resume}: no such checkpoint or run directory")
    ref, warnings = CheckpointStore(source.path, keep_last=None).newest_verified()
    if ref is None:
        raise CheckpointError(f"{resume}: no checkpoint that verifies (expected {keys.CHECKPOINTS_DIR}/step-*/ with COMPLETE)")
    return ref, warnings


def _newer_to_set_aside(store: CheckpointStore, ref: CheckpointRef | None) -> list[str]:
    """Step folders of this run newer than where it starts from: set aside when it starts from one of
    its own checkpoints, refused when they are complete and it starts elsewhere."""
    start = ref.step if ref is not None else 0
    newer = [folder for folder in store.step_folders() if (step_of(folder) or 0) > start]
    if newer and ref is not None and ref.path.resolve().parent == store.root.resolve():
        return [str(folder) for folder in newer]
    if any((folder / keys.COMPLETE_FILE).is_file() for folder in newer):
        newest = max(step_of(folder) or 0 for folder in newer)
        raise ConfigError(
            f"run_dir {store.root.parent} already holds checkpoints up to step {newest}, newer than where this run "
            f"starts (step {start}); use checkpoint resume 'auto' to continue it, resume_from one of its own checkpoints "
            f"(newer ones are moved to {keys.ABANDONED_DIR}/), or a new run_dir"
        )
    return []


def set_aside_newer(store: CheckpointStore, start: int, folders: list[str]) -> None:
    """Move the step folders a resume from ``start`` planned to set aside (:func:`plan_resume`) into
    ``<run_dir>/abandoned/``, saying where each went; the first write of a resumed run."""
    if not folders:
        return
    newer = [Path(folder) for folder in folders if Path(folder).exists()]
    moved = store.move_aside(newer)
    places = ", ".join(f"{a.name} -> {b}" for a, b in zip(newer, moved))
    logger.warning("resuming from step %d: moved the newer checkpoint folders aside: %s", start, places)


def resume_candidates(run_dir: str | Path | None, resume: str | Path) -> list[CheckpointRef]:
    """The complete checkpoints a run would resume from, newest first, unverified: ``resume`` auto (the
    run dir's own), a step folder (that one) or a run dir (its own); none for ``never``. For looking
    ahead at what a resume will find (its settings, its precision mode); loading verifies and falls
    back past a bad one (:func:`plan_resume`)."""
    if resume == "never" or (resume == "auto" and run_dir is None):
        return []
    source = resume_source(run_dir if resume == "auto" else resume)
    if source.step is not None:
        return [CheckpointRef(source.path, source.step)] if (source.path / keys.COMPLETE_FILE).is_file() else []
    return CheckpointStore(source.path, keep_last=None).complete()[::-1]
