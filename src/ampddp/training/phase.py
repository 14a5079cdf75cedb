"""Where this rank is in training (loading data, forward, backward, optimizer step, evaluation,
checkpoint), and since when: what a rank that stopped progressing is named with, and what an
out-of-memory error says happened.

The loop sets it at each phase of a step: one assignment of an immutable tuple, so the heartbeat
thread (``ampddp.distributed.watch``) reads a consistent value without a lock, and the step pays
nothing measurable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from ampddp.errors import OutOfMemoryError

Item = TypeVar("Item")

SETTING_UP = "setting up"
LOADING = "loading data for step {step}"
FORWARD = "the forward of step {step}"
BACKWARD = "the backward of step {step}"
AGREEING = "the exchange with the other ranks in step {step}"
OPTIMIZER = "the optimizer step {step}"
EVALUATION = "the evaluation at step {step}"
CHECKPOINT = "the checkpoint at step {step}"


class StepPhase:
    """The phase this rank is in, the optimizer step it belongs to, and when it began."""

    def __init__(self) -> None:
        self._now: tuple[str, int, float] = (SETTING_UP, 0, time.monotonic())

    def enter(self, name: str, step: int) -> None:
        """From now on this rank is in phase ``name`` (one of this module's) of optimizer step ``step``."""
        self._now = (name, step, time.monotonic())

    def loading(self, batches: Iterable[Item], step: Callable[[], int]) -> Iterator[Item]:
        """``batches``, each taken in the phase of loading data for the step ``step()`` says."""
        iterator = iter(batches)
        while True:
            self.enter(LOADING, step())
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch

    def where(self) -> tuple[str, float]:
        """(the phase in words, e.g. 'the backward of step 12'; seconds in it so far)."""
        name, step, since = self._now
        return name.format(step=step), time.monotonic() - since


OUT_OF_MEMORY_WORDS = ("can't allocate memory", "out of memory")
"""What torch's allocators say when they fail (the CPU's DefaultCPUAllocator raises a plain RuntimeError)."""


def out_of_memory(error: BaseException, phase: StepPhase, batch_size: int, device: torch.device) -> OutOfMemoryError | None:
    """``error`` as one line naming where memory ran out and with which batch; None when it is not
    an out-of-memory error."""
    ran_out = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        type(error) is RuntimeError and any(words in str(error).lower() for words in OUT_OF_MEMORY_WORDS)
    )
    if not ran_out:
        return None
    where, _ = phase.where()
    memory = "GPU" if device.type == "cuda" else "host"
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return OutOfMemoryError(
        f"out of {memory} memory during {where} ({batch_size} samples a batch on this rank): {said[:300]}; lower the batch size "
        "(data.batch_size), keeping the effective batch with gradient accumulation (trainer.grad_accum_steps) if it matters"
    )
