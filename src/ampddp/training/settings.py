"""How the loop runs (batch size, accumulation, clipping, horizon, cadences): one frozen, checked value."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ampddp.choices import FLOAT32_MAX, INT64_MAX
from ampddp.errors import ConfigError, shown

_REQUIRED_COUNTS = ("batch_size", "grad_accum_steps", "max_epochs", "log_every", "max_nonfinite_losses")
_OPTIONAL_COUNTS = ("max_steps", "checkpoint_every", "eval_every")


@dataclass(frozen=True)
class LoopSettings:
    """The numbers the training loop follows; checked when made, so a bad value fails before any set-up."""

    batch_size: int = 32
    """Samples per micro-batch on each rank."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (gradients synchronised on the last only)."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm (of the unscaled, master gradients) to this; None: no clipping."""
    max_epochs: int = 1
    max_steps: int | None = None
    """Stop after this many optimizer steps (skipped steps count); wins over ``max_epochs`` when set."""
    seed: int = 0
    """Seeds the sample order and every rank's random streams."""
    shuffle: bool = True
    drop_last: bool = False
    checkpoint_every: int | None = None
    """Write a checkpoint every N steps (always one at the end)."""
    eval_every: int | None = None
    """Evaluate every N steps as well as at each epoch end."""
    log_every: int = 10
    """Log a step record (loss, lr, loss scale, gradient norm) every N steps and at every skipped one."""
    max_nonfinite_losses: int = 10
    """Stop after this many consecutive non-finite losses."""

    def __post_init__(self) -> None:
        for name in (*_REQUIRED_COUNTS, *_OPTIONAL_COUNTS):
            _check_count(name, getattr(self, name), optional=name in _OPTIONAL_COUNTS)
        clip = self.clip_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip <= FLOAT32_MAX):
            raise ConfigError(f"clip_grad_norm={clip!r} is not valid; it must be a finite number in (0, {FLOAT32_MAX:g}] or None")
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid; it must be true or false")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -INT64_MAX - 1 <= self.seed <= INT64_MAX:
            raise ConfigError(f"seed={self.seed!r} is not valid; it must be an integer in [{-INT64_MAX - 1}, {INT64_MAX}] (torch's int64)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names (what the convenience ``Trainer`` accepts as keywords)."""
        return tuple(field.name for field in fields(cls))


def _check_count(name: str, value: Any, optional: bool) -> None:
    """A count setting: an integer in [1, INT64_MAX] (or None where ``optional``): torch reads counts as int64."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} is not valid; it must be an integer >= 1{' or None' if optional else ''}")
    if value > INT64_MAX:
        raise ConfigError(f"{name}={shown(value)} is out of range; it must be an integer in [1, {INT64_MAX}] (torch's int64)")
