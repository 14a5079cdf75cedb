"""Applying saved state: model checks before any change, precision state across modes, imports."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampddp.checkpoint import keys
from ampddp.checkpoint.files import load_safely
from ampddp.errors import CheckpointError
from ampddp.precision.engine import PrecisionEngine

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


def check_optimizer_state(state: Any, optimizer: Any, where: str) -> None:
    """The saved optimizer must have the same parameter groups and sizes as the live one."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or "state" not in state:
        raise CheckpointError(f"{where}: optimizer state is not a torch optimizer state dict")
    saved = [len(group.get("params", [])) for group in groups]
    live = [len(group["params"]) for group in optimizer.param_groups]
    if saved != live:
        raise CheckpointError(
            f"{where}: optimizer has parameter groups of sizes {live}, the checkpoint {saved}: a different model or optimizer set-up"
        )


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


def restore_precision(engine: PrecisionEngine, saved: dict[str, Any], where: str) -> list[str]:
    """Load saved precision state into ``engine``, converting between modes; returns warnings given.

    Same mode: exact restore. Dynamic scale on both sides (e.g. O1 -> native-fp16): scale and
    counters carry over (apex and GradScaler forms convert). Only the target scales (fp32 -> fp16):
    a fresh scaler, with a warning. Only the source scales (fp16 -> bf16/fp32): dropped, with a warning.
    """
    target = engine.state_dict()
    if saved.get("mode") == target["mode"]:
        engine.load_state_dict(saved)
        return []
    source = [s for s in saved.get("scalers", []) if s.get("dynamic", True) and s.get("loss_scale") is not None]
    dynamic = [bool(s.get("dynamic")) for s in target["scalers"]]
    messages = []
    if any(dynamic) and source:
        scalers = [
            dict(source[min(i, len(source) - 1)], dynamic=True) if d else t for i, (t, d) in enumerate(zip(target["scalers"], dynamic))
        ]
        engine.load_state_dict({**target, "scalers": scalers})
        logger.info("%s: loss scale %g carried over from %s to %s", where, source[0]["loss_scale"], saved.get("mode"), target["mode"])
    elif any(dynamic):
        messages.append(
            f"{where}: checkpoint precision mode {saved.get('mode')} had no dynamic loss scale; {target['mode']} starts a fresh scaler "
            f"at {engine.loss_scale():g}"
        )
    elif source:
        messages.append(f"{where}: dropping the loss scale of {saved.get('mode')}: {target['mode']} does not scale the loss")
    for message in messages:
        logger.warning(message)
    return messages


def initial_weights(path: str | Path) -> dict[str, Any]:
    """Model weights from an ampddp checkpoint file, an apex-era ``{"model", "optimizer", "amp"}`` dict,
    or a plain ``torch.save(model.state_dict())`` file — for starting a new run from them."""
    state = load_safely(Path(path))
    if keys.MODEL in state and isinstance(state[keys.MODEL], dict):
        return state[keys.MODEL]
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    raise CheckpointError(
        f"{path}: no model weights found; expected an ampddp checkpoint, a dict with a 'model' entry (apex layout) "
        f"or a plain state dict of tensors (top-level keys: {sorted(state)[:8]})"
    )
