"""apex's legacy handle API: ``handle = amp.init(...)``, ``handle.scale_loss``, ``handle.wrap_optimizer``.

Before ``amp.initialize`` existed, apex cast torch functions from ``amp.init()`` until
``handle._deactivate()``, with no model involved; apex's own op-casting tests are written that way.
Here the handle holds apex's O1 (fp16) or O4 (``patch_type=torch.bfloat16``) op lists on the
thread that called ``init`` — the set-up that asked for it — without device autocast, as apex's
patched functions had none, and ends them in ``_deactivate``: nothing is patched, and nothing
outlives the handle. Loss scaling uses the O-level engine, with
optimizers added as the handle first meets them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim import Optimizer

from ampddp.amp import default
from ampddp.amp.loss_blocks import OptLevelLossBlocks
from ampddp.errors import AmpUsageError, ConfigError
from ampddp.precision import OptLevelEngine, resolve_policy
from ampddp.precision.casting import FP32, OpCastContext, OpRegistry, op_lists, suspend_thread_casts

LEVEL_FOR_PATCH_TYPE = {torch.float16: "O1", torch.bfloat16: "O4"}


def _engine(patch_type: torch.dtype, loss_scale: Any, verbose: bool, registry: OpRegistry, num_losses: int = 1) -> OptLevelEngine:
    if patch_type not in LEVEL_FOR_PATCH_TYPE:
        raise ConfigError(f"patch_type={patch_type!r} is not valid; valid: torch.float16, torch.bfloat16")
    policy = resolve_policy(LEVEL_FOR_PATCH_TYPE[patch_type], loss_scale=loss_scale, verbosity=int(bool(verbose)), num_losses=num_losses)
    return OptLevelEngine(policy, registry)


class AmpHandle:
    """An active legacy set-up: op casting on the creating thread, and loss scaling."""

    def __init__(self, loss_scale: Any, enable_caching: bool, verbose: bool, allow_banned: bool, patch_type: torch.dtype) -> None:
        registry = OpRegistry()
        for entry in default.registry.entries():
            registry.register(entry.module, entry.name, entry.kind)
        if allow_banned:
            for name in op_lists.BANNED_OPS:
                registry.register(F, name, FP32)
        self._patch_type = patch_type
        self._loss_scale = loss_scale
        self._registry = registry
        self.verbose = verbose
        self.has_cache = enable_caching
        """Casts are cached per iteration either way (the cache never changes results)."""
        self._engine = _engine(patch_type, loss_scale, verbose, registry)
        self._engine.setup([], [])
        self._blocks = OptLevelLossBlocks(self._engine)
        context = self._engine.forward_context()
        if not isinstance(context, OpCastContext):
            raise AmpUsageError("the legacy amp.init handle needs op casting; this policy has none")
        self._context: OpCastContext | None = context
        self._thread = threading.get_ident()
        self._held = context.list_opening()
        """The op lists on this thread until ``_deactivate`` (made and opened here, on the calling thread)."""
        self._held.open(with_autocast=False, at_bottom=True)

    def is_active(self) -> bool:
        return self._context is not None

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise AmpUsageError(f"handle.{what} must run on the thread that called amp.init (casting is per thread)")

    def _deactivate(self) -> None:
        """End this handle's casting (apex restored its patched functions here)."""
        if self._context is None:
            return
        self._check_thread("_deactivate")
        self._context = None
        self._held.close()
        self._engine.teardown()

    def _clear_cache(self) -> None:
        if self._context is not None:
            self._held.cache.clear()

    @contextlib.contextmanager
    def disable_casts(self) -> Iterator[None]:
        if self._context is None:
            yield
            return
        held_here = self._held.mode_pushed and threading.get_ident() == self._thread  # held on the thread that called init only
        modes = [*self._context.entered_modes(), *([self._held.cast_mode] if held_here else [])]
        with suspend_thread_casts(modes, self._context.device_types):
            yield

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        """Scale, and on exit unscale ``optimizer``'s new grads; an overflow skips its next step."""
        if self._context is None:
            yield loss
            return
        self._engine.add_optimizer(optimizer)
        try:
            with self._blocks.scale_loss(loss, [optimizer]) as scaled:
                yield scaled
        finally:
            self._clear_cache()

    def wrap_optimizer(self, optimizer: Optimizer, num_loss: int = 1) -> OptimWrapper:
        """An optimizer with one loss scaler per loss (``num_loss``), used as ``opt.scale_loss(loss)``."""
        return OptimWrapper(optimizer, self, num_loss)

    def _wrapper_engine(self, num_losses: int) -> OptLevelEngine:
        return _engine(self._patch_type, self._loss_scale, self.verbose, self._registry, num_losses)


class OptimWrapper:
    """apex's ``amp.opt.OptimWrapper``: ``with opt.scale_loss(loss) as s: s.backward()`` per loss, then ``opt.step()``."""

    def __init__(self, optimizer: Optimizer, handle: AmpHandle | NoOpHandle, num_loss: int) -> None:
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ConfigError(f"num_loss={num_loss!r} is not valid; it must be a whole number >= 1")
        self._optimizer = optimizer
        self._handle = handle
        self._num_loss = num_loss
        self._loss_index = 0
        engine = handle._wrapper_engine(num_loss) if isinstance(handle, AmpHandle) else None
        if engine is not None:
            engine.setup([], [optimizer])
        self._blocks = None if engine is None else OptLevelLossBlocks(engine)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        if self._blocks is None or not self._handle.is_active():
            yield loss
            return
        if self._loss_index >= self._num_loss:
            raise AmpUsageError(
                f"scale_loss called more than num_loss={self._num_loss} times before step(); pass num_loss to wrap_optimizer"
            )
        loss_id, self._loss_index = self._loss_index, self._loss_index + 1
        try:
            with self._blocks.scale_loss(loss, [self._optimizer], loss_id=loss_id) as scaled:
                yield scaled
        finally:
            self._handle._clear_cache()

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise NotImplementedError("the closure argument is not supported by the amp optimizer wrapper (as in apex)")
        self._loss_index = 0
        return self._optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return f"OptimWrapper({self._optimizer!r}, num_loss={self._num_loss})"


class NoOpHandle:
    """``amp.init(enabled=False)``: every call passes through unchanged."""

    verbose = False
    has_cache = False

    def is_active(self) -> bool:
        return False

    def _deactivate(self) -> None:
        return None

    def _clear_cache(self) -> None:
        return None

    @contextlib.contextmanager
    def disable_casts(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Optimizer) -> Iterator[torch.Tensor]:
        yield loss

    def wrap_optimizer(self, optimizer: Optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)


def init(
    enabled: bool = True,
    loss_scale: Any = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    patch_type: torch.dtype = torch.float16,
) -> AmpHandle | NoOpHandle:
    """apex's legacy ``amp.init``: op casting on this thread until ``handle._deactivate()``."""
    if not enabled:
        return NoOpHandle()
    return AmpHandle(loss_scale, enable_caching, verbose, allow_banned, patch_type)
