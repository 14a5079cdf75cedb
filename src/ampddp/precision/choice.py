"""``Precision``: a run's precision choice as one object, built once and handed down.

The mode, the implementation, the mode's settings and the registered functions used to cross the
Trainer, the run's set-up and ``prepare`` as four loose arguments each; as one value they are made
once (by a recipe, by a user's code) and every layer below passes the object on. All of it is checked
when it is made: which settings a mode takes is its row's to say (``ampddp.precision.modes.check_settings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ampddp.choices import AUTO_PRECISION, IMPLS, PRECISION_CHOICES
from ampddp.errors import ConfigError, choice_error
from ampddp.precision.auto import auto_choice
from ampddp.precision.casting.registry import OpRegistry
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.modes import MODES, ModeSpec, check_settings


@dataclass(frozen=True)
class Precision:
    """``mode``: ``auto`` (the fastest numerically safe mode of the device: see ``ampddp.precision.auto``;
    ``resolved(device)`` names it), O0-O6, native-fp16 or native-bf16. ``impl``: builtin, or apex (NVIDIA apex's own
    amp, where an old build is installed; O-levels only). ``overrides``: apex ``initialize`` keywords
    for O-levels (``loss_scale``, ``keep_batchnorm_fp32``, ...), GradScaler settings for native
    modes. ``registry``: functions registered to run in fp32 / fp16 / the widest input type.
    ``fp32_islands``: under FSDP2, whether O2/O5 run apex's fp32-list ops in fp32 (None: yes; False:
    apex's pure O2/O5); refused where it decides nothing (other modes, or no FSDP2). ``resumed_mode``:
    with ``auto``, the concrete mode of the checkpoint the run resumes, which ``auto`` keeps where the
    device can run it (set by :meth:`continuing`)."""

    mode: str = AUTO_PRECISION
    impl: str = "builtin"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    registry: OpRegistry | None = None
    fp32_islands: bool | None = None
    resumed_mode: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in PRECISION_CHOICES:
            raise choice_error("precision mode", self.mode, PRECISION_CHOICES)
        if self.impl not in IMPLS:
            raise choice_error("precision impl", self.impl, IMPLS)
        if not isinstance(self.overrides, Mapping):
            raise ConfigError(f"Precision overrides={self.overrides!r} is not valid; it must be a mapping of setting names to values")
        if self.fp32_islands not in (None, True, False):
            raise ConfigError(f"fp32_islands={self.fp32_islands!r} is not valid; valid: true, false, or null (on under FSDP2)")
        if self.resumed_mode is not None and (self.mode != AUTO_PRECISION or self.resumed_mode not in CONCRETE_MODES):
            raise ConfigError(
                f"resumed_mode={self.resumed_mode!r} with mode {self.mode} is not valid; it goes with mode auto and names "
                f"the mode a checkpoint trained in: {', '.join(CONCRETE_MODES)}"
            )
        object.__setattr__(self, "overrides", dict(self.overrides))
        extras = ["registered functions (float/half/promote)"] if self.registry is not None and self.registry.entries() else []
        extras += [f"fp32_islands={self.fp32_islands}"] if self.fp32_islands is not None else []
        check_settings(self.mode, self.overrides, self.impl, extras=extras)

    def continuing(self, mode: str | None) -> Precision:
        """``auto`` resuming a checkpoint that trained in ``mode`` (None: one that does not say)."""
        return replace(self, resumed_mode=mode) if self.mode == AUTO_PRECISION else self

    def resolved(self, device: torch.device) -> Precision:
        """This choice on ``device``: ``auto`` becomes the mode it runs there (see :func:`auto_choice`),
        any other mode is itself, refused where the device cannot run it (bf16 on a GPU before compute
        capability 8.0, fp8 before 8.9) with what works there."""
        if self.mode == AUTO_PRECISION:
            return replace(self, mode=auto_choice(device, self.resumed_mode)[0], resumed_mode=None)
        refusal = self.spec.unsupported(device)
        if refusal is not None:
            raise ConfigError(refusal)
        return self

    @classmethod
    def of(cls, value: str | Precision) -> Precision:
        """``value`` as a Precision: a mode's name stands for that mode with its defaults."""
        if isinstance(value, Precision):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ConfigError(f"precision={value!r} is not valid; give a mode's name (auto, O0-O6, native-fp16, native-bf16) or a Precision")

    @property
    def spec(self) -> ModeSpec:
        """The mode table's row of this (resolved) mode."""
        self._refuse_unresolved()
        return MODES[self.mode]

    def build_engine(self) -> PrecisionEngine:
        """A fresh engine for this choice (one per set-up: an engine holds its models' state)."""
        spec = self.spec
        if self.fp32_islands is not None:
            raise ConfigError(
                f"fp32_islands={self.fp32_islands} applies only under a sharding strategy, fsdp2 or hsdp (O2/O5 there); "
                "without FSDP2, O2/O5 follow apex (model cast, no op lists): for fp32 islands use O1 (float16) or O4 (bfloat16)"
            )
        return spec.build_engine(self.impl, self.registry, **self.overrides)

    def build_sharded_engine(self) -> PrecisionEngine:
        """A fresh engine for a model FSDP2 shards (what each mode does there: :meth:`ModeSpec.build_sharded_engine`)."""
        spec = self.spec
        if self.impl != "builtin":
            raise ConfigError(
                f"precision impl={self.impl} cannot shard: NVIDIA apex's amp predates FSDP2; use impl builtin with strategy fsdp2 or hsdp"
            )
        return spec.build_sharded_engine(self.registry, self.fp32_islands, **self.overrides)

    def _refuse_unresolved(self) -> None:
        if self.mode == AUTO_PRECISION:
            raise ConfigError("precision mode auto is decided per device: build the engine of precision.resolved(device)")


CONCRETE_MODES = tuple(MODES)
"""The modes a run trains in (what ``auto`` resolves to)."""
