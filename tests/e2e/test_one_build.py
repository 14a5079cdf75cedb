"""A run is built once per process: what ``validate`` built to check it (the data sets, the model)
is what trains, so an image folder is scanned once and the model initialised once, and the result
is the same as building them again (the pinned curves, ``test_golden_curves.py``, hold that too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_folders import make_image_folder

import ampddp.recipe.factories
import ampddp.zoo.data
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import main
from ampddp.recipe.checks import validate
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


def test_the_validated_parts_are_those_training_would_build(tmp_path):
    config = load_config(RECIPE, overrides(tmp_path))
    built = validate(config)
    torch.manual_seed(config.trainer.seed)
    fresh = build_model_from(config)
    assert built.model is not None and built.model.training
    assert all(torch.equal(a, b) for a, b in zip(built.model.state_dict().values(), fresh.state_dict().values()))
    train_set, eval_set = build_datasets_from(config, augment=config.data.augment)
    assert built.datasets is not None and [len(part) for part in built.datasets] == [len(train_set), len(eval_set)]
    assert built.datasets[0].samples == train_set.samples
