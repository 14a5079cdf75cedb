"""The checks of a recipe that need only the file system, made before torch loads.

A missing data.root, a run dir that is a file, a checkpoint to resume from that does not exist: each
is a one-line answer the user should get in a second, not after the imports of torch and the checks
that need it (a minute on a loaded machine). ``ampddp train`` runs these first; ``check_recipe``
runs them too, for a launch from Python. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from ampddp.choices import CIFAR_LAYOUT, IMAGEFOLDER_LAYOUT
from ampddp.config import RunConfig, is_import_path
from ampddp.errors import CheckpointError, ConfigError
from ampddp.rundir.paths import expand_path, refuse_long_names, refuse_tilde_folder
from ampddp.rundir.run_dir import RunDir


def check_paths(config: RunConfig) -> None:
    """The run dir can be a directory, a built-in data set's data.root has its layout, and
    checkpoint.resume_from exists; reads only."""
    refuse_tilde_folder(config.trainer.run_dir, "trainer.run_dir")
    RunDir(config.trainer.run_dir, "trainer.run_dir").folders_to_make()
    if not is_import_path(config.data.name):
        check_data_root(config)
    resume_from = config.checkpoint.resume_from
    if resume_from is not None:
        refuse_long_names(resume_from, "checkpoint.resume_from")
        if not Path(resume_from).exists():
            raise CheckpointError(f"checkpoint.resume_from={resume_from}: no such checkpoint or run directory")


def check_data_root(config: RunConfig) -> None:
    """data.root of cifar10 and imagefolder: given, a directory, with the folders each expects."""
    data = config.data
    if data.name == "digits":
        return
    layout = CIFAR_LAYOUT if data.name == "cifar10" else IMAGEFOLDER_LAYOUT
    if data.root is None:
        raise ConfigError(f"data.name={data.name} needs data.root (ampddp never downloads data); expected layout: {layout}")
    root = Path(expand_path(data.root, "data.root"))
    if not root.is_dir():
        raise ConfigError(f"data.root={data.root}: no such directory; {data.name} expects {layout}")
    if data.name == "cifar10" and not (root / "cifar-10-batches-py").is_dir():
        raise ConfigError(f"data.root={data.root}: no cifar-10-batches-py folder inside; expected {CIFAR_LAYOUT} (ampddp never downloads)")
    for split in ("train", "val") if data.name == "imagefolder" else ():
        if not (root / split).is_dir():
            raise ConfigError(f"data.root={data.root}: missing {split}/ folder; expected {IMAGEFOLDER_LAYOUT}")
