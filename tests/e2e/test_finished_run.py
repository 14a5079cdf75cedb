"""``ampddp train`` of a run that has already finished answers from its files before torch is
imported, exactly as the full start would; anything it cannot vouch for goes the full way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampddp.checkpoint import keys
from ampddp.cli import main
from ampddp.errors import ConfigError
from ampddp.recipe.finished import finished_run_summary
from ampddp.recipe.reading import load_config
from ampddp.rundir.lock import RunDirLock

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "quickstart.yaml")
SHORT = ["trainer.max_steps=2", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=lines"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", RECIPE, f"trainer.run_dir={run_dir}", *SHORT]) == 0
    return run_dir


def copy_of(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


def config_for(run_dir: Path, *overrides: str):
    return load_config(RECIPE, [f"trainer.run_dir={run_dir}", *SHORT, *overrides])


def newest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / keys.CHECKPOINTS_DIR).glob("step-*"))[-1]


@pytest.mark.timeout(300)
def test_a_finished_run_answers_without_torch_what_the_full_start_reports(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    program = (
        "import json, sys\n"
        "from ampddp.cli import main\n"
        f"code = main(['train', {RECIPE!r}, 'trainer.run_dir={run_dir}', *{SHORT!r}])\n"
        "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed, outcome = done.stdout.rsplit("\n{", 1)[0], json.loads("{" + done.stdout.rsplit("\n{", 1)[1])
    assert outcome == {"code": 0, "torch": False}
    assert "already complete at step 2 (epoch 0): nothing to train" in done.stderr
    from ampddp.recipe.run import launch

    full = launch(config_for(run_dir))  # the full start, for comparison
    assert json.loads(printed) == full and full["already_complete"] is True


@pytest.mark.parametrize(
    "overrides",
    [["optimizer.lr=0.07"], ["trainer.max_steps=3"], ["checkpoint.resume=never"], ["distributed.nproc_per_node=2"]],
    ids=["changed-setting", "longer-horizon", "resume-never", "other-world-size"],
)
def test_a_start_that_differs_from_the_finished_run_goes_the_full_way(finished, overrides):
    assert finished_run_summary(config_for(finished, *overrides), environ={}) is None


def test_under_a_launcher_every_rank_goes_the_full_way(finished):
    assert finished_run_summary(config_for(finished), environ={}) is not None
    assert finished_run_summary(config_for(finished), environ={"WORLD_SIZE": "1", "RANK": "0"}) is None


def test_a_checkpoint_that_does_not_verify_goes_the_full_way(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    shared = newest_checkpoint(run_dir) / keys.SHARED_FILE
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    assert finished_run_summary(config_for(run_dir), environ={}) is None


def test_a_manifest_written_before_the_run_facts_goes_the_full_way(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    marker = newest_checkpoint(run_dir) / keys.COMPLETE_FILE
    content = json.loads(marker.read_text())
    del content["run"]
    marker.write_text(json.dumps(content))
    assert finished_run_summary(config_for(run_dir), environ={}) is None


def test_a_run_dir_in_use_is_refused_as_the_full_start_refuses_it(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    with RunDirLock(run_dir), pytest.raises(ConfigError, match="is in use by another ampddp run"):
        finished_run_summary(config_for(run_dir), environ={})
