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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ampddp.errors import ConfigError, NonFiniteGradientsError
from ampddp.precision.policy import PrecisionPolicy

APEX_KEYS = ("loss_scale", "unskipped")
DEFAULT_FLOOR = 2.0**-24
"""Lowest dynamic scale without a ``min_scale``: below fp16's smallest subnormal, scaling is moot."""
SKIP_LIMIT = 10
"""Consecutive skipped steps at the floor after which training stops with an error."""
GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


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
        self.unskipped = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.hysteresis_left = hysteresis

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
        if not grads:
            return None
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        if not self.dynamic:
            if self.loss_scale != 1.0:
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

    def state_dict(self) -> dict[str, Any]:
        """Full state: apex's two keys plus ampddp's counters."""
        return {
            "dynamic": self.dynamic,
            "loss_scale": self.loss_scale,
            "unskipped": self.unskipped,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "hysteresis_left": self.hysteresis_left,
        }

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
        self.apply_state(self.parse_state(state, where))

    def parse_state(self, state: Mapping[str, Any], where: str = "loss scaler state") -> dict[str, Any]:
        """Validate a saved scaler state without changing anything; returns what ``apply_state`` takes."""
        if not isinstance(state, Mapping):
            raise ConfigError(f"{where} must be a dict, got {type(state).__name__}")
        if "loss_scale" in state:
            scale, counter = state["loss_scale"], state.get("unskipped", 0)
        elif "scale" in state:
            scale, counter = state["scale"], state.get("_growth_tracker", 0)
        else:
            raise ConfigError(
                f"{where} has keys {sorted(state)}; expected apex form {list(APEX_KEYS)} or torch GradScaler form {list(GRAD_SCALER_KEYS)}"
            )
        hysteresis_left = _counter(state.get("hysteresis_left", self.hysteresis), f"{where}: hysteresis_left")
        return {
            "loss_scale": _number(scale, f"{where}: loss scale"),
            "unskipped": _counter(counter, f"{where}: unskipped/_growth_tracker"),
            "skipped_steps": _counter(state.get("skipped_steps", 0), f"{where}: skipped_steps"),
            "consecutive_skips": _counter(state.get("consecutive_skips", 0), f"{where}: consecutive_skips"),
            "hysteresis_left": min(max(hysteresis_left, 1), self.hysteresis),
        }

    def apply_state(self, values: dict[str, Any]) -> None:
        self.loss_scale = values["loss_scale"]
        self.unskipped = values["unskipped"]
        self.skipped_steps = values["skipped_steps"]
        self.consecutive_skips = values["consecutive_skips"]
        self.hysteresis_left = values["hysteresis_left"]


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
