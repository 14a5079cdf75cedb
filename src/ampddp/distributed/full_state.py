"""Whole-tensor views of sharded (FSDP2) state, and back: one checkpoint layout for every strategy.

An FSDP2 model's ``state_dict`` and its optimizer's hold DTensor shards. Gathered into whole CPU
tensors they have exactly the layout a DDP or single-process run saves, so a checkpoint resumes
under any strategy and on any number of ranks (the shards are cut again for the live run's mesh).
Gathering is collective: every rank calls it, in the same order (the same model on every rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ampddp.torch_compat import is_dtensor


def plain_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` without a tensor subclass that wraps one tensor of its shape and dtype (torchao's
    fp8-all-gather weights, with or without the scale they may hold beside it), a DTensor's local
    shard included: a checkpoint holds plain tensors, loadable with ``weights_only`` and without the
    library."""
    if is_dtensor(value):
        from torch.distributed.tensor import DTensor

        local = value.to_local()
        inner = plain_tensor(local)
        if inner is local:
            return value
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        inner = [getattr(value, name) for name in names]  # beside the value, e.g. a scale torchao may hold
        same = [tensor for tensor in inner if tensor.shape == value.shape and tensor.dtype == value.dtype]
        if len(same) == 1:
            return plain_tensor(same[0])
    return value


def gathered(state: Any, keep: bool = True) -> Any:
    """``state`` (nested dicts/lists of tensors) with every DTensor replaced by its whole value, on
    the CPU (one tensor on the device at a time); a container without DTensors is returned as it is
    (a module's state keeps its ``_metadata``). ``keep=False``: this rank takes part in each gather
    but keeps no copy (None in its place): only the rank that writes a checkpoint needs one."""
    if is_dtensor(state):
        whole = plain_tensor(state).full_tensor()
        return whole.cpu() if keep else None
    if isinstance(state, dict):
        values = {key: gathered(value, keep) for key, value in state.items()}
        if all(values[key] is value for key, value in state.items()):
            return state
        whole = type(state)(values)
        if hasattr(state, "_metadata"):
            whole._metadata = state._metadata
        return whole
    if isinstance(state, (list, tuple)):
        values = [gathered(value, keep) for value in state]
        return state if all(new is old for new, old in zip(values, state)) else type(state)(values)
    return state


def shard_like(value: Any, live: Any) -> Any:
    """``value`` (a whole tensor) cut as ``live`` is sharded when ``live`` is a DTensor; otherwise ``value``."""
    if not is_dtensor(live) or not isinstance(value, torch.Tensor) or is_dtensor(value):
        return value
    whole = value.to(device=live.device_mesh.device_type, dtype=live.dtype)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, live.device_mesh, live.placements, src_data_rank=None)


def sharded_model_state(state: Mapping[str, Any], live: Mapping[str, Any]) -> Mapping[str, Any]:
    """A whole model state cut as the live model's (``module.state_dict()``) entries are sharded
    (``state`` itself, metadata and all, when nothing is)."""
    if not any(is_dtensor(value) for value in live.values()):
        return state
    return {key: shard_like(value, live.get(key)) for key, value in state.items()}


def sharded_optimizer_state(state: Mapping[str, Any], optimizer: Optimizer) -> Mapping[str, Any]:
    """A whole optimizer state (torch's layout: per-parameter entries by index) with each entry
    shaped like its parameter cut as that (DTensor) parameter is sharded."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not any(is_dtensor(param) for param in params):
        return state
    per_param = {}
    for index, entries in state["state"].items():
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if not is_dtensor(param) or not isinstance(entries, Mapping):
            per_param[index] = entries
            continue
        per_param[index] = {
            name: shard_like(value, param) if isinstance(value, torch.Tensor) and value.shape == param.shape else value
            for name, value in entries.items()
        }
    return {**state, "state": per_param}
