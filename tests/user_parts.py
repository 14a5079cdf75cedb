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
    """``blobs``, built the way many libraries are: logging an INFO note, a deprecation notice and two errors."""
    import logging

    logging.getLogger("somelib").info("somelib: loaded 96 blobs from the cache")
    logging.getLogger("somelib").warning("somelib: calling load() without a version is deprecated")
    for attempt in (1, 2):  # a library's own errors, with their tracebacks (MLflow's with a read-only store, say)
        try:
            raise OSError(f"attempt {attempt}: attempt to write a readonly database")
        except OSError:
            logging.getLogger("somelib.store").exception("somelib: could not record the blobs")
    return blobs()


class _StuckOnRank1(torch.utils.data.Dataset):
    """``inner``, whose loading never returns on rank 1 once it has served ``after`` samples: a data set
    (a network file system, a deadlocked reader) that hangs one rank while its heartbeat goes on."""

    def __init__(self, inner: TensorDataset, after: int) -> None:
        self.inner, self.after, self.served = inner, after, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        import time

        import torch.distributed as dist

        self.served += 1
        if self.served > self.after and dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(3600)
        return self.inner[index]


def stuck_blobs() -> tuple[torch.utils.data.Dataset, None]:
    """``blobs`` for training, stuck on rank 1 after a few batches (tests/distributed/test_peer_failure_exit.py)."""
    train, _ = blobs(samples=400, with_eval=False)
    return _StuckOnRank1(train, after=64), None
