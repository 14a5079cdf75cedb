"""Side-by-side timing: alternate the two contenders, warm up, report medians and the spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

SIZES = ("smoke", "quick", "full")


@dataclass(frozen=True)
class Budget:
    """How much work a run may spend: ``smoke`` (checks the code runs; numbers meaningless), ``quick``, ``full``."""

    size: str = "quick"

    def pick(self, smoke, quick, full):
        return {"smoke": smoke, "quick": quick, "full": full}[self.size]


@dataclass
class Row:
    """One comparison. ``ratio`` > 1 always means ampddp is better."""

    name: str
    ampddp: float
    baseline: float
    unit: str
    ratio: float
    repeats: int
    spread: float
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median of per-repeat time ratios theirs/ours (> 1: ours faster); both sides of a repeat ran
    back to back, so a slow moment of the machine hits both and cancels out."""
    return statistics.median(t / o for o, t in zip(ours, theirs))


def spread(times: list[float]) -> float:
    """(max - min) / median: how much repeats of one side disagree."""
    middle = statistics.median(times)
    return (max(times) - min(times)) / middle if middle else 0.0


def adamw_losses(model: torch.nn.Module, batches: Iterable[Any], loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]) -> list[float]:
    """The losses of ``model`` trained by AdamW (lr 1e-3) on ``batches`` in fp32, in one process: the reference the
    parallel layouts' loss curves are held against."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def held_bytes(run: Any) -> int:
    """Bytes of a prepared run's parameters (and masters), gradients and optimizer state on this rank, each storage once
    (a DTensor's local shard): the training state a layout leaves each rank."""
    seen: set[int] = set()
    total = 0
    stepped = [param for group in run.optimizer.param_groups for param in group["params"]]
    tensors = [*run.module.parameters(), *stepped, *(p.grad for p in stepped if p.grad is not None)]
    tensors += [value for entry in run.optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor)]
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        pointer = local.untyped_storage().data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            total += local.untyped_storage().nbytes()
    return total


def timed(fn: Callable[[], None]) -> float:
    """Wall time of ``fn``, including the GPU work it queued (CUDA runs asynchronously)."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def side_by_side(name: str, ours: Callable[[], None], theirs: Callable[[], None], *, repeats: int, warmup: int = 1,
                 per: float = 1.0, unit: str = "ms/step", throughput: bool = False, note: str = "") -> Row:  # fmt: skip
    """Time ``ours`` and ``theirs`` alternately; values are per ``per`` items (steps, bytes, ...).

    ``throughput``: report items per second (higher is better) instead of time per item. The ratio
    is ``paired_ratio`` (on a shared 2-core machine single timings move by ±10%).
    """
    for _ in range(warmup):
        ours()
        theirs()
    a, b = [], []
    for index in range(repeats):
        first, second = (ours, theirs) if index % 2 == 0 else (theirs, ours)
        t_first, t_second = timed(first), timed(second)
        (a if first is ours else b).append(t_first)
        (b if first is ours else a).append(t_second)
    ours_s, theirs_s = statistics.median(a), statistics.median(b)
    ratio, disagreement = paired_ratio(a, b), spread(a)
    if throughput:
        return Row(name, per / ours_s, per / theirs_s, unit, ratio, repeats, disagreement, note)
    scale = 1000.0 / per if unit.startswith("ms") else 1.0 / per
    return Row(name, ours_s * scale, theirs_s * scale, unit, ratio, repeats, disagreement, note)
