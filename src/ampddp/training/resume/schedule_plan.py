"""Carry a changed learning rate, horizon or optimizer into a resumed run, consistently.

Loading a checkpoint restores the optimizer's ``lr`` and the scheduler's horizon as they were, so a
new ``optimizer.lr`` would be ignored and a longer ``max_steps`` would keep the old cosine end (and
a later restart from scratch would jump back up). ``plan_schedule`` compares what the fresh
optimizer and scheduler were built with against what the checkpoint holds, before anything is
loaded, and ``SchedulePlan.apply`` then makes the changes take effect:

- a new base lr scales the schedule: the lr at the resumed step is the old one times new/old;
- a new cosine horizon is re-planned from the current step: the lr continues from where it is and
  reaches ``eta_min`` at the new end, never jumping back up (a cosine with a virtual base chosen so
  that it passes through the current lr at the current step);
- a cosine that already reached its end cannot be extended (the added steps would train at lr 0):
  refused, naming the way out;
- StepLR adopts the new step size and gamma from the current lr on;
- a LambdaLR over a callable object (``ampddp.recipe.schedule.LRSchedule``: a warmup, or the linear
  schedule) holds its settings in its state: other settings (a new horizon, warmup, kind) are
  refused, naming what changed, since the curve cannot be bent without the lr jumping; a new base
  lr scales it;
- a different optimizer type (SGD -> AdamW: parameter-group keys differ both ways) starts with
  fresh optimizer state; the schedule keeps its position.
With unchanged settings nothing is touched: the resume stays bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, StepLR

from ampddp.errors import ConfigError

NOT_HYPERPARAMETERS = frozenset({"params", "lr", "initial_lr"})


@dataclass
class SchedulePlan:
    """What to load from the checkpoint and what to set afterwards (see ``apply``)."""

    load_optimizer: bool = True
    load_scheduler: bool = True
    lrs: list[float] | None = None
    initial_lrs: list[float] | None = None
    scheduler_settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def apply(self, optimizer: Optimizer, scheduler: Any) -> None:
        """Set the planned lrs and scheduler attributes (after the checkpoint's state is loaded)."""
        for name, values in (("lr", self.lrs), ("initial_lr", self.initial_lrs)):
            if values is not None:
                for group, value in zip(optimizer.param_groups, values):
                    group[name] = value
        for name, value in self.scheduler_settings.items():
            setattr(scheduler, name, value)


def _different_kind(saved_group: Mapping[str, Any], fresh_group: Mapping[str, Any]) -> bool:
    """Another optimizer type: each side has hyperparameters the other lacks. (A newer torch only
    adds keys to the same optimizer, which differs in one direction only.)"""
    saved, fresh = set(saved_group) - NOT_HYPERPARAMETERS, set(fresh_group) - NOT_HYPERPARAMETERS
    return bool(saved - fresh) and bool(fresh - saved)


def _base(group: Mapping[str, Any]) -> float:
    return float(group.get("initial_lr", group["lr"]))


def plan_schedule(
    optimizer: Optimizer, scheduler: Any, saved_optimizer: Mapping[str, Any], saved_scheduler: Mapping[str, Any] | None,
    applied_steps: int, where: str,
) -> SchedulePlan:  # fmt: skip
    """Plan the resume of ``optimizer``/``scheduler`` (as freshly built from this run's settings)
    from a checkpoint's optimizer and scheduler state; raises ``ConfigError`` for an impossible
    change (extending a cosine that already ended)."""
    plan = SchedulePlan()
    fresh_groups, saved_groups = optimizer.param_groups, list(saved_optimizer["param_groups"])
    if _different_kind(saved_groups[0], fresh_groups[0]):
        plan.load_optimizer = False
        plan.notes.append(
            f"the optimizer type changed ({type(optimizer).__name__} now): it starts with fresh state (momentum / moment "
            "estimates reset); the LR schedule keeps its position"
        )
    fresh_base, current, lr_changed = _base_lrs(plan, saved_groups, fresh_groups)
    saved = dict(saved_scheduler) if isinstance(saved_scheduler, Mapping) else None
    step = int(saved["last_epoch"]) if saved is not None and "last_epoch" in saved else applied_steps
    _plan_scheduler(plan, scheduler, saved, lr_changed, current, fresh_base, step, where)
    if not plan.load_optimizer and plan.lrs is None:
        plan.lrs = current
    return plan


def _base_lrs(
    plan: SchedulePlan, saved_groups: list[Mapping[str, Any]], fresh_groups: list[Mapping[str, Any]]
) -> tuple[list[float], list[float], bool]:
    """This run's base lr per group, the lr each group has at the checkpoint's step under it (the saved
    lr scaled by new base / old base), and whether the base lr changed (noted in ``plan``)."""
    fresh_base = [_base(group) for group in fresh_groups]
    saved_base = [_base(group) for group in saved_groups]
    current = [
        float(group["lr"]) if new == old else (float(group["lr"]) * new / old if old else new)
        for group, new, old in zip(saved_groups, fresh_base, saved_base)
    ]
    lr_changed = fresh_base != saved_base
    if lr_changed:
        plan.notes.append(f"the base lr changed ({saved_base[0]:g} -> {fresh_base[0]:g}): the lr at this step is now {current[0]:.6g}")
    return fresh_base, current, lr_changed


def _plan_scheduler(
    plan: SchedulePlan, scheduler: Any, saved: dict[str, Any] | None, lr_changed: bool, current: list[float],
    fresh_base: list[float], step: int, where: str,
) -> None:  # fmt: skip
    """The scheduler's part of ``plan``, by the kind of scheduler this run built."""
    if scheduler is None:
        plan.load_scheduler = False
        if lr_changed or saved is not None or not plan.load_optimizer:
            plan.lrs = plan.initial_lrs = fresh_base
    elif isinstance(scheduler, CosineAnnealingLR):
        _plan_cosine(plan, scheduler, saved, lr_changed, current, fresh_base, step, where)
    elif isinstance(scheduler, StepLR):
        _plan_step(plan, scheduler, saved, lr_changed, current, fresh_base, step)
    elif _is_user_lambda(scheduler):
        _check_lambda(scheduler, saved, where)
        if lr_changed:
            _rebase(plan, current, fresh_base)
    elif saved is None or set(saved) != set(scheduler.state_dict()):
        plan.load_scheduler = False
        plan.notes.append(f"the LR scheduler changed ({type(scheduler).__name__} now): it starts at this step from lr {current[0]:.6g}")
        plan.lrs = current
    elif lr_changed:
        _rebase(plan, current, fresh_base)


def _is_user_lambda(scheduler: Any) -> bool:
    return isinstance(scheduler, LambdaLR) and any(entry is not None for entry in scheduler.state_dict()["lr_lambdas"])


def _rebase(plan: SchedulePlan, current: list[float], fresh_base: list[float]) -> None:
    """The schedule keeps its position from the new base lr."""
    plan.lrs, plan.initial_lrs = current, fresh_base
    plan.scheduler_settings = {"base_lrs": fresh_base, "_last_lr": current}


def _plan_cosine(
    plan: SchedulePlan, scheduler: CosineAnnealingLR, saved: dict[str, Any] | None, lr_changed: bool, current: list[float],
    fresh_base: list[float], step: int, where: str,
) -> None:  # fmt: skip
    horizon, floor = scheduler.T_max, scheduler.eta_min
    same_kind = saved is not None and "T_max" in saved
    old_horizon = saved["T_max"] if same_kind else None
    plan.load_scheduler = same_kind
    if same_kind and old_horizon == horizon and saved.get("eta_min") == floor and not lr_changed:
        return
    _refuse_an_ended_cosine(where, step, horizon, floor, old_horizon, current)
    share = 2.0 / (1.0 + math.cos(math.pi * step / horizon))
    bases = [floor + (lr - floor) * share for lr in current]
    # The virtual bases live in the scheduler only: initial_lr keeps the configured base, which the
    # next resume compares with optimizer.lr (the same settings must then change nothing).
    plan.lrs, plan.initial_lrs = current, fresh_base
    plan.scheduler_settings = {"T_max": horizon, "base_lrs": bases, "last_epoch": step, "_last_lr": current}
    if old_horizon != horizon:
        was = f"step {old_horizon}" if old_horizon is not None else "no cosine schedule"
        plan.notes.append(
            f"LR schedule re-planned at step {step}: cosine from lr {current[0]:.6g} down to {floor:g} at step {horizon} (was: {was})"
        )


def _refuse_an_ended_cosine(where: str, step: int, horizon: int, floor: float, old_horizon: int | None, current: list[float]) -> None:
    """A cosine that would end before the steps already applied, or one that already ended at its floor
    and is asked to go on: either would train at the floor lr for the rest of the run."""
    if step >= horizon:
        raise ConfigError(
            f"cannot resume {where}: with these settings the cosine LR schedule would end at step {horizon}, before the "
            f"{step} steps already applied, so the rest of the run would train at lr {floor:g}; set trainer.max_steps to the "
            "step the run should end at (a changed world size or batch size changes the steps per epoch)"
        )
    if old_horizon is not None and step >= old_horizon and any(lr <= floor for lr in current):
        raise ConfigError(
            f"cannot resume {where} to step {horizon}: its cosine LR schedule already ended at step {step} (lr {floor:g}), so the "
            "added steps would not train; start a fresh run from these weights instead (another trainer.run_dir with "
            f"checkpoint.init_from={where}), or resume with optimizer.scheduler=none"
        )


def _plan_step(
    plan: SchedulePlan, scheduler: StepLR, saved: dict[str, Any] | None, lr_changed: bool, current: list[float],
    fresh_base: list[float], step: int,
) -> None:  # fmt: skip
    same_kind = saved is not None and "step_size" in saved
    plan.load_scheduler = same_kind
    if same_kind and saved["step_size"] == scheduler.step_size and saved.get("gamma") == scheduler.gamma and not lr_changed:
        return
    plan.lrs, plan.initial_lrs = current, fresh_base
    plan.scheduler_settings = {
        "step_size": scheduler.step_size, "gamma": scheduler.gamma, "base_lrs": fresh_base, "last_epoch": step, "_last_lr": current,
    }  # fmt: skip
    if not same_kind or saved["step_size"] != scheduler.step_size or saved.get("gamma") != scheduler.gamma:
        plan.notes.append(
            f"StepLR now decays by {scheduler.gamma:g} every {scheduler.step_size} steps, from lr {current[0]:.6g} at step {step}"
        )


def _check_lambda(scheduler: LambdaLR, saved: dict[str, Any] | None, where: str) -> None:
    """A LambdaLR whose lambdas carry settings resumes only from a checkpoint with the same settings."""
    planned = scheduler.state_dict()["lr_lambdas"]
    held = saved.get("lr_lambdas") if saved is not None else None
    if isinstance(held, list) and [dict(entry) if isinstance(entry, Mapping) else entry for entry in held] == planned:
        return
    if isinstance(held, list) and held and isinstance(held[0], Mapping):
        old, new = held[0], planned[0]
        was = ", ".join(
            f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)
        )
    else:
        was = f"the checkpoint holds {'no' if saved is None else 'another'} LR scheduler, these settings one with warmup or linear decay"
    raise ConfigError(
        f"cannot resume {where}: its LR schedule changed ({was}); a schedule with warmup, or a linear one, is not re-planned "
        "mid-run (the lr would jump): resume with the settings it was trained with (trainer.max_steps / max_epochs, world size and "
        "batch size, optimizer.scheduler, warmup_steps, warmup_start_factor, step_size, gamma), or start a fresh run from these "
        f"weights (another trainer.run_dir with checkpoint.init_from={where})"
    )
