"""Resuming with other settings than the checkpoint was trained with: say what changed, refuse what
would silently make it a different run.

Every checkpoint carries the run's config. At resume, the keys whose values differ are listed in
one warning. Keys that define the run — the model, the data set (a user's: with its kwargs), its
split (the eval fraction and the seed that draws it), the image size and the input normalisation — are refused unless
``checkpoint.allow_changes`` is true: continuing a ResNet on a different training split is not a
resume but a new experiment.
Everything else (learning rate, horizon, batch size, precision, ...) is a deliberate change that
the trainer applies (see ``ampddp.training.resume.schedule_plan``).

``data.normalize`` is compared as the normalisation it selects (null: the data set's default), and
a checkpoint written before the key existed counts as what its data set did then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ampddp.errors import ConfigError
from ampddp.zoo.data import resolve_normalize

RUN_DEFINING = (
    "model.",
    "data.name",
    "data.kwargs",
    "data.root",
    "data.image_size",
    "data.channels",
    "data.normalize",
    "data.eval_fraction",
    "trainer.seed",
)
"""Keys (or section prefixes ending in '.') whose change makes the run a different one."""
HOW_TO_RESUME = ("checkpoint.resume", "checkpoint.resume_from", "checkpoint.allow_changes", "checkpoint.init_from", "checkpoint.layout",
                 "trainer.run_dir")  # fmt: skip
"""Keys that say where and how to resume (or how checkpoints are written), not what to train: never reported."""
ALLOW_KEY = "checkpoint.allow_changes"
NORMALIZE_KEY = "data.normalize"


@dataclass(frozen=True)
class Setting:
    """A setting compared as what it does (``value``) and shown as written (``shown``): a null that
    stands for a data set's default, or a key an older checkpoint lacks. ``advice`` goes into a refusal."""

    value: Any
    shown: str
    advice: str = ""

    def __repr__(self) -> str:
        return self.shown


BEFORE_NORMALIZE = {
    "imagefolder": Setting(
        "none",
        "(absent: no normalisation, written before ampddp normalised inputs)",
        "its model learned from unnormalised inputs in [0, 1], which no data.normalize value gives",
    ),
    "cifar10": Setting(
        "computed", "(absent: the training split's per-channel statistics, as 'computed'; written before data.normalize existed)"
    ),
}
"""data.name -> what a checkpoint without data.normalize (written before the key existed) fed its
model: imagefolder [0, 1] pixels, cifar10 standardised with the training split's statistics
(what 'computed' does). digits and a user's data set never took the key: no entry."""


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    current: Any

    @property
    def defines_run(self) -> bool:
        return any(self.key.startswith(prefix) if prefix.endswith(".") else self.key == prefix for prefix in RUN_DEFINING)

    def __str__(self) -> str:
        return f"{self.key} {self.saved!r} -> {self.current!r}"


def _flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, Mapping):
            flat.update({f"{section}.{key}": value for key, value in values.items()})
        else:
            flat[str(section)] = values
    return flat


def _resolve_normalize(flat: dict[str, Any]) -> dict[str, Any]:
    """data.normalize as the normalisation it selects, so a null and the default it stands for are no change."""
    if NORMALIZE_KEY not in flat:
        return flat
    name, written = flat.get("data.name"), flat[NORMALIZE_KEY]
    name = name if isinstance(name, str) else ""
    resolved = resolve_normalize(name, written)
    if resolved != written:
        shown = f"null ({name}'s default, {resolved!r})" if written is None else f"{written!r} (unused by {name})"
        flat[NORMALIZE_KEY] = Setting(resolved, shown)
    return flat


def _add_before_normalize(old: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint written before data.normalize existed gets what its data set did then."""
    name = old.get("data.name")
    if NORMALIZE_KEY not in old and NORMALIZE_KEY in new and isinstance(name, str) and name in BEFORE_NORMALIZE:
        old[NORMALIZE_KEY] = BEFORE_NORMALIZE[name]
    return old


def config_changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[Change]:
    """Every setting whose value differs, in key order. A key the checkpoint does not have (written
    by an older ampddp, before the key existed) is not a change, except ``data.normalize``: it
    counts as what the data set did to its inputs before the key (``BEFORE_NORMALIZE``)."""
    if not isinstance(saved, Mapping) or not isinstance(current, Mapping) or not saved or not current:
        return []
    new = _resolve_normalize(_flatten(current))
    old = _add_before_normalize(_resolve_normalize(_flatten(saved)), new)
    return [
        Change(key, old[key], new[key])
        for key in sorted(new)
        if key in old and key not in HOW_TO_RESUME and _normal(old[key]) != _normal(new[key])
    ]


def _normal(value: Any) -> Any:
    """Lists and tuples compare alike (a config read back from a checkpoint may hold either); a
    ``Setting`` as its value."""
    if isinstance(value, Setting):
        return _normal(value.value)
    return [_normal(v) for v in value] if isinstance(value, (list, tuple)) else value


def check_resume_settings(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None, where: str) -> str | None:
    """The one warning line for a resume with changed settings (None when nothing changed).

    Raises ``ConfigError`` naming the keys when a run-defining one changed and
    ``checkpoint.allow_changes`` is not true.
    """
    changes = config_changes(saved, current)
    if not changes:
        return None
    defining = [change for change in changes if change.defines_run]
    allowed = bool(_flatten(current or {}).get(ALLOW_KEY, False))
    if defining and not allowed:
        advice = "".join(f" ({change.saved.advice})" for change in defining if isinstance(change.saved, Setting) and change.saved.advice)
        raise ConfigError(
            f"cannot resume {where} with {', '.join(map(str, defining))}: the model, the data set, its split, the image size or the "
            f"input normalisation would differ from what the checkpoint was trained on{advice}, so this would be a different run; "
            f"use another trainer.run_dir "
            f"(checkpoint.init_from={where} starts a fresh run from these weights) or set {ALLOW_KEY}=true to resume anyway"
        )
    return f"resuming {where} with changed settings: " + "; ".join(map(str, changes))
