"""A user's model and data set, named from recipes by import path (tests/e2e/test_recipe_parts.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

NOT_CALLABLE = 42


def build(num_classes: int, hidden: int = 16, in_features: int = 64) -> nn.Module:
    """A two-layer MLP over flattened 1 x 8 x 8 images."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def blobs(samples: int = 96, features: int = 8, classes: int = 3, with_eval: bool = True) -> tuple[TensorDataset, TensorDataset | None]:
    """Gaussian blobs (deterministic: every rank builds the same)."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(samples) % classes
    centres = torch.randn(classes, features, generator=generator) * 3
    inputs = centres[labels] + torch.randn(samples, features, generator=generator)
    train = TensorDataset(inputs[: samples * 3 // 4], labels[: samples * 3 // 4])
    held_out = TensorDataset(inputs[samples * 3 // 4 :], labels[samples * 3 // 4 :])
    return train, held_out if with_eval else None


def not_a_pair() -> TensorDataset:
    return TensorDataset(torch.zeros(4, 2))


def chatty_blobs() -> tuple[TensorDataset, TensorDataset | None]:
    """``blobs``, built the way many libraries are: logging an INFO note and a deprecation notice."""
    import logging

    logging.getLogger("somelib").info("somelib: loaded 96 blobs from the cache")
    logging.getLogger("somelib").warning("somelib: calling load() without a version is deprecated")
    return blobs()
