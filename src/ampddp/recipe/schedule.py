"""LR schedules by name, with an optional linear warmup.

Without warmup, ``cosine`` and ``step`` are torch's CosineAnnealingLR and StepLR (as checkpoints of
earlier runs hold them, and so that a resume can re-plan them, see
``ampddp.training.resume.schedule_plan``). A warmup, or the ``linear`` schedule, is one ``LambdaLR``
over an ``LRSchedule``: its settings travel in the scheduler's state, so a resume with other
settings is noticed (and refused) instead of silently bending the curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, StepLR

from ampddp.errors import ConfigError, choice_error

SCHEDULES = ("none", "cosine", "step", "linear")


@dataclass
class LRSchedule:
    """The lr factor at each optimizer step: ``warmup_steps`` rising linearly from
    ``warmup_start_factor`` to 1, then ``kind`` over the remaining ``total_steps - warmup_steps``:
    constant (none), cosine to 0, ``gamma`` every ``step_size`` steps (step), or linear to 0."""

    kind: str
    total_steps: int
    warmup_steps: int = 0
    warmup_start_factor: float = 0.1
    step_size: int = 1
    gamma: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise choice_error("scheduler", self.kind, SCHEDULES)
        if self.warmup_steps and self.warmup_steps >= self.total_steps:
            raise ConfigError(
                f"optimizer.warmup_steps={self.warmup_steps} is not below the run's {self.total_steps} steps "
                "(trainer.max_steps, or trainer.max_epochs x steps per epoch): the run would end in warmup; it must be smaller"
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_start_factor + (1.0 - self.warmup_start_factor) * step / self.warmup_steps
        done, span = step - self.warmup_steps, max(self.total_steps - self.warmup_steps, 1)
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(done, span) / span))
        if self.kind == "linear":
            return max(0.0, 1.0 - done / span)
        if self.kind == "step":
            return self.gamma ** (done // self.step_size)
        return 1.0


def lr_scheduler(optimizer: Optimizer, schedule: LRSchedule) -> LRScheduler | None:
    """The scheduler that runs ``schedule`` on ``optimizer`` (None: constant lr, no warmup)."""
    if schedule.warmup_steps == 0:
        if schedule.kind == "none":
            return None
        if schedule.kind == "cosine":
            return CosineAnnealingLR(optimizer, T_max=max(schedule.total_steps, 1))
        if schedule.kind == "step":
            return StepLR(optimizer, schedule.step_size, schedule.gamma)
    return LambdaLR(optimizer, schedule)
