"""A last training batch of one sample, tried before training instead of found at the end of an epoch.

An epoch of N samples per rank in batches of B ends with a batch of N % B samples. When that is one,
BatchNorm on (N, C) features raises "Expected more than 1 value per channel when training" — after
a whole epoch, hours into a run that then fails the same way at every resume. When (and only when)
an epoch the run will finish ends in such a batch, the training step's forward and loss run once on
one sample at the start, with every buffer and random stream they touch restored. If one sample
fails where two pass, the run stops with one line naming batch sizes that avoid it; if two fail as
well, the error is the model's own and is raised as it is.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ampddp.checkpoint.rng import capture_rng, restore_rng
from ampddp.distributed.data import ResumableSampler, sum_across_ranks
from ampddp.distributed.env import DistEnv
from ampddp.errors import BadSamplesError, ConfigError, PeerFailureError
from ampddp.training.progress import Progress
from ampddp.training.settings import LoopSettings


def last_batch_size(samples: int, batch_size: int) -> int:
    """Samples in an epoch's last batch (a full batch when ``batch_size`` divides ``samples``)."""
    return samples % batch_size or min(samples, batch_size)


def batch_sizes_avoiding_one(epoch_samples: Sequence[int], batch_size: int) -> list[int]:
    """The nearest batch sizes below and above ``batch_size`` whose last batch holds more than one
    sample in every epoch of ``epoch_samples`` (none when an epoch has a single sample)."""
    if min(epoch_samples) < 2:
        return []

    def fits(size: int) -> bool:
        return all(last_batch_size(samples, size) != 1 for samples in epoch_samples)

    below = [size for size in range(batch_size - 1, 1, -1) if fits(size)][:1]
    above = next(size for size in range(batch_size + 1, max(epoch_samples) + 2) if fits(size))
    return [*below, above]


def epochs_to_finish(progress: Progress, sampler: ResumableSampler, settings: LoopSettings) -> list[int]:
    """Samples per rank of the epochs whose last batch this run will train: the current (maybe
    resumed) epoch and a full one, each only if the horizon reaches its end."""

    def steps(samples: int) -> int:
        return math.ceil(math.ceil(samples / settings.batch_size) / settings.grad_accum_steps)

    def within(step: int) -> bool:
        return settings.max_steps is None or step <= settings.max_steps

    current, full = sampler.samples_per_rank(progress.epoch_position), sampler.samples_per_rank(0)
    current_end = progress.global_step + steps(current)
    ends = []
    if progress.epoch < settings.max_epochs and within(current_end):
        ends.append(current)
    if progress.epoch + 1 < settings.max_epochs and within(current_end + steps(full)):
        ends.append(full)
    return ends


def check_single_sample_batch(
    train_set: Dataset,
    epoch_samples: Sequence[int],
    batch_size: int,
    try_batch: Callable[[Any], Any],
    module: nn.Module,
    env: DistEnv,
) -> None:
    """Stop the run now if an epoch of ``epoch_samples`` ends in a batch of one sample that
    ``try_batch`` (the step's forward and loss) fails on while it trains on two.

    Every rank has the same sizes, so every rank tries (a synchronised BatchNorm's collectives
    match) and every rank stops when one does.
    """
    ending_in_one = [samples for samples in epoch_samples if samples > 0 and last_batch_size(samples, batch_size) == 1]
    if not ending_in_one or len(train_set) == 0:
        return
    with _untouched(module):
        failure = _failure(try_batch, [train_set[0]])
        refused = failure is not None and _failure(try_batch, [train_set[0], train_set[min(1, len(train_set) - 1)]]) is None
    if isinstance(failure, BadSamplesError):
        failure = failure.named("training sample(s) 0")  # the one-sample batch holds sample 0
    refusals, failures = sum_across_ranks(torch.tensor([float(refused), float(failure is not None and not refused)])).tolist()
    if refusals:
        raise ConfigError(_refusal(ending_in_one, batch_size, failure if refused else None)) from None
    if failure is not None:
        raise failure
    if failures:
        raise PeerFailureError(f"rank {env.rank}: another rank's training step failed on a one-sample batch before training (see there)")


def _failure(try_batch: Callable[[Any], Any], samples: list[Any]) -> Exception | None:
    try:
        try_batch(default_collate(samples))
    except Exception as error:  # the real batch would fail the same way, an epoch in
        return error
    return None


@contextlib.contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Every buffer of ``module`` (its tensor and its value: running statistics, counters) and
    every random stream as they were, however the forward updated, replaced or added them."""
    rng = capture_rng()
    saved = [(name, buffer, buffer.detach().clone()) for name, buffer in module.named_buffers(remove_duplicate=False)]
    try:
        yield
    finally:
        kept = {name for name, _, _ in saved}
        for name, _ in list(module.named_buffers(remove_duplicate=False)):
            if name not in kept:
                owner, _, leaf = name.rpartition(".")
                delattr(module.get_submodule(owner), leaf)
        with torch.no_grad():
            for name, buffer, value in saved:
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, buffer)
                buffer.copy_(value)
        restore_rng(rng)


def _refusal(epoch_samples: Sequence[int], batch_size: int, error: Exception | None) -> str:
    sizes = batch_sizes_avoiding_one(epoch_samples, batch_size)
    remedy = (
        f"use a batch size of {' or '.join(map(str, sizes))} (data.batch_size), which leaves more"
        if sizes
        else "give the training set more than one sample per process"
    )
    why = "" if error is None else f" ({type(error).__name__}: {next(iter(str(error).strip().splitlines()), '')})"
    counts = " and ".join(map(str, sorted(set(epoch_samples))))
    return (
        f"the last training batch of an epoch would hold 1 sample ({counts} samples per process in batches of {batch_size}), "
        f"and the training step fails on one sample{why} though it runs on two; {remedy}"
    )
