"""``Precision``: a run's precision choice as one object, built once and handed down.

The mode, the implementation, the mode's settings and the registered functions used to cross the
Trainer, the run's set-up and ``prepare`` as four loose arguments each; as one value they are made
once (by a recipe, by a user's code) and every layer below passes the object on. The mode and the
implementation are checked when it is made; the mode's settings when its engine is built (which
settings a mode takes is the engine's knowledge).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ampddp.choices import IMPLS, PRECISION_MODES
from ampddp.errors import ConfigError, choice_error
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.factory import build_engine
from ampddp.precision.registry import OpRegistry


@dataclass(frozen=True)
class Precision:
    """``mode``: O0-O5, native-fp16 or native-bf16. ``impl``: builtin, or apex (NVIDIA apex's own
    amp, where an old build is installed; O-levels only). ``overrides``: apex ``initialize`` keywords
    for O-levels (``loss_scale``, ``keep_batchnorm_fp32``, ...), GradScaler settings for native
    modes. ``registry``: functions registered to run in fp32 / fp16 / the widest input type."""

    mode: str = "O1"
    impl: str = "builtin"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    registry: OpRegistry | None = None

    def __post_init__(self) -> None:
        if self.mode not in PRECISION_MODES:
            raise choice_error("precision mode", self.mode, PRECISION_MODES)
        if self.impl not in IMPLS:
            raise choice_error("precision impl", self.impl, IMPLS)
        if not isinstance(self.overrides, Mapping):
            raise ConfigError(f"Precision overrides={self.overrides!r} is not valid; it must be a mapping of setting names to values")
        object.__setattr__(self, "overrides", dict(self.overrides))

    @classmethod
    def of(cls, value: str | Precision) -> Precision:
        """``value`` as a Precision: a mode's name stands for that mode with its defaults."""
        if isinstance(value, Precision):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ConfigError(f"precision={value!r} is not valid; give a mode's name (O0-O5, native-fp16, native-bf16) or a Precision")

    def build_engine(self) -> PrecisionEngine:
        """A fresh engine for this choice (one per set-up: an engine holds its models' state)."""
        return build_engine(self.mode, impl=self.impl, registry=self.registry, **self.overrides)
