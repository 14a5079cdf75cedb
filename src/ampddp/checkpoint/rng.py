"""Random-number-generator state of one process as plain data (tensors, ints, tuples)."""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) CUDA generator states."""
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``; CUDA states are restored for as many devices as both sides have."""
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    saved = state["numpy"]
    numpy.random.set_state(
        (saved["kind"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def derive_rng(seed: int, rank: int, step: int) -> None:
    """Seed every generator for a rank that has no saved state (a resume on more processes)."""
    value = (seed * 1_000_003 + rank * 7919 + step) % 2**32
    random.seed(value)
    numpy.random.seed(value)
    torch.manual_seed(value)
