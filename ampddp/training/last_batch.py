"""A last training batch of one sample, tried before training instead of found at the end of epoch 1.

An epoch of N samples per rank in batches of B ends with a batch of N % B samples. When that is one,
BatchNorm on (N, C) features raises "Expected more than 1 value per channel when training" — after
a whole epoch, hours into a run that then fails the same way at every resume. When (and only when)
the sizes give such a batch, the model's forward runs once on one sample at the start, with every
buffer and random stream it touches restored, and a failure becomes one line naming batch sizes
that avoid it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ampddp.checkpoint.rng import capture_rng, restore_rng
from ampddp.errors import ConfigError
from ampddp.training.batches import BatchAdapter


def last_batch_size(samples: int, batch_size: int) -> int:
    """Samples in an epoch's last batch (a full batch when ``batch_size`` divides ``samples``)."""
    return samples % batch_size or min(samples, batch_size)


def batch_sizes_avoiding_one(samples: int, batch_size: int) -> list[int]:
    """The nearest batch sizes below and above ``batch_size`` whose last batch is not a single
    sample (none when ``samples`` is 1: every batch size leaves one)."""
    if samples < 2:
        return []
    below = [b for b in range(batch_size - 1, 1, -1) if last_batch_size(samples, b) != 1][:1]
    above = next(b for b in range(batch_size + 1, samples + 2) if last_batch_size(samples, b) != 1)
    return [*below, above]


def check_single_sample_batch(
    module: nn.Module,
    train_set: Dataset,
    epoch_samples: Iterable[int],
    batch_size: int,
    batches: BatchAdapter,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager[Any]],
) -> None:
    """Raise ConfigError when an epoch of ``epoch_samples`` per rank (the resumed one, a full one)
    ends in a batch of one sample and ``module`` cannot train on one.

    Every rank has the same sizes, so every rank probes (a synchronised BatchNorm's collectives match).
    """
    samples_per_rank = next((n for n in epoch_samples if n > 0 and last_batch_size(n, batch_size) == 1), None)
    if samples_per_rank is None or len(train_set) == 0:
        return
    rng = capture_rng()
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]  # running statistics, counters
    was_training = module.training
    try:
        batch = batches.to_device(default_collate([train_set[0]]), device)
        module.train()
        with forward_context():
            batches.forward(module, batch)
    except Exception as error:  # the real last batch would fail the same way, an epoch in
        raise ConfigError(_refusal(samples_per_rank, batch_size, error)) from None
    finally:
        module.train(was_training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        restore_rng(rng)


def _refusal(samples: int, batch_size: int, error: Exception) -> str:
    first_line = next(iter(str(error).strip().splitlines()), "")
    sizes = batch_sizes_avoiding_one(samples, batch_size)
    remedy = (
        f"use a batch size of {' or '.join(map(str, sizes))} (data.batch_size), which leaves more"
        if sizes
        else "give the training set more than one sample per process"
    )
    return (
        f"the last training batch of every epoch would hold 1 sample ({samples} samples per process in batches of {batch_size}), "
        f"and the model's forward fails on one ({type(error).__name__}: {first_line}); {remedy}"
    )
