"""Resume with changed settings: one warning listing them, run-defining ones refused, deliberate
ones applied consistently (lr, horizon, batch size, optimizer type); a finished run is left alone."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from image_folders import make_image_folder
from resume_helpers import NoisyDigits, make_trainer, tree_snapshot

from ampddp.checkpoint import keys
from ampddp.errors import ConfigError
from ampddp.observe import read_metrics
from ampddp.recipe.reading import load_config
from ampddp.rundir.files import METRICS_FILE, SUMMARY_FILE
from ampddp.rundir.lock import LOCK_FILE
from ampddp.training.resume.changes import check_resume_settings, config_changes
from ampddp.training.resume.schedule_plan import plan_schedule
from ampddp.zoo.data import IMAGENET_MEAN, IMAGENET_STD, build_datasets, resolve_normalize

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "quickstart.yaml")
SMALL = ["model.name=mlp", "data.image_size=8", "data.channels=1", "data.batch_size=16", "precision.mode=O0",
         "trainer.log_every_steps=1", "trainer.progress=lines", "optimizer.scheduler=cosine", "optimizer.lr=0.1"]  # fmt: skip


def train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ampddp", "train", RECIPE, f"trainer.run_dir={run_dir}", *SMALL, *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)


def lrs(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run_dir) if r["kind"] == "train"}


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / keys.CHECKPOINTS_DIR / keys.STEP_DIR.format(step=step)


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """The run dir's files; the run-dir lock file names its latest holder and is left out."""
    return tree_snapshot(run_dir, skip=(LOCK_FILE,))


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> Path:
    """A finished 6-step cosine run with checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("six") / "run"
    result = train(run_dir, "trainer.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=null")
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def copy_run(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


# ---- the settings diff ---------------------------------------------------------------------------
def test_every_changed_key_is_listed_and_run_defining_ones_are_refused():
    saved = load_config(RECIPE).to_dict()
    changed = load_config(RECIPE, ["data.batch_size=8", "optimizer.lr=0.01", "trainer.max_epochs=9", "trainer.run_dir=elsewhere",
                                   "checkpoint.resume_from=x"]).to_dict()  # fmt: skip
    assert [c.key for c in config_changes(saved, changed)] == ["data.batch_size", "optimizer.lr", "trainer.max_epochs"]
    line = check_resume_settings(saved, changed, "ckpt")
    assert line == "resuming ckpt with changed settings: data.batch_size 32 -> 8; optimizer.lr 0.05 -> 0.01; trainer.max_epochs 8 -> 9"
    assert check_resume_settings(saved, load_config(RECIPE).to_dict(), "ckpt") is None
    for override in ("model.name=mlp", "model.num_classes=12", "data.image_size=8", "data.eval_fraction=0.5", "trainer.seed=3",
                     "data.name=cifar10", "data.channels=3"):  # fmt: skip
        current = load_config(RECIPE, [override]).to_dict()
        with pytest.raises(ConfigError, match=rf"cannot resume ckpt with {override.split('=')[0]} .*checkpoint.allow_changes=true"):
            check_resume_settings(saved, current, "ckpt")
        allowed = load_config(RECIPE, [override, "checkpoint.allow_changes=true"]).to_dict()
        assert override.split("=")[0] in check_resume_settings(saved, allowed, "ckpt")
    older = {section: dict(values) for section, values in saved.items()}
    del older["checkpoint"]["allow_changes"]  # a checkpoint written before the key existed
    assert config_changes(older, saved) == []


# ---- data.normalize: the normalisation it selects, and checkpoints from before the key ------------
IMAGEFOLDER = ("data.name=imagefolder", "data.root=images", "data.channels=3")
CIFAR10 = ("data.name=cifar10", "data.root=cifar", "data.channels=3")
ADDED_WITH_NORMALIZE = {
    "data": ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "auto_augment", "normalize", "decode_device"),
    "trainer": ("channels_last", "cudnn_benchmark", "allow_tf32"),
}
"""The keys the change that introduced data.normalize added (26a3acc)."""
ABSENT_IMAGEFOLDER = "data.normalize (absent: no normalisation, written before ampddp normalised inputs)"


def settings(*overrides: str) -> dict:
    return load_config(RECIPE, list(overrides)).to_dict()


def written_before_normalize(config: dict) -> dict:
    """``config`` as an ampddp from before data.normalize saved it: without the keys that change added."""
    return {
        section: {k: v for k, v in values.items() if k not in ADDED_WITH_NORMALIZE.get(section, ())} for section, values in config.items()
    }


def test_a_null_normalize_and_the_default_it_stands_for_are_the_same_run():
    for data_set, default in (("imagefolder", "imagenet"), ("cifar10", "computed")):
        null = settings(f"data.name={data_set}", "data.root=images", "data.channels=3")
        explicit = settings(f"data.name={data_set}", "data.root=images", "data.channels=3", f"data.normalize={default}")
        assert config_changes(null, explicit) == [] and config_changes(explicit, null) == [], data_set
        assert check_resume_settings(null, explicit, "ckpt") is None and check_resume_settings(explicit, null, "ckpt") is None
    assert (resolve_normalize("imagefolder", None), resolve_normalize("cifar10", None)) == ("imagenet", "computed")
    assert resolve_normalize("imagefolder", "computed") == "computed"
    assert resolve_normalize("digits", None) is None and resolve_normalize("pkg.mod:data", None) is None


def test_the_image_pipeline_applies_the_normalisation_the_resolver_names(tmp_path):
    images = make_image_folder(tmp_path / "images", per_class=2, val_per_class=1, size=16)
    train_set, eval_set = build_datasets("imagefolder", str(images), 8, 3, 0.25, 0, augment=True, normalize=None)
    for dataset in (train_set, eval_set):
        normalize = next(t for t in dataset.transform.transforms if type(t).__name__ == "Normalize")
        assert (tuple(normalize.mean), tuple(normalize.std)) == (IMAGENET_MEAN, IMAGENET_STD)


def test_a_null_normalize_resumed_with_another_normalisation_is_refused():
    null, computed = settings(*IMAGEFOLDER), settings(*IMAGEFOLDER, "data.normalize=computed")
    shown = "data.normalize null (imagefolder's default, 'imagenet') -> 'computed'"
    with pytest.raises(ConfigError, match=rf"^cannot resume ckpt with {re.escape(shown)}: .*input normalisation.*allow_changes=true"):
        check_resume_settings(null, computed, "ckpt")
    with pytest.raises(ConfigError, match=re.escape("data.normalize 'computed' -> null (imagefolder's default, 'imagenet')")):
        check_resume_settings(computed, null, "ckpt")
    allowed = settings(*IMAGEFOLDER, "data.normalize=computed", "checkpoint.allow_changes=true")
    assert check_resume_settings(null, allowed, "ckpt") == f"resuming ckpt with changed settings: {shown}"
    with pytest.raises(ConfigError, match=re.escape("data.normalize null (cifar10's default, 'computed') -> 'imagenet'")):
        check_resume_settings(settings(*CIFAR10), settings(*CIFAR10, "data.normalize=imagenet"), "ckpt")


def test_an_imagefolder_checkpoint_from_before_data_normalize_is_refused_unless_allowed():
    old = written_before_normalize(settings(*IMAGEFOLDER))
    for normalize in ("null", "imagenet", "computed"):
        current = settings(*IMAGEFOLDER, f"data.normalize={normalize}")
        assert [c.key for c in config_changes(old, current)] == ["data.normalize"], "the other new keys default to the old behaviour"
        with pytest.raises(ConfigError) as refused:
            check_resume_settings(old, current, "ckpt")
        message = str(refused.value)
        assert message.startswith(f"cannot resume ckpt with {ABSENT_IMAGEFOLDER} -> "), message
        assert "learned from unnormalised inputs in [0, 1], which no data.normalize value gives" in message
        assert "checkpoint.init_from=ckpt starts a fresh run" in message and "checkpoint.allow_changes=true" in message
    allowed = settings(*IMAGEFOLDER, "data.normalize=imagenet", "checkpoint.allow_changes=true")
    assert check_resume_settings(old, allowed, "ckpt") == f"resuming ckpt with changed settings: {ABSENT_IMAGEFOLDER} -> 'imagenet'"


def test_a_cifar10_checkpoint_from_before_data_normalize_was_standardised_as_computed():
    old = written_before_normalize(settings(*CIFAR10))
    assert config_changes(old, settings(*CIFAR10)) == [] and config_changes(old, settings(*CIFAR10, "data.normalize=computed")) == []
    with pytest.raises(
        ConfigError, match=r"data.normalize \(absent: the training split's per-channel statistics, as 'computed'.*\) -> 'imagenet'"
    ):
        check_resume_settings(old, settings(*CIFAR10, "data.normalize=imagenet"), "ckpt")


def test_digits_and_a_users_data_set_are_unaffected_by_normalize():
    for config in (settings(), settings("data.name=pkg.mod:data")):
        assert config_changes(written_before_normalize(config), config) == []
        assert check_resume_settings(written_before_normalize(config), config, "ckpt") is None
        assert config_changes(config, config) == []


@pytest.mark.timeout(400)
def test_an_imagefolder_run_with_null_normalize_resumes_with_imagenet_and_refuses_computed(tmp_path):
    images = make_image_folder(tmp_path / "images", per_class=4, val_per_class=1, size=16)
    run_dir = tmp_path / "run"
    image_run = ["data.name=imagefolder", f"data.root={images}", "data.channels=3", "data.batch_size=4", "trainer.max_steps=2",
                 "checkpoint.every_steps=1", "checkpoint.keep_last=null"]  # fmt: skip
    first = train(run_dir, *image_run)
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(run_dir)
    refused = train(run_dir, *image_run, f"checkpoint.resume_from={step_dir(run_dir, 1)}", "data.normalize=computed")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
    assert "data.normalize null (imagefolder's default, 'imagenet') -> 'computed'" in refused.stderr and snapshot(run_dir) == before
    resumed = train(run_dir, *image_run, f"checkpoint.resume_from={step_dir(run_dir, 1)}", "data.normalize=imagenet")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "with changed settings" not in resumed.stderr and "resumed from" in resumed.stderr


# ---- the schedule plan ---------------------------------------------------------------------------
def _cosine(lr: float, horizon: int, steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.CosineAnnealingLR]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def _resume(lr: float, horizon: int, saved_optimizer, saved_scheduler, steps: int):
    optimizer, scheduler = _cosine(lr, horizon, 0)
    plan = plan_schedule(optimizer, scheduler, saved_optimizer.state_dict(), saved_scheduler.state_dict(), steps, "ckpt")
    if plan.load_optimizer:
        optimizer.load_state_dict(saved_optimizer.state_dict())
    if plan.load_scheduler:
        scheduler.load_state_dict(saved_scheduler.state_dict())
    plan.apply(optimizer, scheduler)
    return optimizer, scheduler, plan


def _run_out(optimizer, scheduler, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        seen.append(optimizer.param_groups[0]["lr"])
    return seen


def test_unchanged_settings_touch_nothing():
    saved_optimizer, saved_scheduler = _cosine(0.1, 20, 7)
    optimizer, scheduler, plan = _resume(0.1, 20, saved_optimizer, saved_scheduler, 7)
    assert (plan.lrs, plan.initial_lrs, plan.scheduler_settings, plan.notes) == (None, None, {}, [])
    assert _run_out(optimizer, scheduler, 13) == _run_out(saved_optimizer, saved_scheduler, 13)


def test_a_longer_horizon_continues_from_the_current_lr_down_to_zero_at_the_new_end():
    saved_optimizer, saved_scheduler = _cosine(0.1, 20, 10)
    current = saved_optimizer.param_groups[0]["lr"]
    optimizer, scheduler, plan = _resume(0.1, 50, saved_optimizer, saved_scheduler, 10)
    assert optimizer.param_groups[0]["lr"] == current and "re-planned at step 10" in plan.notes[0]
    after = _run_out(optimizer, scheduler, 40)
    assert all(b <= a for a, b in zip([current, *after], after)), "the lr must never climb back up"
    assert after[-2] > 0 and after[-1] == pytest.approx(0.0, abs=1e-12)


def test_a_shorter_horizon_reaches_zero_at_the_new_end():
    saved_optimizer, saved_scheduler = _cosine(0.1, 50, 10)
    optimizer, scheduler, _ = _resume(0.1, 20, saved_optimizer, saved_scheduler, 10)
    after = _run_out(optimizer, scheduler, 10)
    assert after[-1] == pytest.approx(0.0, abs=1e-12) and all(b <= a for a, b in itertools.pairwise(after))


def test_a_new_base_lr_scales_the_schedule_at_the_current_step():
    saved_optimizer, saved_scheduler = _cosine(0.1, 20, 5)
    optimizer, scheduler, plan = _resume(0.05, 20, saved_optimizer, saved_scheduler, 5)
    reference = _run_out(*_cosine(0.05, 20, 5), 15)
    assert _run_out(optimizer, scheduler, 15) == pytest.approx(reference, rel=1e-9, abs=1e-15)
    assert "base lr changed (0.1 -> 0.05)" in plan.notes[0]
    assert plan.load_optimizer, "the same optimizer type keeps its state (momentum)"


def test_extending_a_finished_cosine_is_refused_with_the_way_out():
    saved_optimizer, saved_scheduler = _cosine(0.1, 20, 20)
    with pytest.raises(ConfigError, match=r"cosine LR schedule already ended at step 20 .*checkpoint.init_from=ckpt"):
        _resume(0.1, 40, saved_optimizer, saved_scheduler, 20)


def test_another_optimizer_type_starts_fresh_state_at_the_same_schedule_position():
    saved_optimizer, saved_scheduler = _cosine(0.1, 20, 5)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
    plan = plan_schedule(optimizer, scheduler, saved_optimizer.state_dict(), saved_scheduler.state_dict(), 5, "ckpt")
    assert not plan.load_optimizer and plan.load_scheduler and "optimizer type changed (AdamW now)" in plan.notes[0]
    scheduler.load_state_dict(saved_scheduler.state_dict())
    plan.apply(optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == saved_optimizer.param_groups[0]["lr"]
    assert _run_out(optimizer, scheduler, 15) == pytest.approx(_run_out(saved_optimizer, saved_scheduler, 15))


def test_step_lr_takes_the_new_step_size_from_the_current_lr():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    _run_out(optimizer, scheduler, 6)  # lr 0.05 at step 6
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh, step_size=5, gamma=0.5)
    plan = plan_schedule(fresh, fresh_scheduler, optimizer.state_dict(), scheduler.state_dict(), 6, "ckpt")
    fresh.load_state_dict(optimizer.state_dict())
    fresh_scheduler.load_state_dict(scheduler.state_dict())
    plan.apply(fresh, fresh_scheduler)
    assert fresh.param_groups[0]["lr"] == 0.05
    assert _run_out(fresh, fresh_scheduler, 5) == pytest.approx([0.05, 0.05, 0.05, 0.025, 0.025])


def test_a_new_batch_size_keeps_the_data_position_exact(tmp_path):
    class Recorded(NoisyDigits):
        def __init__(self, seen: list[int]) -> None:
            super().__init__(size=44)
            self.seen = seen

        def __getitem__(self, index: int):
            self.seen.append(index)
            return super().__getitem__(index)

    first_seen: list[int] = []
    first = make_trainer(tmp_path, "O0", max_steps=3, checkpoint_every=1, grad_accum_steps=1)
    first.train_set = Recorded(first_seen)
    first.fit()
    second_seen: list[int] = []
    second = make_trainer(tmp_path, "O0", max_steps=None, max_epochs=1, batch_size=5, grad_accum_steps=1)
    second.train_set = Recorded(second_seen)
    second.fit()
    assert len(first_seen) == 12 and sorted(first_seen + second_seen) == list(range(44)), "each sample once in the epoch"
    assert second.progress.epoch == 1 and second.progress.samples_seen == 44


# ---- through the command line ----------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_resume_with_a_new_lr_and_a_longer_horizon_applies_both(six_steps, tmp_path):
    run_dir = copy_run(six_steps, tmp_path / "run")
    original = lrs(six_steps)
    result = train(run_dir, f"checkpoint.resume_from={step_dir(run_dir, 3)}", "trainer.max_steps=12", "optimizer.lr=0.05",
                   "checkpoint.every_steps=3")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "with changed settings" in line]
    assert len(warnings) == 1 and "optimizer.lr 0.1 -> 0.05" in warnings[0] and "trainer.max_steps 6 -> 12" in warnings[0]
    resumed = lrs(run_dir)
    assert resumed[3] == original[3]
    later = [resumed[step] for step in range(4, 13)]
    assert later[0] <= original[3] / 2 + 1e-12 and all(b <= a for a, b in itertools.pairwise(later)) and later[-1] == pytest.approx(0)
    assert (run_dir / keys.ABANDONED_DIR / keys.STEP_DIR.format(step=6)).is_dir()


@pytest.mark.timeout(400)
def test_refused_changes_exit_2_and_write_nothing_and_allow_changes_resumes(six_steps, tmp_path):
    run_dir = copy_run(six_steps, tmp_path / "run")
    before = snapshot(run_dir)
    for override in ("data.eval_fraction=0.5", "trainer.seed=1", "trainer.max_steps=12"):
        result = train(run_dir, "trainer.max_steps=12", override)
        assert result.returncode == 2, (override, result.stderr[-2000:])
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
        assert snapshot(run_dir) == before, override
    assert "cosine LR schedule already ended at step 6" in result.stderr
    allowed = train(run_dir, f"checkpoint.resume_from={step_dir(run_dir, 3)}", "data.eval_fraction=0.5", "checkpoint.allow_changes=true")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "data.eval_fraction 0.25 -> 0.5" in allowed.stderr


@pytest.mark.timeout(400)
def test_another_optimizer_resumes_with_fresh_state_and_a_warning(six_steps, tmp_path):
    run_dir = copy_run(six_steps, tmp_path / "run")
    result = train(run_dir, f"checkpoint.resume_from={step_dir(run_dir, 3)}", "optimizer.name=adamw", "optimizer.lr=0.001")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "optimizer type changed (AdamW now)" in result.stderr and "optimizer.name 'sgd' -> 'adamw'" in result.stderr
    assert math.isfinite(json.loads((run_dir / SUMMARY_FILE).read_text())["final_eval_loss"])


@pytest.mark.timeout(400)
def test_a_finished_run_started_again_changes_nothing(six_steps, tmp_path):
    run_dir = copy_run(six_steps, tmp_path / "run")
    before = snapshot(run_dir)
    result = train(run_dir, "trainer.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=null")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "already complete at step 6" in result.stderr
    assert json.loads(result.stdout)["already_complete"] is True
    assert snapshot(run_dir) == before, "summary.json, metrics.jsonl and the checkpoints stay as they were"
    assert (run_dir / METRICS_FILE).is_file()


def test_a_replanned_schedule_resumed_again_with_the_same_settings_changes_nothing():
    saved_optimizer, saved_scheduler = _cosine(0.1, 100, 40)
    optimizer, scheduler, _ = _resume(0.1, 200, saved_optimizer, saved_scheduler, 40)
    _run_out(optimizer, scheduler, 20)
    again_optimizer, again_scheduler, plan = _resume(0.1, 200, optimizer, scheduler, 60)
    assert (plan.lrs, plan.initial_lrs, plan.scheduler_settings, plan.notes) == (None, None, {}, [])
    assert _run_out(again_optimizer, again_scheduler, 140) == _run_out(optimizer, scheduler, 140)


def test_a_horizon_before_the_current_step_and_a_zero_lr_mid_schedule():
    saved_optimizer, saved_scheduler = _cosine(0.1, 100, 60)
    with pytest.raises(ConfigError, match=r"would end at step 25, before the 60 steps already applied.*trainer.max_steps"):
        _resume(0.1, 25, saved_optimizer, saved_scheduler, 60)
    optimizer, scheduler, _ = _resume(0.0, 100, saved_optimizer, saved_scheduler, 60)
    assert optimizer.param_groups[0]["lr"] == 0.0 and _run_out(optimizer, scheduler, 3) == [0.0, 0.0, 0.0]


@pytest.mark.timeout(400)
def test_a_finished_run_started_with_another_batch_size_is_still_just_complete(six_steps, tmp_path):
    run_dir = copy_run(six_steps, tmp_path / "run")
    before = snapshot(run_dir)
    result = train(run_dir, "trainer.max_steps=6", "data.batch_size=8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "already complete at step 6" in result.stderr and snapshot(run_dir) == before
