"""Where a run keeps its checkpoints, how many, and where it starts from: one object for the Trainer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampddp.checkpoint.safetensors_weights import SafetensorsWeights
from ampddp.checkpoint.store import CheckpointStore, check_keep_last
from ampddp.choices import CHECKPOINT_LAYOUTS
from ampddp.errors import ConfigError, choice_error
from ampddp.rundir.paths import expand_path, refuse_tilde_folder
from ampddp.rundir.run_dir import RunDir
from ampddp.training.checkpointer import RESUME_CHOICES, check_resume_choice


@dataclass(frozen=True)
class CheckpointSettings:
    """``run_dir``: where checkpoints (and the run's logs) go; None writes none. ``keep_last``: complete
    checkpoints retention keeps (None: all). ``resume``: ``"auto"`` (the newest checkpoint in
    ``run_dir`` that verifies), ``"never"``, or the path of a checkpoint or run dir. ``init_from``: a
    checkpoint or weights file whose model weights the run starts from (nothing else is taken): an
    ampddp checkpoint or run dir, a torch state dict, or safetensors (a file, a folder of them, or a
    ``SafetensorsWeights`` with a key map), which a sharded model built on the meta device reads
    slice by slice.
    ``config``: the run's settings, saved with every checkpoint and compared on resume. ``layout``:
    ``"whole"`` (one shared file of whole tensors), ``"sharded"`` (every rank writes its own shards)
    or ``"auto"`` (sharded when FSDP2 shards the model); every layout resumes under any strategy and
    world size. ``~`` and ``$VARS`` in the paths are expanded (a run dir with a folder named ``~`` is refused).

    Checked when made, so a bad value is refused before any part of the run is built.
    """

    run_dir: str | Path | None = None
    keep_last: int | None = 3
    resume: str | Path = "auto"
    init_from: str | Path | SafetensorsWeights | None = None
    config: Mapping[str, Any] | None = field(default=None, compare=False)
    layout: str = "auto"

    def __post_init__(self) -> None:
        for name in ("run_dir", "init_from"):
            value = getattr(self, name)
            if isinstance(value, SafetensorsWeights):
                continue
            if value is not None and not isinstance(value, (str, Path)):
                raise ConfigError(f"{name}={value!r} is not valid; it must be a path (str or pathlib.Path) or None")
            if value is not None:
                object.__setattr__(self, name, expand_path(value, name))
        if self.run_dir is not None:
            refuse_tilde_folder(self.run_dir, "run_dir")
        if isinstance(self.resume, (str, Path)) and str(self.resume) not in RESUME_CHOICES:
            object.__setattr__(self, "resume", expand_path(self.resume, "resume"))
        if self.layout not in CHECKPOINT_LAYOUTS:
            raise choice_error("checkpoint layout", self.layout, CHECKPOINT_LAYOUTS)
        check_keep_last(self.keep_last)
        check_resume_choice(self.resume)
        if self.config is not None and not isinstance(self.config, Mapping):
            raise ConfigError(f"config must be a dict of the run's settings, got {type(self.config).__name__}")

    def place(self) -> RunDir | None:
        """The run dir as one value (None without a run_dir): made once per run and handed to the
        store and the observer."""
        return None if self.run_dir is None else RunDir(self.run_dir)

    def store(self, place: RunDir | None = None) -> CheckpointStore | None:
        """The run's checkpoint store in ``place`` (default: a new value of run_dir; None without one)."""
        if place is None and self.run_dir is None:
            return None
        return CheckpointStore(place if place is not None else self.run_dir, self.keep_last)
