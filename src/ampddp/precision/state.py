"""The typed precision state every engine saves and loads, and its conversion between modes.

Checkpoints, ``ampddp inspect`` and the ``amp`` facade read precision state through
:class:`PrecisionState` only, so the three engines (opt-level, native, apex) share one shape.
``PrecisionState.from_dict`` reads every form ever saved: ampddp's engine form (with or without a
``version``), apex's ``amp.state_dict()`` (``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``)
and a ``torch.amp.GradScaler`` state dict.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ampddp.errors import ConfigError

STATE_VERSION = 2
"""The newest ``version`` ``PrecisionState.to_dict`` writes and this ampddp reads: 2 for a state with
fp8 layers (O6), so that an older ampddp says it was written by a newer one; 1 otherwise (states
without a version, from before versioning, read as 1)."""
APEX_KEYS = ("loss_scale", "unskipped")
GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_COUNTERS = ("skipped_steps", "consecutive_skips", "hysteresis_left")
_SCALER_KEYS = ("dynamic", *APEX_KEYS, *_COUNTERS)
_STATE_KEYS = ("version", "mode", "impl", "policy", "scalers", "skipped_steps", "fp8_layers")
_APEX_KEY = re.compile(r"loss_scaler(\d+)")
_FORMS = (
    f"ampddp's engine form {{'mode': ..., 'scalers': [...]}}, apex's amp.state_dict() form "
    f"{{'loss_scaler0': {{'loss_scale': ..., 'unskipped': ...}}, ...}} or a torch GradScaler state {list(GRAD_SCALER_KEYS)}"
)


def _number(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ConfigError(f"{what}={value!r} is not valid; it must be a finite number > 0")


def _counter(value: Any, what: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() and value >= 0:
        return int(value)
    raise ConfigError(f"{what}={value!r} is not valid; it must be a whole number >= 0")


def _optional(state: Mapping[str, Any], key: str, where: str) -> int | None:
    return None if state.get(key) is None else _counter(state[key], f"{where}: {key}")


@dataclass(frozen=True, kw_only=True)
class ScalerState:
    """One loss scaler's saved state. ``None`` marks what the saving engine does not track.

    ``dynamic`` None: unknown (apex's form does not say; a GradScaler state reads as dynamic, since
    only an enabled GradScaler has one); a conversion treats such a saved scale as dynamic, apex's
    default. Counters None load as a fresh scaler's.
    """

    dynamic: bool | None = None
    loss_scale: float
    unskipped: int = 0
    """Good steps since the scale last changed (GradScaler's ``_growth_tracker``)."""
    skipped_steps: int | None = None
    consecutive_skips: int | None = None
    hysteresis_left: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data, only the fields the saving engine tracks (as each engine wrote them before)."""
        values = {"dynamic": self.dynamic, "loss_scale": self.loss_scale, "unskipped": self.unskipped}
        values.update({key: getattr(self, key) for key in _COUNTERS})
        return {key: value for key, value in values.items() if value is not None}

    @classmethod
    def from_dict(cls, state: Any, where: str = "loss scaler state") -> ScalerState:
        """Read ampddp/apex form (``loss_scale``, ``unskipped``, ...) or GradScaler form (``scale``, ``_growth_tracker``)."""
        if not isinstance(state, Mapping):
            raise ConfigError(f"{where} must be a dict, got {type(state).__name__}")
        if "loss_scale" in state:
            scale, counter, known = state["loss_scale"], state.get("unskipped", 0), _SCALER_KEYS
        elif "scale" in state:
            scale, counter, known = state["scale"], state.get("_growth_tracker", 0), GRAD_SCALER_KEYS
        else:
            raise ConfigError(
                f"{where} has keys {sorted(map(str, state))}; expected apex form {list(APEX_KEYS)} "
                f"or torch GradScaler form {list(GRAD_SCALER_KEYS)}"
            )
        unknown = [key for key in state if key not in known]
        if unknown:
            raise ConfigError(f"{where}: key {unknown[0]!r} is not a loss scaler field; valid: {', '.join(known)}")
        dynamic = state.get("dynamic", True if known is GRAD_SCALER_KEYS else None)
        if dynamic is not None and not isinstance(dynamic, bool):
            raise ConfigError(f"{where}: dynamic={dynamic!r} is not valid; valid: True or False")
        return cls(
            dynamic=dynamic,
            loss_scale=_number(scale, f"{where}: loss scale"),
            unskipped=_counter(counter, f"{where}: unskipped/_growth_tracker"),
            skipped_steps=_optional(state, "skipped_steps", where),
            consecutive_skips=_optional(state, "consecutive_skips", where),
            hysteresis_left=_optional(state, "hysteresis_left", where),
        )


@dataclass(frozen=True)
class PrecisionState:
    """An engine's loss-scaling state: its mode, one ``ScalerState`` per loss, skipped steps.

    ``mode``/``impl`` are None for states that do not name them (apex's and GradScaler's forms).
    ``policy`` is the opt level's settings (``PrecisionPolicy.describe()``), kept for ``inspect``;
    ``fp8_layers`` the linear layers O6 runs in fp8 (what its set-up decided, for ``inspect`` too).
    """

    mode: str | None
    scalers: tuple[ScalerState, ...] = ()
    skipped_steps: int = 0
    impl: str | None = None
    policy: dict[str, Any] | None = field(default=None, hash=False)
    fp8_layers: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint form (``PrecisionEngine.state_dict``), tagged with its version (``STATE_VERSION``)."""
        out: dict[str, Any] = {"version": STATE_VERSION if self.fp8_layers else 1, "mode": self.mode}
        if self.impl is not None:
            out["impl"] = self.impl
        if self.policy is not None:
            out["policy"] = dict(self.policy)
        out["scalers"] = [scaler.to_dict() for scaler in self.scalers]
        out["skipped_steps"] = self.skipped_steps
        if self.fp8_layers:
            out["fp8_layers"] = list(self.fp8_layers)
        return out

    def to_apex_dict(self) -> dict[str, dict[str, Any]]:
        """apex's ``amp.state_dict()`` form: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``."""
        return {f"loss_scaler{i}": {"loss_scale": s.loss_scale, "unskipped": s.unskipped} for i, s in enumerate(self.scalers)}

    @classmethod
    def from_dict(cls, state: Any, where: str = "precision state") -> PrecisionState:
        """Validate and read any saved form (see the module doc); ``where`` starts every error message."""
        if not isinstance(state, Mapping):
            raise ConfigError(f"{where} must be a dict, got {type(state).__name__}")
        if not state:
            raise ConfigError(f"{where} is empty; expected {_FORMS}")
        if any(key in state for key in ("mode", "scalers", "version")):
            return cls._from_engine_form(state, where)
        if "scale" in state:
            scaler = ScalerState.from_dict(state, where)
            return cls(mode=None, scalers=(scaler,))
        return cls._from_apex_form(state, where)

    @classmethod
    def _from_engine_form(cls, state: Mapping[str, Any], where: str) -> PrecisionState:
        _check_engine_form_header(state, where)
        policy = state.get("policy")
        raw = state.get("scalers")
        if not isinstance(raw, list):
            found = "missing" if "scalers" not in state else f"a {type(raw).__name__}"
            raise ConfigError(f"{where}: scalers is {found}; expected a list of loss scaler states (empty when not scaling)")
        scalers = tuple(ScalerState.from_dict(s, f"{where}: scalers[{i}]") for i, s in enumerate(raw))
        if state.get("skipped_steps") is None:
            skipped = sum(s.skipped_steps or 0 for s in scalers)
        else:
            skipped = _counter(state["skipped_steps"], f"{where}: skipped_steps")
        layers = state.get("fp8_layers", [])
        if not isinstance(layers, (list, tuple)) or not all(isinstance(name, str) for name in layers):
            raise ConfigError(f"{where}: fp8_layers={str(layers)[:80]} is not valid; it must be a list of layer names")
        return cls(
            mode=state.get("mode"),
            impl=state.get("impl"),
            policy=None if policy is None else dict(policy),
            scalers=scalers,
            skipped_steps=skipped,
            fp8_layers=tuple(layers),
        )

    @classmethod
    def _from_apex_form(cls, state: Mapping[str, Any], where: str) -> PrecisionState:
        indexed = {}
        for key in state:
            match = _APEX_KEY.fullmatch(str(key))
            if match is None:
                raise ConfigError(f"{where}: key {key!r} is not a loss scaler; expected {_FORMS}")
            indexed[int(match.group(1))] = state[key]
        if sorted(indexed) != list(range(len(indexed))):
            names = ", ".join(f"loss_scaler{i}" for i in sorted(indexed))
            raise ConfigError(f"{where} has scalers {names}; apex numbers them loss_scaler0, loss_scaler1, ... without gaps")
        scalers = tuple(ScalerState.from_dict(indexed[i], f"{where}: loss_scaler{i}") for i in range(len(indexed)))
        return cls(mode=None, scalers=scalers)


def _check_engine_form_header(state: Mapping[str, Any], where: str) -> None:
    """The engine form's own fields: known keys only, a version this ampddp reads, string mode and impl, a dict policy."""
    unknown = [key for key in state if key not in _STATE_KEYS]
    if unknown:
        raise ConfigError(f"{where}: key {unknown[0]!r} is not a precision state field; valid: {', '.join(_STATE_KEYS)}")
    version = _counter(state.get("version", STATE_VERSION), f"{where}: version")
    if version > STATE_VERSION:
        raise ConfigError(
            f"{where}: version={version} was written by a newer ampddp; this one reads precision state up to version {STATE_VERSION}"
        )
    for key in ("mode", "impl"):
        if state.get(key) is not None and not isinstance(state[key], str):
            raise ConfigError(f"{where}: {key}={state[key]!r} is not valid; it must be a string (e.g. 'O1', 'native-fp16')")
    policy = state.get("policy")
    if policy is not None and not isinstance(policy, Mapping):
        raise ConfigError(f"{where}: policy must be a dict of opt-level settings, got {type(policy).__name__}")


@dataclass(frozen=True)
class Conversion:
    """What resuming a saved state under an engine gives: the state to load (None: keep the
    engine's fresh one) and what to tell the user (``note`` at info level, ``warning`` as a warning)."""

    state: PrecisionState | None
    note: str | None = None
    warning: str | None = None


def convert(saved: PrecisionState, target: PrecisionState) -> Conversion:
    """Resume ``saved`` under an engine whose current (fresh) state is ``target``.

    Same mode: exact restore. A dynamic scale on both sides (e.g. O1 -> native-fp16): scale and
    counters carry over, target scaler ``i`` from saved scaler ``i`` (or the last one). Only the
    target scales (fp32 -> fp16): a fresh scaler, with a warning. Only the saved state scales
    (fp16 -> bf16/fp32): its scale is dropped, with a warning.
    """
    if saved.mode == target.mode:
        return Conversion(saved)
    source = [s for s in saved.scalers if s.dynamic is not False]
    dynamic = [s.dynamic is True for s in target.scalers]
    before = saved.mode or "unnamed (an apex or GradScaler scaler state)"
    if any(dynamic) and source:
        scalers = tuple(
            replace(source[min(i, len(source) - 1)], dynamic=True) if is_dynamic else own
            for i, (own, is_dynamic) in enumerate(zip(target.scalers, dynamic))
        )
        return Conversion(
            replace(target, scalers=scalers), note=f"loss scale {source[0].loss_scale:g} carried over from {before} to {target.mode}"
        )
    if any(dynamic):
        return Conversion(
            None,
            warning=f"checkpoint precision mode {before} had no dynamic loss scale; {target.mode} starts a fresh scaler "
            f"at {target.scalers[0].loss_scale:g}",
        )
    if source:
        return Conversion(None, warning=f"dropping the loss scale of {before}: {target.mode} does not scale the loss")
    return Conversion(None)
