"""What a run is about to do, in numbers, for its first lines: the data, the batch, the horizon."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RunPlan:
    """A run's shape: ``train_samples`` (and ``eval_samples``, None without an evaluation set) read in
    batches of ``batch_size`` per process, ``processes`` of them, ``grad_accum_steps`` batches a step,
    until ``max_epochs`` or ``max_steps`` (whichever comes first)."""

    train_samples: int
    eval_samples: int | None
    batch_size: int
    processes: int
    grad_accum_steps: int
    max_epochs: int
    max_steps: int | None = None

    @property
    def step_samples(self) -> int:
        return self.batch_size * self.processes * self.grad_accum_steps

    @property
    def epoch_steps(self) -> int:
        return max(1, math.ceil(self.train_samples / self.step_samples))

    @property
    def total_steps(self) -> int:
        by_epochs = self.max_epochs * self.epoch_steps
        return min(self.max_steps, by_epochs) if self.max_steps else by_epochs

    def describe(self) -> str:
        """``data: 1347 training samples, 450 held out; 32 a step (...), 43 steps an epoch; ends at step 344 (8 epochs)``."""
        held = f"{self.eval_samples} held out" if self.eval_samples is not None else "no evaluation set"
        shape = [f"batch {self.batch_size}"]
        shape += [f"x {self.processes} processes"] if self.processes > 1 else []
        shape += [f"x {self.grad_accum_steps} accumulated"] if self.grad_accum_steps > 1 else []
        limit = f"{self.max_steps} steps" if self.max_steps and self.total_steps == self.max_steps else f"{self.max_epochs} epochs"
        return (
            f"data: {self.train_samples} training samples, {held}; {self.step_samples} a step ({' '.join(shape)}), "
            f"{self.epoch_steps} steps an epoch; ends at step {self.total_steps} ({limit})"
        )
