"""Recipes name user models and data sets by import path, optimizers by name, LR warmup + schedules,
and torch DDP's options; each bad one is one line (exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch.optim import lr_scheduler as torch_schedulers

from ampddp import Parallel
from ampddp.apex.optimizers import FusedLAMB
from ampddp.checkpoint import keys
from ampddp.choices import SYNC_BN_CHOICES
from ampddp.cli import main
from ampddp.config import DistributedConfig
from ampddp.distributed import DDPOptions, launch_local
from ampddp.distributed.sync_bn import resolve_sync_bn
from ampddp.errors import ConfigError
from ampddp.prepare import prepare
from ampddp.recipe.factories import ddp_options, optimizer_factory, scheduler_factory
from ampddp.recipe.reading import load_config

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SMALL = ["data.image_size=8", "data.batch_size=16", "trainer.progress=off", "trainer.log_every_steps=1"]
USER_MODEL = ["model.name=user_parts:build", "model.kwargs={hidden: 8}"]
USER_DATA = ["data.name=user_parts:blobs", "model.name=user_parts:build", "model.num_classes=3", "model.kwargs={in_features: 8, hidden: 8}"]


def train(run_dir: Path, *overrides: str) -> dict:
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={run_dir}", *SMALL, *overrides]) == 0
    return json.loads((run_dir / "summary.json").read_text())


def refused(capsys, run_dir: Path, *overrides: str) -> str:
    code = main(["train", str(QUICKSTART), f"trainer.run_dir={run_dir}", *SMALL, *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ampddp train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not run_dir.exists(), "nothing may be written for a refused run"
    return err


def lrs(run_dir: Path) -> dict[int, float]:
    """The lr logged at each step (the last record of a step a resumed run trained again)."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record["lr"] for record in records if record["kind"] == "train"}


# ---- user models and data sets by import path --------------------------------------------------


def test_a_recipe_names_a_user_model_by_import_path_and_trains(tmp_path):
    summary = train(tmp_path / "run", *USER_MODEL, "trainer.max_steps=3")
    assert summary["steps"] == 3 and summary["final_eval_accuracy"] is not None
    state = torch.load(tmp_path / "run" / keys.CHECKPOINTS_DIR / keys.STEP_DIR.format(step=3) / keys.SHARED_FILE, weights_only=True)
    assert state[keys.MODEL]["1.weight"].shape == (8, 64), "model.kwargs (hidden=8) reached the user's function"


def test_a_user_model_on_a_user_data_set_without_eval_split(tmp_path):
    summary = train(tmp_path / "run", *USER_DATA, "data.kwargs={with_eval: false}", "trainer.max_steps=2")
    assert summary["steps"] == 2 and summary["final_eval_accuracy"] is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.name=no_such_pkg_zz.models:build"], "model.name='no_such_pkg_zz.models:build': no module named 'no_such_pkg_zz'"),
        (
            ["model.name=user_parts:biuld"],
            "user_parts has no attribute 'biuld' (did you mean 'build'?); write it as package.module:function",
        ),
        (["model.name=user_parts:NOT_CALLABLE"], "model.name='user_parts:NOT_CALLABLE' names a int, which is not callable"),
        (["model.name=user parts:build"], "model.name='user parts:build' is not of the form package.module:function"),
        (["model.name=user_parts:build", "model.kwargs={depth: 3}"], "calling it with (num_classes=10, depth=3) failed (TypeError"),
        (["model.name=user_parts:build", "model.kwargs={num_classes: 3}"], "model.kwargs sets num_classes; set model.num_classes"),
        (["model.kwargs={hidden: 8}"], "model.kwargs={'hidden': 8} applies to a model named as package.module:function"),
        (["model.name=user_parts:build", "model.kwargs={in_features: 3}"], "model.name=user_parts:build cannot take data.channels=1"),
        (["model.name=user_parts:build", "model.num_classes=3"], "model.num_classes=3 is too small for data.name=digits"),
        (["data.name=user_parts:not_a_pair"], "data.name='user_parts:not_a_pair' returned a TensorDataset, expected a pair"),
        (
            ["data.name=digitz"],
            "data.name='digitz' is not valid (did you mean 'digits'?); valid choices: digits, cifar10, imagefolder, or ",
        ),
        (["data.kwargs={samples: 3}"], "data.kwargs={'samples': 3} applies to a data set named as package.module:function"),
        (["optimizer.name=rmsprob"], "optimizer.name='rmsprob' is not valid (did you mean 'RMSprop'?); valid: sgd, adam, adamw, lamb"),
        (["optimizer.name=lamb", "optimizer.fused=true"], "optimizer.fused=true: FusedLAMB has no fused flag"),
        (["optimizer.name=LBFGS", "optimizer.foreach=false"], "optimizer.foreach=false: LBFGS has no foreach flag"),
        (["optimizer.fused=true", "optimizer.foreach=true"], "optimizer.name=sgd: `fused` and `foreach` cannot be `True` together"),
        (["optimizer.kwargs={lr: 1}"], "optimizer.kwargs sets lr; set optimizer.lr instead"),
        (
            ["optimizer.name=adam", "optimizer.kwargs={betaz: [0.9, 0.99]}"],
            "optimizer.kwargs.betaz is not an argument of Adam (did you mean 'betas'?)",
        ),
        (["optimizer.warmup_steps=5", "trainer.max_steps=5"], "optimizer.warmup_steps=5 is not below trainer.max_steps=5"),
        (
            ["optimizer.warmup_steps=500", "trainer.max_epochs=2", "data.batch_size=64"],
            "optimizer.warmup_steps=500 is not below the run's 44 steps (trainer.max_steps, or trainer.max_epochs x steps per epoch)",
        ),
        (["data.num_workers=-1"], "data.num_workers=-1 is out of range; it must be an integer in [0, 1024]"),
        (["data.num_workers=two"], "data.num_workers='two' has the wrong type; expected int"),
        (["data.prefetch_factor=4"], "data.prefetch_factor=4 needs worker processes; set data.num_workers >= 1 or leave it null"),
        (["optimizer.warmup_start_factor=0"], "optimizer.warmup_start_factor=0.0 is out of range; it must be a finite number in (0, 1]"),
        (["optimizer.scheduler=exp"], "valid choices: none, cosine, step, linear"),
        (["distributed.comm_hook=fp8"], "distributed.comm_hook='fp8' is not valid (did you mean 'fp16'?); valid choices: none, fp16, bf16"),
        (
            ["distributed.bucket_cap_mb=0"],
            "distributed.bucket_cap_mb=0.0 is out of range; it must be a finite number in (0, 1099511627776]",
        ),
        (["distributed.static_graph=maybe"], "distributed.static_graph='maybe' has the wrong type; expected bool"),
        (
            ["distributed.strategy=none", "distributed.find_unused_parameters=true"],
            "distributed.find_unused_parameters=True: torch DDP settings, but distributed.strategy=none",
        ),
    ],
)
def test_bad_parts_are_refused_with_one_line(tmp_path, capsys, overrides, message):
    assert message in refused(capsys, tmp_path / "run", *overrides)


@pytest.mark.timeout(300)
def test_a_bad_import_path_end_to_end_is_one_line_exit_2_and_writes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "ampddp", "train", str(QUICKSTART), f"trainer.run_dir={tmp_path / 'run'}", "model.name=user_parts:nope"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("ampddp train: error: model.name='user_parts:nope': user_parts has no attribute 'nope'")
    assert result.stderr.count("\n") == 1 and result.stdout == "" and not (tmp_path / "run").exists()


# ---- optimizers by name -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "cls", "expected"),
    [
        (["optimizer.name=sgd"], torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}),
        (["optimizer.name=adamw"], torch.optim.AdamW, {"lr": 0.1, "weight_decay": 5e-4}),
        (["optimizer.name=adam", "optimizer.fused=true", "optimizer.kwargs={betas: [0.8, 0.9]}"], torch.optim.Adam, {"fused": True}),
        (["optimizer.name=lamb", "optimizer.lr=0.01"], FusedLAMB, {"lr": 0.01, "weight_decay": 5e-4}),
        (
            ["optimizer.name=RMSprop", "optimizer.foreach=false", "optimizer.kwargs={momentum: 0.5}"],
            torch.optim.RMSprop,
            {"foreach": False, "momentum": 0.5},
        ),
        (["optimizer.name=torch.optim.NAdam"], torch.optim.NAdam, {"lr": 0.1}),
        (["optimizer.name=Rprop"], torch.optim.Rprop, {"lr": 0.1}),  # takes no weight_decay: not passed
    ],
)
def test_optimizers_by_name(overrides, cls, expected):
    optimizer = optimizer_factory(load_config(None, overrides))(make_mlp().parameters())
    assert type(optimizer) is cls
    assert {key: optimizer.defaults[key] for key in expected} == expected
    if cls is torch.optim.Adam:
        assert list(optimizer.defaults["betas"]) == [0.8, 0.9]


def test_a_fused_optimizer_trains(tmp_path):
    assert train(tmp_path / "run", "optimizer.name=adamw", "optimizer.fused=true", "optimizer.lr=0.01", "trainer.max_steps=2")["steps"] == 2


# ---- LR warmup and schedules ----------------------------------------------------------------------


def torch_reference(optimizer, kind: str, warmup: int, total: int, start: float, step_size: int, gamma: float):
    main_part = {
        "cosine": lambda: torch_schedulers.CosineAnnealingLR(optimizer, T_max=total - warmup),
        "linear": lambda: torch_schedulers.LinearLR(optimizer, 1.0, 0.0, total_iters=total - warmup),
        "step": lambda: torch_schedulers.StepLR(optimizer, step_size, gamma),
        "none": lambda: torch_schedulers.ConstantLR(optimizer, 1.0, total_iters=0),
    }[kind]
    if warmup == 0:
        return main_part()
    warm = torch_schedulers.LinearLR(optimizer, start, 1.0, total_iters=warmup)
    return torch_schedulers.SequentialLR(optimizer, [warm, main_part()], milestones=[warmup])


def lr_curve(scheduler, optimizer, steps: int) -> list[float]:
    curve = []
    for _ in range(steps):
        curve.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return curve


@pytest.mark.parametrize("kind", ["cosine", "linear", "step", "none"])
@pytest.mark.parametrize("warmup", [0, 5])
def test_warmup_and_schedules_match_torch_schedulers(kind, warmup):
    total, step_size, gamma = 20, 2, 0.5  # step_size in epochs of 3 steps
    settings = {"scheduler": kind, "warmup_steps": warmup, "warmup_start_factor": 0.25, "step_size": step_size, "gamma": gamma, "lr": 0.4}
    config = load_config(None, [f"trainer.max_steps={total}", *(f"optimizer.{key}={value}" for key, value in settings.items())])
    params = [torch.nn.Parameter(torch.zeros(1))]
    ours_opt = optimizer_factory(config)(params)
    ours = lr_curve(scheduler_factory(config, 3)(ours_opt), ours_opt, total + 1)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SequentialLR's own step(0) deprecation warning
        reference = lr_curve(torch_reference(ref_opt, kind, warmup, total, 0.25, step_size * 3, gamma), ref_opt, total + 1)
    assert ours == pytest.approx(reference, rel=1e-6, abs=1e-9)
    if warmup:
        assert ours[0] == pytest.approx(0.1) and ours[warmup] == pytest.approx(0.4)


def test_no_warmup_keeps_torchs_cosine_and_step_schedulers_and_none_has_none():
    kinds = {}
    for kind in ("cosine", "step", "none", "linear"):
        config = load_config(None, [f"optimizer.scheduler={kind}", "trainer.max_steps=10"])
        scheduler = scheduler_factory(config, 3)(optimizer_factory(config)(make_mlp().parameters()))
        kinds[kind] = type(scheduler).__name__
    assert kinds == {"cosine": "CosineAnnealingLR", "step": "StepLR", "none": "NoneType", "linear": "LambdaLR"}


def test_a_warmup_schedule_resumes_bit_exact_and_refuses_a_changed_horizon(tmp_path, capsys):
    schedule = [
        "optimizer.warmup_steps=3",
        "optimizer.scheduler=cosine",
        "optimizer.lr=0.05",
        "trainer.max_steps=6",
        "checkpoint.every_steps=3",
    ]
    straight = tmp_path / "straight"
    train(straight, *USER_MODEL, *schedule)
    resumed = tmp_path / "resumed"
    train(resumed, *USER_MODEL, *schedule)
    shutil.rmtree(resumed / keys.CHECKPOINTS_DIR / keys.STEP_DIR.format(step=6))
    train(resumed, *USER_MODEL, *schedule)
    final = keys.CHECKPOINTS_DIR + "/" + keys.STEP_DIR.format(step=6) + "/" + keys.SHARED_FILE
    a, b = (torch.load(run / final, weights_only=True) for run in (straight, resumed))
    assert all(torch.equal(a[keys.MODEL][name], b[keys.MODEL][name]) for name in a[keys.MODEL])
    assert a[keys.SCHEDULER] == b[keys.SCHEDULER] and lrs(straight) == lrs(resumed) and len(lrs(straight)) == 6
    assert lrs(straight)[1] == pytest.approx(0.05 * (0.1 + 0.9 / 3))  # the lr after step 1 of 3 warmup steps from 0.1 x lr
    code = main(["train", str(QUICKSTART), f"trainer.run_dir={resumed}", *SMALL, *USER_MODEL, *schedule[:3], "trainer.max_steps=9"])
    err = capsys.readouterr().err
    assert code == 2 and "its LR schedule changed (total_steps 6 -> 9)" in err and err.count("\n") == 1, err


# ---- DDP options ----------------------------------------------------------------------------------


CASES = [
    (DDPOptions(find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=1, comm_hook="fp16"), "fp16_compress_hook", 2e-3),
    (DDPOptions(static_graph=True, comm_hook="bf16"), "bf16_compress_hook", 2e-2),
    (DDPOptions(), None, 1e-6),
]


def ddp_options_worker(env, options: list[DDPOptions]):
    """Per ``options``: two steps under DDP; report DDP's settings, its hooks and the first gradients."""
    results = []
    for option in options:
        sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
        prepared = prepare(make_mlp(batchnorm=False), sgd, env, precision="O0", parallel=Parallel(ddp=option))
        ddp = prepared.model
        first = None
        for x, y in make_batches(2, batch=16, seed=3):
            prepared.optimizer.zero_grad()
            shard = slice(env.rank * 8, env.rank * 8 + 8)
            prepared.engine.backward(F.cross_entropy(ddp(x[shard]), y[shard]))
            first = first or [p.grad.clone() for p in prepared.module.parameters()]
            prepared.engine.step(prepared.optimizer)
        seen = {
            "type": type(ddp).__name__, "find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "hooks": [hook.__name__ for hook, _ in ddp._comm_hooks],
        }  # fmt: skip
        results.append((seen, first))
    return results


def global_batch_grads() -> list[torch.Tensor]:
    model = make_mlp(batchnorm=False)
    x, y = make_batches(2, batch=16, seed=3)[0]
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.timeout(300)
def test_ddp_options_reach_ddp_in_two_gloo_processes():
    """find_unused_parameters, static_graph, gradient_as_bucket_view, the bucket cap and the fp16 / bf16
    hooks are DDP's own settings on both ranks, and the hooked all-reduce still averages the gradients."""
    by_rank = launch_local(ddp_options_worker, 2, ([options for options, _, _ in CASES],), device="cpu", backend="gloo", timeout_s=60)
    reference = global_batch_grads()
    for case, (options, hook, tolerance) in enumerate(CASES):
        for seen, grads in (by_rank[0][case], by_rank[1][case]):
            assert seen == {
                "type": "DistributedDataParallel", "find_unused_parameters": options.find_unused_parameters,
                "static_graph": options.static_graph, "gradient_as_bucket_view": options.gradient_as_bucket_view,
                "bucket_bytes_cap": int((options.bucket_cap_mb or 25) * 1024 * 1024), "hooks": [hook] if hook else [],
            }, options  # fmt: skip
            for grad, ref in zip(grads, reference):
                torch.testing.assert_close(grad, ref, rtol=tolerance, atol=tolerance / 10)
        assert all(torch.equal(a, b) for a, b in zip(by_rank[0][case][1], by_rank[1][case][1])), "ranks must hold the same gradients"


@pytest.mark.timeout(300)
def test_a_recipe_trains_with_ddp_options_in_two_processes(tmp_path):
    options = ["distributed.nproc_per_node=2", "distributed.device=cpu", "distributed.backend=gloo", "distributed.comm_hook=fp16",
               "distributed.find_unused_parameters=true", "distributed.bucket_cap_mb=2", "trainer.max_steps=2"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "ampddp", "train", str(QUICKSTART), f"trainer.run_dir={tmp_path}", *SMALL, *options],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2


def test_ddp_options_are_checked_and_come_from_the_recipe():
    config = load_config(None, ["distributed.static_graph=true", "distributed.bucket_cap_mb=5", "distributed.comm_hook=bf16"])
    assert ddp_options(config) == DDPOptions(static_graph=True, bucket_cap_mb=5.0, comm_hook="bf16")
    for bad, message in (
        ({"comm_hook": "zip"}, "comm_hook='zip' is not valid; valid choices: none, fp16, bf16"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb=-1 is not valid; it must be a finite number of MiB > 0"),
        ({"static_graph": "yes"}, "static_graph='yes' is not valid; it must be true or false"),
    ):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            DDPOptions(**bad)


def test_sync_bn_choices_have_one_definition_and_one_resolution():
    sync_bn = next(f for f in DistributedConfig.__dataclass_fields__.values() if f.name == "sync_bn")
    assert sync_bn.metadata["choices"] == SYNC_BN_CHOICES == ("off", "auto", "torch", "apex", "portable")
    assert resolve_sync_bn("auto", torch.device("cuda", 0)) == "torch" and resolve_sync_bn("auto", torch.device("cpu")) == "portable"
    assert resolve_sync_bn("apex", torch.device("cpu")) == "apex"
