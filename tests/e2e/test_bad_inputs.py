"""Every bad input to ``ampddp train`` / ``inspect``: one line on stderr, exit 2, nothing written.

Most cases call the CLI's ``main`` in-process (fast); a few run ``python -m ampddp`` end to end.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampddp.recipe.build
import ampddp.recipe.checks
import ampddp.recipe.run
import ampddp.rundir.run_dir
from ampddp.checkpoint import keys
from ampddp.cli import EXIT_BROKEN_PIPE, EXIT_NONFINITE, main
from ampddp.distributed.env import DistEnv
from ampddp.errors import NonFiniteGradientsError
from ampddp.precision.modes import build_engine
from ampddp.recipe.reading import load_config, parse_overrides
from ampddp.rundir.run_dir import RunDir
from ampddp.training.progress import Progress
from ampddp.zoo.models import build_model

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def refused(capsys, run_dir: Path, *args: str, recipe: Path = QUICKSTART) -> str:
    """Run ``ampddp train``; assert it was refused with one line and wrote nothing; return the line."""
    code = main(["train", str(recipe), f"trainer.run_dir={run_dir}", *args])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.startswith("ampddp train: error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    return captured.err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.batch_size=0"], "data.batch_size=0 is out of range; it must be an integer >= 1"),
        (["optimizer.lr=-1"], "optimizer.lr=-1.0 is out of range; it must be a finite number in [0, 3.40282e+38]"),
        (["optimizer.momentum=-5"], "optimizer.momentum=-5.0 is out of range; it must be a finite number in [0, 1)"),
        (["data.image_size=0"], "data.image_size=0 is out of range; it must be an integer >= 1"),
        (["model.num_classes=0"], "model.num_classes=0 is out of range; it must be an integer >= 1"),
        (["model.num_classes=5"], "model.num_classes=5 is too small for data.name=digits, which has 10 classes; it must be >= 10"),
        (["data.channels=0"], "data.channels=0 is out of range; it must be an integer >= 1"),
        (["data.image_size=1"], "model.name=small_cnn cannot take data.channels=1 x data.image_size=1 images"),
        (["model.key_map={a: b}"], "model.key_map renames the tensors of safetensors weights; set checkpoint.init_from to"),
        (["model.key_map={'(': b}"], "model.key_map entry '(' is not a regular expression"),
        (  # a meta build (FSDP2) checks its forward on a meta copy
            ["distributed.strategy=fsdp2", "data.image_size=1"],
            "model.name=small_cnn cannot take data.channels=1 x data.image_size=1 images",
        ),
        (["data.eval_fraction=1.5"], "data.eval_fraction=1.5 is out of range; it must be a finite number in (0, 1)"),
        (["trainer.seed=-1"], "trainer.seed=-1 is out of range; it must be an integer in [0, 4294967295]"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 is out of range"),
        (["trainer.clip_grad_norm=0"], "trainer.clip_grad_norm=0.0 is out of range; it must be a finite number in (0, 3.40282e+38]"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last=0 is out of range"),
        (["distributed.nproc_per_node=0"], "distributed.nproc_per_node=0 is out of range"),
        (["optimizer.gamma=0"], "optimizer.gamma=0.0 is out of range; it must be a finite number in (0, 3.40282e+38]"),
        (
            ["precision.mode=O1", "precision.backoff_factor=2"],
            "backoff_factor=2.0 is out of range; it must be a finite number in (0, 1)",
        ),
        (["precision.mode=O1", "precision.growth_factor=.nan"], "precision.growth_factor=nan is not valid; it must be a finite number in"),
        (["optimizer.lr=.nan"], "optimizer.lr=nan is not valid; it must be a finite number in [0, 3.40282e+38]"),
        (["optimizer.lr=.inf"], "optimizer.lr=inf is not valid; it must be a finite number"),
        (["optimizer.lr=inf"], "optimizer.lr=inf is not valid; it must be a finite number"),
        (["optimizer.lr=-.inf"], "optimizer.lr=-inf is not valid"),
        (["distributed.timeout_s=nan"], "distributed.timeout_s=nan is not valid; it must be a finite number in (0, 1000000000]"),
        (["trainer.stop_signals=[SIGKILL]"], "trainer.stop_signals: SIGKILL cannot be caught by a process"),
        (
            ["trainer.stop_signals=[SIGTERM, SIGSTOP]"],
            "SIGSTOP cannot be caught by a process, so it cannot trigger a checkpoint; valid: catchable signals",
        ),
        (["trainer.stop_signals=[SIGNOPE]"], "trainer.stop_signals=['SIGNOPE']: stop signal 'SIGNOPE' is not a signal name"),
        (
            ["precision.mode=O1", "precision.float_functions=[softplus]"],
            "precision.float_functions entry 'softplus' is not a dotted name of a function",
        ),
        (
            ["precision.mode=O1", "precision.float_functions=[torch.float16]"],
            "precision.float_functions entry 'torch.float16' is a dtype, not a function",
        ),
        (
            ["precision.mode=O1", "precision.half_functions=[no_such_module.fn]"],
            "cannot resolve 'no_such_module.fn' in precision.half_functions: no module",
        ),
        (["precision.mode=O1", "precision.promote_functions=[torch.nn.functional.nope]"], "torch.nn.functional has no attribute 'nope'"),
        (
            ["trainer.compile=fast"],
            "trainer.compile='fast' is not valid (did you mean 'false'?); "
            "valid choices: false, true, default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs",
        ),
        (["trainer.compile=max-autotune-no-cudagraph"], "(did you mean 'max-autotune-no-cudagraphs'?); valid choices: false, true,"),
        (["trainer.compile=2"], "trainer.compile=2 has the wrong type; expected bool or str"),
        (["trainer.compile="], "trainer.compile=None has the wrong type; expected bool or str"),
        (
            ["trainer.compile=true", "trainer.compile_backend=inductr"],
            "trainer.compile_backend='inductr' is not a torch.compile backend (did you mean 'inductor'?); valid choices: ",
        ),
    ],
)
def test_bad_values_are_refused_with_one_line_naming_key_and_range(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    line = refused(capsys, run_dir, *overrides)
    assert message in line, line
    assert not run_dir.exists(), "a refused run must not create its run_dir"


RECIPE_CASES = {
    "non-mapping section": (
        b"trainer: 5\n",
        "section 'trainer' must be a mapping of key: value lines, found int 5; valid keys in trainer",
    ),
    "list section": (b"model:\n  - small_cnn\n", "section 'model' must be a mapping of key: value lines, found list"),
    "duplicate key": (
        b"optimizer:\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.2\n",
        "duplicate key 'optimizer.lr' on lines 2 and 4; each key may appear once",
    ),
    "duplicate section": (
        b"model:\n  name: mlp\ndata:\n  channels: 1\nmodel:\n  num_classes: 9\n",
        "duplicate key 'model' on lines 1 and 5;",
    ),
    "not utf-8": (b"# caf\xe9 recipe\nmodel:\n  name: mlp\n", "not UTF-8 text (byte 0xe9 at offset 5); save the recipe as UTF-8"),
    "not a mapping": (b"- model\n- data\n", "a recipe is a mapping of sections"),
    "bad yaml": (b"model:\n  name: [mlp\n", "not valid YAML (line 3, column 1:"),
    "unknown section": (b"modle:\n  name: mlp\n", "unknown section 'modle' (did you mean 'model'?)"),
}


@pytest.mark.parametrize("case", RECIPE_CASES, ids=list(RECIPE_CASES))
def test_bad_recipe_files_are_refused_naming_the_file(tmp_path, capsys, case):
    text, message = RECIPE_CASES[case]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(text)
    line = refused(capsys, tmp_path / "run", recipe=recipe)
    assert f"{recipe}: " in line and message in line, line
    assert not (tmp_path / "run").exists()


def test_a_non_mapping_section_is_refused_even_when_an_override_sets_a_key_of_it(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer: 5\n")
    assert "section 'trainer' must be a mapping" in refused(capsys, tmp_path / "run", "trainer.max_steps=1", recipe=recipe)


def test_an_empty_section_means_defaults(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("precision:\n  mode: O0\ntrainer:\n")
    assert load_config(recipe).trainer.max_epochs == 10


@pytest.mark.parametrize(("text", "value"), [("1e-3", 1e-3), ("1E6", 1e6), (".5", 0.5), ("-2.5e-4", -2.5e-4), ("+3.", 3.0), ("2", 2.0)])
def test_floats_in_every_python_notation_are_read_from_recipes_and_overrides(tmp_path, text, value):
    assert parse_overrides([f"optimizer.lr={text}"])["optimizer"]["lr"] == value  # signed values parse (and are range-checked)
    unsigned = text.lstrip("-+")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"optimizer:\n  weight_decay: {unsigned}\n")
    assert load_config(recipe).optimizer.weight_decay == abs(value)
    assert load_config(QUICKSTART, [f"optimizer.lr={unsigned}"]).optimizer.lr == abs(value)


def test_float_notation_leaves_other_strings_and_ints_alone():
    values = parse_overrides(["model.name=1.2.3", "trainer.seed=7", "data.root=1e", "trainer.run_dir=e5"])
    assert values["model"]["name"] == "1.2.3" and values["trainer"] == {"seed": 7, "run_dir": "e5"} and values["data"]["root"] == "1e"


def test_an_integer_setting_written_as_a_float_is_refused(tmp_path, capsys):
    assert "trainer.max_steps=1000.0 has the wrong type; expected int or null" in refused(capsys, tmp_path / "run", "trainer.max_steps=1e3")


# ---- run_dir ----------------------------------------------------------------------------------


def test_run_dir_that_is_a_file_or_lies_under_one(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert f"trainer.run_dir={blocker} is a file; give a directory" in refused(capsys, blocker)
    assert f"lies under {blocker}, which is a file" in refused(capsys, blocker / "a" / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
        (OSError(errno.ENOSPC, "No space left on device"), "No space"),
    ],
    ids=["read-only", "full-disk"],
)
def test_unwritable_run_dir_is_refused_and_the_folders_made_for_the_check_are_removed(tmp_path, capsys, monkeypatch, error, reason):
    def fail(directory):
        raise error

    monkeypatch.setattr(ampddp.rundir.run_dir, "_write_probe", fail)
    line = refused(capsys, tmp_path / "new" / "run")
    assert f"trainer.run_dir={tmp_path / 'new' / 'run'} is not writable ({reason}" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permission bits do not stop root")
def test_read_only_run_dir_for_real(tmp_path, capsys):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        assert "is not writable (Permission denied)" in refused(capsys, read_only / "run")
    finally:
        read_only.chmod(0o700)


def test_the_write_probe_leaves_nothing_in_an_existing_run_dir(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    refused(capsys, tmp_path, "data.batch_size=0")
    RunDir(str(tmp_path)).probe()
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


# ---- checkpoints to start from ----------------------------------------------------------------


def good_shared() -> dict:
    model = build_model("small_cnn", 10, 1, 16)  # quickstart's model
    return {
        keys.FORMAT: keys.FORMAT_VERSION,
        keys.MODEL: model.state_dict(),
        keys.OPTIMIZER: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict(),
        keys.PRECISION: build_engine("native-bf16").state_dict(),
        keys.PROGRESS: Progress().state_dict(),
        keys.SAMPLER: {"seed": 0, "shuffle": True, "drop_last": False},
        keys.SCHEDULER: None,
        keys.WORLD_SIZE: 1,
    }


def fake_checkpoint(root: Path, shared: object) -> Path:
    """A step folder with an old-style (names only) COMPLETE marker around ``shared``."""
    folder = root / keys.CHECKPOINTS_DIR / keys.STEP_DIR.format(step=1)
    folder.mkdir(parents=True)
    torch.save(shared, folder / keys.SHARED_FILE)
    (folder / keys.COMPLETE_FILE).write_text(json.dumps({"step": 1, "files": [keys.SHARED_FILE]}))
    return folder


BAD_CHECKPOINTS = {
    "not a dict": (lambda: [1, 2], "expected a dict of state, found list", "expected a dict of state, found list"),
    "no model": (lambda: {keys.FORMAT: keys.FORMAT_VERSION}, "no model weights found", "its 'model' entry is missing, expected a dict"),
    "precision a list": (lambda: {**good_shared(), keys.PRECISION: [1]}, None, "its 'precision' entry is a list, expected a dict"),
    "scalers not dicts": (
        lambda: {**good_shared(), keys.PRECISION: {"mode": "native-fp16", "scalers": [1]}},
        None,
        "its 'precision' entry is malformed: scalers[0] must be a dict, got int",
    ),
    "other model": (
        lambda: {**good_shared(), keys.MODEL: build_model("small_cnn", 10, 3, 16).state_dict()},
        "checkpoint is for a different model — shape mismatches: 0.weight (checkpoint 16x3x3x3, model 16x1x3x3)",
        "checkpoint is for a different model",
    ),
    "progress not numbers": (lambda: {**good_shared(), keys.PROGRESS: {"global_step": "x"}}, None, "its 'progress' entry is malformed"),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS, ids=list(BAD_CHECKPOINTS))
def test_bad_checkpoints_to_start_from_are_refused_before_the_run_dir_exists(tmp_path, capsys, case):
    make, init_message, resume_message = BAD_CHECKPOINTS[case]
    folder = fake_checkpoint(tmp_path / "old", make())
    run_dir = tmp_path / "run"
    if init_message is not None:
        line = refused(capsys, run_dir, f"checkpoint.init_from={folder / keys.SHARED_FILE}")
        assert line.startswith("ampddp train: error: checkpoint.init_from: ") and init_message in line, line
    line = refused(capsys, run_dir, f"checkpoint.resume_from={folder}")
    assert line.startswith("ampddp train: error: checkpoint.resume_from: ") and resume_message in line, line
    assert not run_dir.exists()


def test_missing_resume_from_is_refused(tmp_path, capsys):
    line = refused(capsys, tmp_path / "run", f"checkpoint.resume_from={tmp_path / 'nope'}")
    assert "no such checkpoint or run directory" in line and not (tmp_path / "run").exists()


# ---- exit codes and pipes ---------------------------------------------------------------------


def test_non_finite_gradients_get_one_line_and_their_own_exit_code(tmp_path, capsys, monkeypatch):
    def diverge(config, early=None):
        raise NonFiniteGradientsError("the loss was non-finite for 10 consecutive steps\n(first: module 'fc')")

    monkeypatch.setattr(ampddp.recipe.run, "launch", diverge)
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={tmp_path}"]) == EXIT_NONFINITE == 3
    err = capsys.readouterr().err
    assert err == "ampddp train: error: training stopped: the loss was non-finite for 10 consecutive steps (first: module 'fc')\n"


def cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampddp", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(300)
def test_end_to_end_refusals_are_one_line_with_exit_2(tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(QUICKSTART.read_bytes().replace(b"handwritten", b"handwr\xeftten"))
    bad_ckpt = fake_checkpoint(tmp_path / "old", {keys.FORMAT: keys.FORMAT_VERSION})
    for args in (
        [str(recipe)],
        [str(QUICKSTART), "data.batch_size=0"],
        [str(QUICKSTART), f"checkpoint.resume_from={bad_ckpt}"],
    ):
        result = cli("train", *args, f"trainer.run_dir={tmp_path / 'run'}")
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith("ampddp train: error: ") and result.stderr.count("\n") == 1, result.stderr[-2000:]
        assert result.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_a_run_that_overflows_for_good_exits_3_with_the_error_last(tmp_path):
    result = cli(
        "train", str(QUICKSTART), f"trainer.run_dir={tmp_path}", "model.name=mlp", "precision.mode=native-fp16", "optimizer.lr=1e6",
        "trainer.max_nonfinite_losses=2", "trainer.max_steps=50", "data.batch_size=8", "trainer.progress=off",
    )  # fmt: skip
    assert result.returncode == EXIT_NONFINITE, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ampddp train: error: training stopped: the loss was non-finite") and "Traceback" not in result.stderr


def closed_stdout(*args: str) -> tuple[int, str]:
    """Run the CLI with its stdout pipe already closed by the reader (``| head`` that has exited)."""
    process = subprocess.Popen([sys.executable, "-m", "ampddp", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    return process.returncode, err


@pytest.mark.timeout(300)
def test_a_closed_pipe_ends_quietly(tmp_path):
    from resume_helpers import make_trainer

    make_trainer(tmp_path / "run", "O0", max_steps=1).fit()
    for args in (["inspect", str(tmp_path / "run")], ["inspect", str(tmp_path / "run"), "--json"]):
        code, err = closed_stdout(*args)
        assert code == EXIT_BROKEN_PIPE and err == "", (args, err[-2000:])


@pytest.mark.timeout(300)
def test_checkpoints_the_trainer_writes_pass_the_checks(tmp_path):
    small = ["model.name=mlp", "data.image_size=8", "trainer.max_steps=2", "data.batch_size=8", "trainer.progress=off"]
    ampddp.recipe.run.launch(load_config(QUICKSTART, [f"trainer.run_dir={tmp_path / 'first'}", *small]))
    step = tmp_path / "first" / keys.CHECKPOINTS_DIR / keys.STEP_DIR.format(step=2)
    for start in (f"checkpoint.resume_from={step}", f"checkpoint.init_from={step / keys.SHARED_FILE}"):
        built_and_planned(load_config(QUICKSTART, [f"trainer.run_dir={tmp_path / 'second'}", *small, start]))
    good = fake_checkpoint(tmp_path / "fake", good_shared())
    built_and_planned(load_config(QUICKSTART, [f"trainer.run_dir={tmp_path / 'third'}", f"checkpoint.resume_from={good}"]))


def built_and_planned(config) -> None:
    """Check, build and plan the resume of a run in this process, as ``ampddp train`` does, writing nothing."""
    ampddp.recipe.checks.check_recipe(config)
    ampddp.recipe.build.build_run(config, DistEnv())
    assert not Path(config.trainer.run_dir).exists()
