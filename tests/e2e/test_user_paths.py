"""Path settings as a shell would have given them: ``~`` and ``$VARS`` expanded, a folder named ``~`` refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from image_folders import make_image_folder

from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import main
from ampddp.errors import ConfigError
from ampddp.recipe.factories import data_root
from ampddp.recipe.reading import load_config
from ampddp.training import CheckpointSettings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SHORT = ["trainer.max_steps=2", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=off", "observe.plots=false"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("AMPDDP_TEST_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    return folder


def test_every_path_setting_expands_home_and_variables(home, tmp_path):
    config = load_config(None, [
        "trainer.run_dir=~/runs/q", "data.root=$AMPDDP_TEST_DATA/cifar",
        "checkpoint.init_from=${AMPDDP_TEST_DATA}/w.pt", "checkpoint.resume_from=~/runs/old",
    ])  # fmt: skip
    assert config.trainer.run_dir == str(home / "runs" / "q")
    assert config.data.root == "$AMPDDP_TEST_DATA/cifar", "kept as written: a checkpoint compares it so"
    assert data_root(config) == str(tmp_path / "data" / "cifar")
    assert config.checkpoint.init_from == str(tmp_path / "data" / "w.pt")
    assert config.checkpoint.resume_from == str(home / "runs" / "old")


def test_a_run_dir_starting_with_tilde_trains_in_the_home_folder_and_makes_no_tilde_folder(home, tmp_path):
    assert main(["train", str(QUICKSTART), "trainer.run_dir=~/runs/q", *SHORT]) == 0
    assert (home / "runs" / "q" / "checkpoints").is_dir()
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("$AMPDDP_NOT_SET_ANYWHERE/run", "names $AMPDDP_NOT_SET_ANYWHERE, which is not set in the environment"),
        ("~no_such_user_for_ampddp/run", "~no_such_user_for_ampddp is not a home folder here"),
        ("runs/~/q", "has a folder named '~', which would be created as such"),
    ],
)
def test_paths_that_cannot_mean_what_was_meant_are_refused_and_nothing_is_written(home, tmp_path, capsys, value, message):
    before = sorted(tmp_path.rglob("*"))
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={value}", *SHORT]) == 2
    error = capsys.readouterr().err
    assert error.startswith("ampddp train: error: trainer.run_dir=") and message in error, error
    assert sorted(tmp_path.rglob("*")) == before


def test_the_library_checkpoint_settings_expand_paths_too(home):
    settings = CheckpointSettings(run_dir="~/runs/lib", init_from="$AMPDDP_TEST_DATA/w.pt")
    assert settings.run_dir == str(home / "runs" / "lib")
    assert settings.init_from.endswith("data/w.pt") and "$" not in settings.init_from
    with pytest.raises(ConfigError, match="folder named '~'"):
        CheckpointSettings(run_dir="runs/~")


@pytest.mark.timeout(300)
def test_a_requeued_job_whose_data_variable_moved_resumes_as_the_same_run(home, tmp_path, monkeypatch):
    first, second = make_image_folder(tmp_path / "node-a" / "images"), tmp_path / "node-b" / "images"
    shutil.copytree(first, second)
    run = ["train", str(QUICKSTART), f"trainer.run_dir={tmp_path / 'run'}", "data.name=imagefolder", "data.root=$JOB_TMP/images",
           "data.image_size=16", "data.channels=3", "data.batch_size=8", "precision.mode=O0", "optimizer.scheduler=none",
           "trainer.progress=off", "observe.plots=false", "data.num_workers=0", "distributed.nproc_per_node=1",
           "checkpoint.every_steps=1"]  # fmt: skip
    monkeypatch.setenv("JOB_TMP", str(tmp_path / "node-a"))
    assert main([*run, "trainer.max_steps=2"]) == 0
    monkeypatch.setenv("JOB_TMP", str(tmp_path / "node-b"))
    assert main([*run, "trainer.max_steps=3"]) == 0
    assert CheckpointStore(tmp_path / "run").latest().step == 3
