"""Find non-finite values in a state about to be saved, so a poisoned state is never a checkpoint.

A run whose weights, optimizer moments or BatchNorm statistics became inf/NaN must not write them as
its newest complete checkpoint: resume would start from garbage, and retention would delete the
last good checkpoint. The check reads one flag per device on the host; only when it is set does it
walk the state again to name the first offending entry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ampddp.distributed.env import DistEnv
from ampddp.errors import NonFiniteGradientsError


def _float_tensors(state: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() or state.is_complex():
            yield path, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _float_tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _float_tensors(value, f"{path}[{index}]")


def first_non_finite(state: Any) -> str | None:
    """The dotted path of the first float tensor in ``state`` holding inf/NaN, or None if all are finite."""
    entries = list(_float_tensors(state))
    if not entries:
        return None
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for _, tensor in entries:
        flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
    if all(bool(torch.stack(group).all()) for group in flags.values()):
        return None
    for path, tensor in entries:
        if not bool(torch.isfinite(tensor).all()):
            return path
    return None


def refuse_non_finite(state: Mapping[str, Any], step: int, last_saved: int | None, env: DistEnv | None = None) -> None:
    """Raise ``NonFiniteGradientsError`` instead of saving ``state`` (a checkpoint's model, optimizer and
    loss-scaler entries, or what a rank holds of them) when it holds inf/NaN; the newest complete
    checkpoint then stays the last good one. ``env``: each rank checks what it holds (its FSDP2
    shards; gathered tensors: rank 0) and the ranks agree in one all-reduce, so all raise or none."""
    poisoned = first_non_finite(state)
    if env is not None and env.distributed:
        from ampddp.distributed.data import gather_objects, sum_across_ranks

        if int(sum_across_ranks(float(poisoned is not None)).item()):  # then every rank names the first one found
            found = [f"{name} (rank {rank})" for rank, name in enumerate(gather_objects(poisoned, env)) if name is not None]
            raise non_finite_error(found[0], step, last_saved)
    elif poisoned is not None:
        raise non_finite_error(poisoned, step, last_saved)


def non_finite_error(poisoned: str, step: int, last_saved: int | None) -> NonFiniteGradientsError:
    """The refusal to save a state whose entry ``poisoned`` holds inf/NaN."""
    last = f"step {last_saved}" if last_saved else "none yet"
    return NonFiniteGradientsError(
        f"{poisoned} is inf/NaN at step {step}, so no checkpoint was written (the newest complete checkpoint, "
        f"{last}, stays the last good one); lower the learning rate or check that module's inputs"
    )
