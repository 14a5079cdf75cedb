"""Loss scaling with apex's dynamic semantics, fused unscaling and skipped-step accounting.

Dynamic: start at min(2**16, max_scale) (or ``init_scale``); an overflow skips the step and, once
``hysteresis`` overflows have been seen, multiplies the scale by ``backoff_factor`` (never below
``min_scale``); ``growth_interval`` consecutive good updates multiply it by ``growth_factor`` (never
above ``max_scale``). Static: a fixed scale, no overflow check, no skipping — as in apex.

Unlike apex (issue 318), a scale that has backed off to its floor while every step still overflows
raises ``NonFiniteGradientsError`` instead of skipping forever: at that point the forward pass or
the loss itself produces inf/NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ampddp.errors import ConfigError, NonFiniteGradientsError
from ampddp.precision.policy import PrecisionPolicy
from ampddp.precision.shards import locals_of
from ampddp.precision.state import ScalerState

DEFAULT_FLOOR = 2.0**-24
"""Lowest dynamic scale without a ``min_scale``: below fp16's smallest subnormal, scaling is moot."""
SKIP_LIMIT = 10
"""Consecutive skipped steps at the floor after which training stops with an error."""


class LossScaler:
    """One loss scale with its counters. Cheap to create; one per loss (``num_losses``)."""

    def __init__(
        self,
        *,
        dynamic: bool,
        init_scale: float,
        min_scale: float | None = None,
        max_scale: float = 2.0**24,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
    ) -> None:
        self.dynamic = dynamic
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.loss_scale = float(init_scale)
        self._configured_scale = self.loss_scale
        self.unskipped = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.hysteresis_left = hysteresis
        self.deferred_found_inf: torch.Tensor | None = None
        """Non-finite flags of backwards unscaled with ``delay_overflow_check=True``, not yet given to ``update``
        (apex: the caller decides when, with ``loss_scalers[i].update_scale()``)."""

    @classmethod
    def from_policy(cls, policy: PrecisionPolicy) -> LossScaler:
        return cls(
            dynamic=policy.dynamic_loss_scale,
            init_scale=policy.first_loss_scale,
            min_scale=policy.min_loss_scale,
            max_scale=policy.max_loss_scale,
            growth_factor=policy.growth_factor,
            backoff_factor=policy.backoff_factor,
            growth_interval=policy.growth_interval,
            hysteresis=policy.hysteresis,
        )

    @property
    def settings(self) -> tuple[Any, ...]:
        """What the scale does, apart from where it stands: scalers with equal settings are interchangeable."""
        return (
            self.dynamic,
            self.min_scale,
            self.max_scale,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
        )

    @property
    def ceiling(self) -> float:
        """The largest scale this scaler holds, a loaded one included: its ``max_scale`` (a static scale
        configured above it: that scale)."""
        return self.max_scale if self.dynamic else max(self.max_scale, self._configured_scale)

    @property
    def floor(self) -> float:
        return self.min_scale if self.min_scale is not None else DEFAULT_FLOOR

    @property
    def at_minimum(self) -> bool:
        """True when a dynamic scale cannot back off any further."""
        return self.dynamic and self.loss_scale <= self.floor

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.loss_scale

    def unscale_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Multiply ``grads`` in place by 1/scale with torch's fused kernel.

        Returns a per-call found-inf tensor (not yet read on the host), or None if no grads or the
        scale is static: a static scale never skips a step, so the check would be a wasted pass over
        every gradient (and at scale 1, as in O0/O4/O5, so would the multiply).
        """
        if not grads or (not self.dynamic and self.loss_scale == 1.0):
            return None
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in locals_of(grads):  # each rank its own shards; the verdict is agreed after (precision.verdict)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        if not self.dynamic:
            for tensors in groups.values():
                torch._foreach_mul_(tensors, 1.0 / self.loss_scale)
            return None
        found: list[torch.Tensor] = []
        for (device, _), tensors in groups.items():
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.full((1,), 1.0 / self.loss_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
            found.append(found_inf)
        first = found[0]
        return sum((f.to(first.device) for f in found[1:]), first)

    def defer(self, flags: Sequence[torch.Tensor]) -> None:
        """Keep non-finite flags for an ``update`` the caller makes later (apex's ``delay_overflow_check``), no host read now."""
        if flags:
            pending = sum(flags[1:], flags[0])
            self.deferred_found_inf = pending if self.deferred_found_inf is None else self.deferred_found_inf + pending

    def update(self, found_inf: bool) -> bool:
        """Advance the counters after one backward (apex) or one step; return True to skip the step."""
        if found_inf and self.dynamic:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.unskipped = 0
            if self.at_minimum and self.consecutive_skips >= SKIP_LIMIT:
                raise NonFiniteGradientsError(
                    f"the loss scale is at its floor ({self.loss_scale:g}) and the last {self.consecutive_skips} steps all had "
                    "non-finite gradients, so lowering the scale cannot help: the forward pass or the loss itself produces "
                    "inf/NaN (look for log(0), division by zero, exploding activations or bad inputs). Training stopped "
                    "instead of skipping steps forever."
                )
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.loss_scale = max(self.floor, self.loss_scale * self.backoff_factor)
                self.hysteresis_left = self.hysteresis
            return True
        self.consecutive_skips = 0
        self.unskipped += 1
        if self.dynamic and self.unskipped >= self.growth_interval:
            self.loss_scale = min(self.max_scale, self.loss_scale * self.growth_factor)
            self.unskipped = 0
            self.hysteresis_left = self.hysteresis
        return False

    def state(self) -> ScalerState:
        """Full state: apex's two keys plus ampddp's counters."""
        return ScalerState(
            dynamic=self.dynamic,
            loss_scale=self.loss_scale,
            unskipped=self.unskipped,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            hysteresis_left=self.hysteresis_left,
        )

    def load_state(self, state: ScalerState) -> None:
        """Take over a saved scale and counters; counters the saving engine did not track start fresh.

        ``dynamic`` stays this scaler's own: it is configuration, not state. A scale above ``ceiling``
        is a ConfigError, and nothing changes.
        """
        if state.loss_scale > self.ceiling:
            raise ConfigError(
                f"loss scale {state.loss_scale:.10g} is out of range; it must be a finite number in (0, {self.ceiling:.10g}], "
                "the most this scaler holds; nothing was loaded"
            )
        self.loss_scale = state.loss_scale
        self.unskipped = state.unskipped
        self.deferred_found_inf = None
        self.skipped_steps = state.skipped_steps or 0
        self.consecutive_skips = state.consecutive_skips or 0
        left = self.hysteresis if state.hysteresis_left is None else state.hysteresis_left
        self.hysteresis_left = min(max(left, 1), self.hysteresis)

    def state_dict(self) -> dict[str, Any]:
        """``state()`` as plain data."""
        return self.state().to_dict()

    def grad_scaler_state_dict(self) -> dict[str, Any]:
        """The same state in ``torch.amp.GradScaler.state_dict()`` form."""
        return {
            "scale": self.loss_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.unskipped,
        }

    def load_state_dict(self, state: Mapping[str, Any], where: str = "loss scaler state") -> None:
        """Accept ampddp/apex form (``loss_scale``, ``unskipped``) or GradScaler form (``scale``, ...)."""
        self.load_state(ScalerState.from_dict(state, where))
