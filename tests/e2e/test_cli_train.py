"""``ampddp train``: recipe parsing and rejection, end-to-end runs of every recipe, launchers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HAS_TORCHAO, NO_TORCHAO
from image_folders import make_image_folder

from ampddp import PRECISION_MODES
from ampddp.checkpoint.store import CheckpointStore
from ampddp.cli import main
from ampddp.distributed import free_port
from ampddp.observe import read_metrics
from ampddp.recipe.reading import load_config
from ampddp.rundir.files import PLOT_FILES

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
FAST = ["trainer.max_steps=2", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.log_every_steps=1", "trainer.progress=lines"]
BF16_MODES = ("O4", "O5", "native-bf16")
IMAGEFOLDER_ON_CPU = ["distributed.nproc_per_node=1", "data.num_workers=0", "data.pin_memory=false", "optimizer.warmup_steps=1"]
"""An imagefolder recipe (written for 8 GPUs) on 2 CPU cores: a generated folder of small JPEGs, one
process loading on its own thread (tests/e2e/test_imagefolder_run.py runs the workers), a warmup
shorter than the 2 steps."""


def small_images(mode: str) -> str:
    """16 px keeps the fp16 ResNet runs fast on CPU; bf16 runs take 32 px because oneDNN's bf16
    weight gradient of a 3x3 stride-2 convolution over a 1x1 map (ResNet-18's layer4 at 16 px) is
    garbage on CPU (torch 2.14; the non-oneDNN kernel is right), which the save refusal then reports."""
    return f"data.image_size={32 if mode in BF16_MODES else 16}"


def test_every_recipe_starts_with_the_command_that_runs_it():
    assert len(RECIPES) >= 11
    for recipe in RECIPES:
        first = recipe.read_text().splitlines()[0]
        assert first.startswith("# ampddp train recipes/") and recipe.name in first, recipe
        load_config(recipe)


def test_resnet_recipes_differ_only_in_precision():
    # O6 converts linear layers to fp8, and ResNet-18's one linear layer is its head: its recipe is a GPT's.
    per_mode = [ROOT / "recipes" / f"resnet18-{mode}.yaml" for mode in PRECISION_MODES if mode != "O6"]
    assert all(recipe in RECIPES for recipe in per_mode)
    configs = [load_config(r).to_dict() for r in per_mode]
    for config in configs:
        config.pop("precision")
        config["trainer"].pop("run_dir")
    assert all(config == configs[0] for config in configs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision.mode=O7"], "precision.mode='O7' is not valid (did you mean 'O6'?); valid choices: auto, O0, O1"),
        (["precision.mode=native-bf16", "precision.fp8_recipe=tensorwise"], "precision.fp8_recipe applies to opt level O6 (fp8 matmuls)"),
        (["precision.mode=O4", "precision.fp8_min_size=64"], "fp8_min_size applies to opt level O6 (fp8 matmuls), not to O4"),
        (["precision.keep_bn_fp32=true"], "unknown key precision.keep_bn_fp32 (did you mean 'keep_batchnorm_fp32'?)"),
        (["trainer.max_epoch=3"], "did you mean 'max_epochs'"),
        (["trainr.max_epochs=3"], "unknown section 'trainr' (did you mean 'trainer'?)"),
        (["trainer.max_epochs=three"], "trainer.max_epochs='three' has the wrong type; expected int"),
        (["distributed.strategy=horovod"], "valid choices: ddp, apex-ddp, fsdp2, hsdp, dp, none"),
        (["distributed.sync_bn=yes"], "distributed.sync_bn=True has the wrong type"),
        (["precision.mode=O1", "precision.cast_model_type=fp16"], "cast_model_type=float16 is not valid with opt_level O1"),
        (["precision.mode=native-bf16", "precision.keep_batchnorm_fp32=true"], "precision.keep_batchnorm_fp32 applies to the O0-O6"),
        (["precision.mode=O1", "precision.loss_scale=huge"], "loss_scale='huge'"),
        (["precision.loss_scale=128"], "precision.mode is auto (the default), which picks a mode per device, so precision.loss_scale"),
        (["precision.mode=O1", "precision.float_functions=[torch.not_a_function]"], "torch has no attribute 'not_a_function'"),
        (["model.name=resnet81"], "did you mean 'resnet18'"),
        (["data.name=cifar10"], "data.name=cifar10 needs data.root"),
        (
            ["data.name=imagefolder", "data.root=/nonexistent/images"],
            "data.root=/nonexistent/images: no such directory; imagefolder expects ROOT/train",
        ),
        (["trainer.max_epochs"], "not of the form section.key=value"),
    ],
)
def test_bad_settings_are_rejected_before_any_work_with_one_line(tmp_path, capsys, overrides, message):
    code = main(["train", str(ROOT / "recipes" / "quickstart.yaml"), f"trainer.run_dir={tmp_path}", *overrides])
    error = capsys.readouterr().err
    assert code == 2
    assert message in error, error
    assert error.count("\n") == 1 and "Traceback" not in error
    assert not any(tmp_path.iterdir()), "nothing may be written for a rejected run"


def test_missing_recipe_and_cifar_layout_errors(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "no such recipe file" in capsys.readouterr().err
    (tmp_path / "cifar").mkdir()
    assert (
        main(
            [
                "train",
                str(ROOT / "recipes" / "quickstart.yaml"),
                "data.name=cifar10",
                f"data.root={tmp_path / 'cifar'}",
                f"trainer.run_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    assert "cifar-10-batches-py" in capsys.readouterr().err


def check_run_dir(run_dir: Path, steps: int = 2) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert train and {"step", "epoch", "loss", "lr", "loss_scale", "skipped_steps", "grad_norm", "samples_per_s", "world_size"} <= set(
        train[0]
    )
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and evals[-1]["step"] == steps and evals[-1]["samples"] > 0
    assert summary["steps"] == steps and summary["final_eval_accuracy"] == evals[-1]["accuracy"]
    assert summary["best_eval_accuracy"] == max(r["accuracy"] for r in evals)
    scale_varied = len({r["loss_scale"] for r in train}) > 1 or any(r["skipped"] for r in train)
    for name in PLOT_FILES:
        if name == "loss_scale.png" and not scale_varied:
            assert not (run_dir / name).exists(), "a loss scale that never changed gets no plot"
            continue
        assert (run_dir / name).stat().st_size > 1000
    assert CheckpointStore(run_dir).latest().step == steps
    return summary


@pytest.mark.timeout(360)
@pytest.mark.parametrize("recipe", [r for r in RECIPES if "ddp" not in r.stem], ids=lambda p: p.stem)
def test_each_recipe_runs_end_to_end(tmp_path, recipe):
    config = load_config(recipe)
    if config.precision.mode == "O6" and not HAS_TORCHAO:
        pytest.skip(NO_TORCHAO)
    data = [f"data.root={make_image_folder(tmp_path / 'images')}", *IMAGEFOLDER_ON_CPU] if config.data.name == "imagefolder" else []
    if config.model.name == "ampddp.zoo.models:gpt":
        data = ["optimizer.warmup_steps=1"]  # the GPT recipes (FSDP2's 2 processes stay), a warmup shorter than the 2 steps
    if config.precision.mode == "O6":  # emulated fp8 backward takes ~40 s a step of the recipe's batch on some CPUs: a few tokens
        data += ["data.kwargs={sequence_length: 16, eval_fraction: 0.002}", "data.batch_size=2"]
    result = subprocess.run(
        [sys.executable, "-m", "ampddp", "train", str(recipe), f"trainer.run_dir={tmp_path / 'run'}",
         small_images(config.precision.mode), *FAST, *data],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    check_run_dir(tmp_path / "run")
    if config.precision.mode == "O6":  # the verdict on each linear layer is part of the run's record
        (plan,) = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "fp8_layers"]
        assert (
            plan["in_fp8"] == 23
            and len(plan["layers"]) == 25
            and "O6: 23 of 25 linear layer(s) in fp8 (rowwise scaling)" in result.stdout + result.stderr
        )


@pytest.mark.timeout(360)
@pytest.mark.smoke
def test_two_processes_via_nproc_per_node_with_sync_bn(tmp_path):
    recipe = ROOT / "recipes" / "resnet18-O2-ddp-syncbn.yaml"
    command = [
        sys.executable,
        "-m",
        "ampddp",
        "train",
        str(recipe),
        f"trainer.run_dir={tmp_path}",
        "precision.mode=O5",
        small_images("O5"),
    ]
    result = subprocess.run([*command, *FAST], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_run_dir(tmp_path)["world_size"] == 2


@pytest.mark.timeout(360)
@pytest.mark.smoke
def test_the_same_command_under_torchrun(tmp_path):
    recipe = ROOT / "recipes" / "quickstart.yaml"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "ampddp", "train", str(recipe), f"trainer.run_dir={tmp_path}", "distributed.sync_bn=auto", *FAST]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_run_dir(tmp_path)["world_size"] == 2
    assert result.stdout.count('"final_eval_accuracy"') == 1, "one summary per run, printed by rank 0"


@pytest.mark.timeout(600)
def test_a_two_rank_fsdp2_run_resumes_on_one_process_with_the_same_strategy(tmp_path):
    """FSDP2 on one process is a mesh of one rank (ampddp train makes its process group): the same
    command, with nproc_per_node=1 and the same global batch, continues the 2-rank sharded checkpoint."""
    common = [sys.executable, "-m", "ampddp", "train", str(ROOT / "recipes" / "gpt-fsdp2.yaml"), f"trainer.run_dir={tmp_path}",
              "trainer.log_every_steps=1", "trainer.progress=lines", "optimizer.scheduler=none", "optimizer.warmup_steps=0",
              "checkpoint.every_steps=2", "data.kwargs={sequence_length: 32, eval_fraction: 0.002}"]  # fmt: skip
    two = subprocess.run([*common, "trainer.max_steps=2", "distributed.nproc_per_node=2", "data.batch_size=8"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([*common, "trainer.max_steps=4", "distributed.nproc_per_node=1", "data.batch_size=16"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    assert "FSDP2 over 1 rank(s)" in one.stderr and f"resumed from {tmp_path / 'checkpoints' / 'step-000000002'} at step 2" in one.stderr
    assert [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "train"] == [1, 2, 3, 4]
    latest = CheckpointStore(tmp_path).latest()
    assert latest.step == 4 and json.loads((latest.path / "COMPLETE").read_text())["world_size"] == 1
    # Its export starts a new 2-rank run from the meta device: each rank reads only its shards' slices.
    exported = subprocess.run([sys.executable, "-m", "ampddp", "export", str(tmp_path), "--to", str(tmp_path / "w.safetensors")],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    started = subprocess.run([*common[:5], f"trainer.run_dir={tmp_path / 'new'}", *common[6:], "trainer.max_steps=1",
                              "distributed.nproc_per_node=2", "data.batch_size=8", f"checkpoint.init_from={tmp_path / 'w.safetensors'}"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    assert f"weights from {tmp_path / 'w.safetensors'}: 60 tensors, each rank reading the slices it holds" in started.stderr
