"""``impl="apex"``: delegate to NVIDIA apex's own ``apex.amp`` when an old build has it.

apex removed ``apex.amp`` in May 2025 (last tag with it: 25.04). This backend exists for users who
must reproduce numbers on an old container; everyone else uses the builtin engine, which needs no
apex.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision.casting.registry import OpRegistry
from ampddp.precision.engine import PrecisionEngine, check_loss
from ampddp.precision.state import PrecisionState

APEX_MISSING = (
    "precision impl 'apex' needs NVIDIA apex with apex.amp, which apex removed upstream after tag 25.04 "
    "(May 2025). To use it, build apex from that tag: pip install -v --no-build-isolation "
    "git+https://github.com/NVIDIA/apex.git@25.04 (or use the ampddp Docker image built with "
    "--build-arg WITH_APEX=1). Otherwise use impl='builtin' (the default): the same opt levels on "
    "native PyTorch, on any device."
)
_REGISTER = {"half": "register_half_function", "float": "register_float_function", "promote": "register_promote_function"}


def import_apex_amp() -> ModuleType:
    """Return ``apex.amp`` or raise the migration message above."""
    try:
        module = importlib.import_module("apex.amp")
    except ImportError as error:
        raise ConfigError(f"{APEX_MISSING} (import failed: {error})") from None
    if module.__name__.startswith("ampddp."):
        raise ConfigError(
            "precision impl 'apex' asks for NVIDIA's own apex.amp, but in this process `apex` is ampddp.apex, ampddp's "
            "stand-in on native torch (`python -m ampddp.apex` or ampddp.apex.aliasing.alias_apex() made it so): delegating "
            "would run ampddp twice. Use impl='builtin' (the default), or run without the runner where NVIDIA apex 25.04 is installed."
        )
    if not hasattr(module, "initialize"):
        raise ConfigError(f"{APEX_MISSING} (the installed apex has no apex.amp.initialize)")
    return module


class ApexEngine(PrecisionEngine):
    """The engine interface over apex's process-global ``amp`` state."""

    def __init__(self, mode: str, compute_dtype: torch.dtype, registry: OpRegistry | None = None, **overrides: Any) -> None:
        self._amp = import_apex_amp()
        self.mode = mode
        self._compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        self._overrides = overrides
        self._registrations = registry.entries() if registry is not None else ()
        self._optimizers: list[Optimizer] = []
        self._skipped = 0
        self._skip_pending = False
        self._open_block: contextlib.ExitStack | None = None

    def setup(self, models: list[nn.Module], optimizers: list[Optimizer]) -> tuple[list[nn.Module], list[Optimizer]]:
        for entry in self._registrations:
            if entry.kind not in _REGISTER:
                raise ConfigError(f"apex.amp cannot register {entry.kind!r} functions; valid with impl='apex': {', '.join(_REGISTER)}")
            getattr(self._amp, _REGISTER[entry.kind])(entry.module, entry.name)
        models, optimizers = self._amp.initialize(models, optimizers, opt_level=self.mode, **self._overrides)
        self._optimizers = list(optimizers)
        return models, optimizers

    def forward_context(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        with self.scale_loss(loss, self._optimizers, loss_id=loss_id) as scaled:
            scaled.backward()

    def scale_for_backward(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """apex's ``scale_loss`` block, opened here and closed by :meth:`backward_done` (apex unscales as it closes)."""
        if self._open_block is not None:
            raise AmpUsageError("scale_for_backward twice without backward_done: apex's scale_loss blocks do not nest")
        block = contextlib.ExitStack()
        scaled = block.enter_context(self.scale_loss(loss, self._optimizers, loss_id=loss_id))
        self._open_block = block
        return scaled

    def backward_done(self, loss_id: int = 0) -> None:
        block, self._open_block = self._open_block, None
        if block is None:
            raise AmpUsageError(
                "backward_done without scale_for_backward: NVIDIA apex's amp unscales in the scale_loss block that scaled the "
                "loss, so every backward under impl='apex' needs its loss (use impl='builtin' for a stage without one)"
            )
        block.close()

    def agree_over(self, group: Any) -> None:
        """NVIDIA apex's amp decides its skips itself: it cannot agree them over a group (it predates FSDP2)."""
        if group is not None:
            raise ConfigError(
                "precision impl=apex cannot agree its loss-scale verdict over a process group: NVIDIA apex's amp decides each "
                "rank's skips itself; use impl builtin where the ranks' gradients differ (fsdp2, hsdp, a model parallelized over "
                "a device mesh)"
            )

    @contextlib.contextmanager
    def scale_loss(
        self,
        loss: torch.Tensor,
        optimizers: list[Optimizer],
        loss_id: int = 0,
        delay_unscale: bool = False,
        delay_overflow_check: bool = False,
    ) -> Iterator[torch.Tensor]:
        """apex's own scale_loss; a drop in its scale on exit means it will skip the next step."""
        check_loss(loss, "scale_loss")
        before = self.loss_scale(loss_id)
        options = {"delay_overflow_check": True} if delay_overflow_check else {}
        with self._amp.scale_loss(loss, optimizers, loss_id=loss_id, delay_unscale=delay_unscale, **options) as scaled:
            yield scaled
        if self.loss_scale(loss_id) < before:
            self._skipped += 1
            self._skip_pending = True

    def unscale_(self, optimizer: Optimizer) -> None:
        """apex unscales when scale_loss exits, so there is nothing left to do."""

    def step(self, *optimizers: Optimizer) -> bool:
        for optimizer in optimizers:
            optimizer.step()
        self._take_norm_overflow()  # NVIDIA apex decided this step's skip as its scale_loss block closed
        stepped, self._skip_pending = not self._skip_pending, False
        return stepped

    def master_params(self, optimizer: Optimizer) -> Iterator[nn.Parameter]:
        return self._amp.master_params(optimizer)

    def loss_scale(self, loss_id: int = 0) -> float:
        return float(self._amp.state_dict()[f"loss_scaler{loss_id}"]["loss_scale"])

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The opt level's own dtype (apex's overrides are apex's to interpret)."""
        return None if self._overrides.get("enabled") is False else self._compute_dtype

    def precision_state(self) -> PrecisionState:
        apex_state = PrecisionState.from_dict(self._amp.state_dict(), where="apex.amp.state_dict()")
        return PrecisionState(mode=self.mode, impl="apex", scalers=apex_state.scalers, skipped_steps=self._skipped)

    def load_precision_state(self, state: PrecisionState) -> None:
        count = len(self._amp.state_dict())
        if len(state.scalers) != count:
            raise ConfigError(f"precision state has {len(state.scalers)} loss scalers; apex.amp here has {count} (num_losses)")
        self.check_precision_state(state)
        self._amp.load_state_dict(state.to_apex_dict())
        self._skipped = state.skipped_steps
