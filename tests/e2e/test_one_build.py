"""A run is built once per process, in order, and checked where each part is used: an image folder is
scanned once, the model initialised once, and a resume checked against the optimizer, scheduler and
engine that train (none built to be thrown away); the result is the same as building them again (the
pinned curves, ``test_golden_curves.py``, hold that too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_folders import make_image_folder

import ampddp.precision.modes
import ampddp.recipe.build
import ampddp.recipe.factories
import ampddp.zoo.data
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import main
from ampddp.distributed.env import DistEnv
from ampddp.recipe.build import build_run
from ampddp.recipe.checks import check_recipe
from ampddp.recipe.factories import build_datasets_from, build_model_from
from ampddp.recipe.reading import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "resnet50-imagefolder-O2.yaml"


def counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[object]:
    """Replace ``owner.name`` with a wrapper that records each call's first argument."""
    calls: list[object] = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def overrides(tmp_path: Path) -> list[str]:
    return [
        f"trainer.run_dir={tmp_path / 'run'}", f"data.root={make_image_folder(tmp_path / 'images')}", "precision.mode=O0",
        "data.image_size=16", "data.batch_size=8", "trainer.max_steps=null", "trainer.max_epochs=1", "optimizer.warmup_steps=1",
        "distributed.nproc_per_node=1", "data.num_workers=0", "data.pin_memory=false", "trainer.progress=lines",
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_an_image_folder_is_scanned_and_the_model_built_once(tmp_path, monkeypatch):
    scans = counting(monkeypatch, ampddp.zoo.data, "find_images")
    models = counting(monkeypatch, ampddp.recipe.factories, "build_model")
    assert main(["train", str(RECIPE), *overrides(tmp_path)]) == 0
    assert [Path(folder).name for folder in scans] == ["train", "val"]  # a warmup in epochs needs the size: built in the checks
    assert len(models) == 1
    assert CheckpointStore(tmp_path / "run").latest().step == 3


@pytest.mark.timeout(300)
def test_a_resume_is_checked_against_the_parts_that_train_and_none_is_built_twice(tmp_path, monkeypatch):
    """The optimizer, scheduler and engine a resumed run's checkpoint is checked against are the ones
    that train: one of each per run, the checkpoint's shared file read once, the model built once."""
    no_warmup = [*overrides(tmp_path), "optimizer.warmup_steps=0", "optimizer.scheduler=step"]  # extends on resume
    assert main(["train", str(RECIPE), *no_warmup]) == 0
    optimizers = counting(monkeypatch, torch.optim.SGD, "__init__")
    schedulers = counting(monkeypatch, ampddp.recipe.factories, "lr_scheduler")
    engines = counting(monkeypatch, ampddp.precision.modes.ModeSpec, "build_engine")
    models = counting(monkeypatch, ampddp.recipe.factories, "build_model")
    reads = counting(monkeypatch, CheckpointStore, "load_shared")
    assert main(["train", str(RECIPE), *no_warmup, "trainer.max_epochs=2"]) == 0
    assert (len(optimizers), len(schedulers), len(engines), len(models), len(reads)) == (1, 1, 1, 1, 1)
    assert CheckpointStore(tmp_path / "run").latest().step == 6


def test_the_built_run_is_what_a_fresh_build_gives_and_writes_nothing(tmp_path):
    config = load_config(RECIPE, overrides(tmp_path))
    check_recipe(config)
    trainer = build_run(config, DistEnv())
    torch.manual_seed(config.trainer.seed)
    fresh = build_model_from(config)
    assert trainer.run.module.training
    assert all(torch.equal(a, b) for a, b in zip(trainer.run.module.state_dict().values(), fresh.state_dict().values()))
    train_set, _ = build_datasets_from(config, augment=config.data.augment)
    assert trainer.train_set.samples == train_set.samples
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_a_spawning_parent_checks_and_claims_but_builds_nothing(tmp_path, monkeypatch):
    """Under distributed.nproc_per_node > 1 each worker builds its run; the parent only checks the
    values and holds the run dir (the workers' builds are in other processes: not counted here)."""
    quickstart = ROOT / "recipes" / "quickstart.yaml"
    models = counting(monkeypatch, ampddp.recipe.factories, "build_model")
    scans = counting(monkeypatch, ampddp.recipe.build, "build_datasets_from")
    small = ["model.name=mlp", "data.image_size=8", "data.batch_size=16", "trainer.max_steps=2", "precision.mode=O0",
             "distributed.nproc_per_node=2", "distributed.device=cpu", "trainer.progress=off"]  # fmt: skip
    assert main(["train", str(quickstart), *small, f"trainer.run_dir={tmp_path / 'run'}"]) == 0
    assert (models, scans) == ([], [])
    assert CheckpointStore(tmp_path / "run").latest().step == 2
