"""Applying saved state: model checks before any change, precision state across modes, imports."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import load_safely
from ampddp.choices import FLOAT32_MAX
from ampddp.errors import CheckpointError, ConfigError
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.state import Conversion, PrecisionState, convert

logger = logging.getLogger("ampddp.checkpoint")
_SHOW = 5


def _shape(value: Any) -> str:
    return "x".join(map(str, value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def check_model_state(state: Any, module: nn.Module, where: str) -> None:
    """Raise one line naming missing/unexpected keys and shape mismatches, before anything is loaded."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: model state must be a dict of tensors, found {type(state).__name__}")
    expected = module.state_dict()
    missing = [f"{k} ({_shape(v)})" for k, v in expected.items() if k not in state]
    unexpected = [f"{k} ({_shape(v)})" for k, v in state.items() if k not in expected]
    mismatched = [
        f"{k} (checkpoint {_shape(state[k])}, model {_shape(v)})"
        for k, v in expected.items()
        if k in state and isinstance(v, torch.Tensor) and (not isinstance(state[k], torch.Tensor) or state[k].shape != v.shape)
    ]
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched)):
        if items:
            more = f" and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
            problems.append(f"{label}: {', '.join(items[:_SHOW])}{more}")
    if problems:
        raise CheckpointError(f"{where}: checkpoint is for a different model — " + "; ".join(problems))


PARAM_SHAPED_STATE = frozenset(
    {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "acc_delta", "grad_avg", "sum", "prev"}
    | {"step_size", "ax", "master_param"}
)
"""Per-parameter optimizer state that torch's optimizers (and apex's fused ones) keep in the
parameter's shape; other entries (steps, factored moments) and 0-dim values (NovoGrad's per-tensor
norm) are not compared."""


def check_optimizer_state(state: Any, optimizer: Any, where: str) -> None:
    """The saved optimizer must have the same parameter groups and sizes as the live one, and its
    per-parameter state the shapes of the live parameters (else step 1 dies inside the optimizer)."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or "state" not in state:
        raise CheckpointError(f"{where}: optimizer state is not a torch optimizer state dict")
    saved = [len(group.get("params", [])) for group in groups]
    live = [len(group["params"]) for group in optimizer.param_groups]
    if saved != live:
        raise CheckpointError(
            f"{where}: optimizer has parameter groups of sizes {live}, the checkpoint {saved}: a different model or optimizer set-up"
        )
    per_param = state["state"] if isinstance(state["state"], dict) else {}
    for group_index, (group, live_group) in enumerate(zip(groups, optimizer.param_groups)):
        for position, (index, param) in enumerate(zip(group.get("params", []), live_group["params"])):
            name = _misshaped_entry(per_param.get(index), param)
            if name is not None:
                raise CheckpointError(
                    f"{where}: optimizer state {name!r} of parameter {position} in group {group_index} has shape "
                    f"{tuple(per_param[index][name].shape)}, the live parameter {tuple(param.shape)}: the optimizer state of another model"
                )


def _misshaped_entry(entries: Any, param: torch.Tensor) -> str | None:
    """The first of a parameter's saved state entries kept in a parameter's shape but not in ``param``'s."""
    for name, value in entries.items() if isinstance(entries, dict) else ():
        if name in PARAM_SHAPED_STATE and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
            return name
    return None


def check_sampler_state(saved: Any, live: dict[str, Any], where: str) -> None:
    """Resuming with another seed, shuffle or drop_last would skip or repeat samples silently."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where}: sampler state missing or malformed")
    for key in ("seed", "shuffle", "drop_last"):
        if key in saved and saved[key] != live[key]:
            raise CheckpointError(
                f"{where}: the checkpoint's data order used {key}={saved[key]!r}, this run {key}={live[key]!r}; resume with the same value"
            )


def load_model_state(state: Any, module: nn.Module, where: str) -> None:
    check_model_state(state, module, where)
    module.load_state_dict(state)


def precision_conversion(engine: PrecisionEngine, saved: Any, where: str) -> Conversion:
    """What loading saved precision state into ``engine`` would do (``state.convert``), checked and
    changing nothing: a malformed state, one with another number of loss scalers than ``engine``
    keeps, or a scale past its scaler's ceiling, is a CheckpointError naming it."""
    try:
        state = PrecisionState.from_dict(saved, where=f"{where}: its {keys.PRECISION!r} entry is malformed")
    except ConfigError as error:
        raise CheckpointError(str(error)) from None
    live = engine.precision_state()
    conversion = convert(state, live)
    if conversion.state is not None and len(conversion.state.scalers) != len(live.scalers):
        raise CheckpointError(
            f"{where}: its precision state has {len(conversion.state.scalers)} loss scaler(s); {live.mode} here keeps {len(live.scalers)}"
        )
    if conversion.state is not None:
        conversion = _within_ceilings(conversion, engine.loss_scale_ceilings(), live.mode)
        try:
            engine.check_precision_state(conversion.state, where)
        except ConfigError as error:
            raise CheckpointError(str(error)) from None
    return conversion


def _within_ceilings(conversion: Conversion, ceilings: tuple[float, ...], mode: str | None) -> Conversion:
    """A saved finite scale above this run's ceiling (``max_loss_scale`` lowered since) starts at the
    ceiling, with a warning: the setting was changed on purpose. A non-finite or non-positive scale,
    or one past float32's largest, is left for ``check_precision_state`` to refuse."""
    scalers, lowered = [], []
    for index, (saved, ceiling) in enumerate(zip(conversion.state.scalers, ceilings)):
        if ceiling < saved.loss_scale <= FLOAT32_MAX:
            lowered.append(f"loss_scaler{index} {saved.loss_scale:g} -> {ceiling:g}")
            saved = dataclasses.replace(saved, loss_scale=ceiling)
        scalers.append(saved)
    if not lowered:
        return conversion
    said = f"saved loss scale above this {mode} run's max_loss_scale, so it starts there: {', '.join(lowered)}"
    warning = said if conversion.warning is None else f"{conversion.warning}; {said}"
    return dataclasses.replace(conversion, state=dataclasses.replace(conversion.state, scalers=tuple(scalers)), warning=warning)


def apply_precision(engine: PrecisionEngine, conversion: Conversion, where: str) -> list[str]:
    """Load a checked conversion (:func:`precision_conversion`) into ``engine``; returns the warnings given."""
    if conversion.state is not None:
        engine.load_precision_state(conversion.state)
    if conversion.note is not None:
        logger.info("%s: %s", where, conversion.note)
    if conversion.warning is None:
        return []
    message = f"{where}: {conversion.warning}"
    logger.warning(message)
    return [message]


def restore_precision(engine: PrecisionEngine, saved: Any, where: str) -> list[str]:
    """Load saved precision state into ``engine``, converting between modes (``state.convert``);
    returns the warnings given. A malformed state is a CheckpointError naming the bad entry."""
    return apply_precision(engine, precision_conversion(engine, saved, where), where)


SHARED_ENTRIES = ((keys.MODEL, dict, "a dict"), (keys.OPTIMIZER, dict, "a dict"), (keys.PRECISION, dict, "a dict"),
                  (keys.PROGRESS, dict, "a dict"), (keys.SAMPLER, dict, "a dict"), (keys.WORLD_SIZE, int, "an int"))  # fmt: skip
"""The entries every checkpoint's shared file holds, with the type each must have."""


def check_shared_entries(shared: Any, where: str) -> None:
    """Every entry a resume reads is there with its type (the scheduler's a dict or None), before
    anything is loaded: one line naming the first that is not."""
    if not isinstance(shared, dict):
        raise CheckpointError(f"{where}: expected a dict of state, found {type(shared).__name__}")
    for key, kind, expected in SHARED_ENTRIES:
        value = shared.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            found = "missing" if key not in shared else f"a {type(value).__name__}"
            raise CheckpointError(f"{where}: not a complete ampddp checkpoint: its {key!r} entry is {found}, expected {expected}")
    if shared.get(keys.SCHEDULER) is not None and not isinstance(shared[keys.SCHEDULER], dict):
        found = type(shared[keys.SCHEDULER]).__name__
        raise CheckpointError(
            f"{where}: not a complete ampddp checkpoint: its {keys.SCHEDULER!r} entry is a {found}, expected a dict or None"
        )


def initial_weights(path: str | Path) -> dict[str, Any]:
    """Model weights from an ampddp checkpoint (a file, a step folder, or a run dir: its newest
    checkpoint that verifies, read while that run may still be writing and pruning them), an
    apex-era ``{"model", "optimizer", "amp"}`` dict, or a plain ``torch.save(model.state_dict())``
    file — for starting a new run from them."""
    from ampddp.checkpoint.store import CheckpointStore, read_newest

    if Path(path).is_dir():
        state = read_newest(path, lambda ref: CheckpointStore.load_whole(ref, ref.manifest()))
    else:
        state = load_safely(Path(path))
    if state.get(keys.SHARDS) is not None:  # a sharded checkpoint's shared file: its shards hold the weights
        state = read_newest(path, lambda ref: CheckpointStore.load_whole(ref, ref.manifest()))
    if keys.MODEL in state and isinstance(state[keys.MODEL], dict):
        return state[keys.MODEL]
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    raise CheckpointError(
        f"{path}: no model weights found; expected an ampddp checkpoint, a dict with a 'model' entry (apex layout) "
        f"or a plain state dict of tensors (top-level keys: {sorted(state)[:8]})"
    )
