"""apex's amp state (the loss scalers) in and out of a set-up: ``amp.load_state_dict``'s rules, and the
copy each optimizer's ``state_dict()`` carries.

apex kept the loss scale only in ``amp.state_dict()``, so code that checkpoints the optimizer and not
amp (Hugging Face's Trainer, Lightning) resumed from a fresh 2**16 and skipped steps until the scale
backed off to where it had been. A set-up's optimizers therefore carry its amp state under
:data:`OPTIMIZER_STATE_KEY` and restore it when they load a state that has one: such checkpoints
resume with the scale they had. A later ``amp.load_state_dict`` still wins, as in apex's order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ampddp.errors import ConfigError
from ampddp.precision import PrecisionEngine, PrecisionState

OPTIMIZER_STATE_KEY = "ampddp_amp"
"""Where an initialized optimizer's ``state_dict()`` holds its set-up's ``amp.state_dict()``."""


def load_amp_state(engine: PrecisionEngine, state_dict: Mapping[str, Any], where: str = "amp state") -> None:
    """Restore ``engine``'s scalers from apex's format, or (one scaler) a GradScaler state dict; nothing
    changes unless the whole dict is valid, each scale within its scaler's ceiling (a scale past it
    overflowed, and skipped, every step). A scale loaded into a mode that scales nothing is dropped,
    with a warning, as a resumed checkpoint's is."""
    state = PrecisionState.from_dict(state_dict, where=where)
    engine.check_precision_state(state, where)
    own = engine.precision_state().scalers
    if len(state.scalers) != len(own):
        held = "one scaler" if len(state.scalers) == 1 else f"{len(state.scalers)} scalers"
        raise ConfigError(
            f"{where} holds {held} but this amp has {len(own)} (num_losses={len(own)}): expected exactly "
            f"loss_scaler0..loss_scaler{len(own) - 1}"
        )
    unscaled = all(scaler.dynamic is False and scaler.loss_scale == 1.0 for scaler in own)
    scaled = [saved.loss_scale for saved in state.scalers if saved.loss_scale != 1.0]
    if unscaled and scaled:  # as a checkpoint resumed in such a mode drops it (precision.state.convert)
        warnings.warn(
            f"{where}: dropping loss scale {scaled[0]:g} of the loaded state: {engine.mode} does not scale "
            "the loss (the state was saved by a scaled opt level such as O1/O2)",
            stacklevel=3,
        )
        return
    engine.load_precision_state(state)


def carry_amp_state(optimizer: Optimizer, engine: PrecisionEngine, restores: Callable[[], bool]) -> list[RemovableHandle]:
    """Make ``optimizer.state_dict()`` hold ``engine``'s amp state and ``load_state_dict`` restore it
    (after the optimizer's own state loaded: a refused optimizer state changes no scale) while
    ``restores()`` says so. A carried state that does not fit this set-up (another num_losses) leaves
    the scale as it is, with a warning."""
    if not engine.scales_loss:
        return []
    pending: list[Any] = []

    def add(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[OPTIMIZER_STATE_KEY] = engine.precision_state().to_apex_dict()
        return state_dict

    def take(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        pending.clear()
        if OPTIMIZER_STATE_KEY not in state_dict:
            return state_dict
        rest = dict(state_dict)
        pending.append(rest.pop(OPTIMIZER_STATE_KEY))
        return rest

    def restore(optimizer: Optimizer) -> None:
        if not pending:
            return
        saved = pending.pop()
        if not restores():
            return
        try:
            load_amp_state(engine, saved, where="the amp state in optimizer.load_state_dict")
        except ConfigError as error:
            warnings.warn(f"{error}; the loss scale stays as it is", stacklevel=3)

    return [
        optimizer.register_state_dict_post_hook(add),
        optimizer.register_load_state_dict_pre_hook(take),
        optimizer.register_load_state_dict_post_hook(restore),
    ]
