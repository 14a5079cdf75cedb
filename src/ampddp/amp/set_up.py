"""One ``amp.initialize``'s set-up: its engine, the models and optimizers it holds, and the cast
window with the hooks that open and close it around them (``ampddp.amp`` keeps the set-ups of an ``Amp``).

The window is apex's scope outside the forward: the op lists alone (no device autocast, as apex's
patched functions had none) on the initializing thread, from a model's forward returning until
``scale_loss``, a step or the next forward — the loss computed outside the model casts as with apex.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ampddp.amp.stash import mark_optimizer, unmark_optimizer
from ampddp.amp.state_io import carry_amp_state
from ampddp.precision import PrecisionEngine, run_eagerly_as_own_frame
from ampddp.precision.casting import (
    OpCastContext,
    Opening,
    close_thread_window,
    end_thread_casts,
    open_thread_window,
)


@dataclass
class CastScope:
    """apex's scope for O1/O4 casts (``python -m ampddp.apex``) when ``process_wide``: on the initializing
    thread from ``initialize`` on, outside forwards too, except while ``scale_loss`` and the step run."""

    process_wide: bool = False


@dataclass
class SetUp:
    """What one ``initialize`` made: the engine, the objects it holds, and the cast-window hooks.

    Its hooks on the models and optimizers keep it alive exactly as long as they live (the ``Amp``
    holds only the newest set-up strongly), so dropping a fold's model and optimizer frees it all.
    """

    engine: PrecisionEngine
    models: list[nn.Module]
    optimizers: list[Optimizer]
    request: tuple[Any, ...] = ()
    """What ``initialize`` was asked for (opt level, impl, enabled, overrides): a repeat of it is a no-op."""
    hooks: list[RemovableHandle] = field(default_factory=list)
    initializing_thread: threading.local = field(default_factory=threading.local)
    """Marks the thread that called ``initialize``, the only one whose forwards open a cast window
    (a thread-local flag rather than ``threading.get_ident()``, which ``torch.compile`` cannot trace)."""
    live: bool = True
    scope: CastScope = field(default_factory=CastScope)
    """Shared by all set-ups of one ``Amp``: whether casting is apex's process-wide scope."""
    restores_carried_amp_state: Callable[[], bool] = lambda: True
    """Whether an optimizer's ``load_state_dict`` restores the amp state its dict carries (see ampddp.amp.state_io)."""
    window: Opening | None = field(init=False, default=None)
    """The op lists outside the forward, made here on the initializing thread (before any compiled
    forward could open it); None without O1/O4 op casting."""

    def __post_init__(self) -> None:
        self.initializing_thread.marked = True
        context = self.cast_context
        self.window = None if context is None else context.list_opening()

    @property
    def cast_context(self) -> OpCastContext | None:
        context = self.engine.forward_context()
        return context if isinstance(context, OpCastContext) and self.live else None

    def holds(self, obj: object) -> bool:
        return any(obj is held for held in (*self.models, *self.optimizers))

    def holds_exactly(self, models: list[nn.Module], optimizers: list[Optimizer]) -> bool:
        same = [a is b for a, b in zip((*models, *optimizers), (*self.models, *self.optimizers))]
        return len(models) == len(self.models) and len(optimizers) == len(self.optimizers) and all(same)

    def mark_optimizers(self) -> None:
        """apex's ``optimizer._amp_stash`` on each optimizer, as libraries test for it (see ampddp.amp.stash)."""
        for optimizer in self.optimizers:
            grads = self.engine.optimizer_grads(optimizer)
            if grads is not None:
                mark_optimizer(optimizer, grads)

    def install_hooks(self) -> None:
        """Casting outlives the forward until the loss is handed to ``scale_loss`` (see module doc).

        The hooks are shared by deep copies of the models (an EMA copy), so each checks ``live``.
        """

        def close_before_forward(module: nn.Module, args: Any) -> None:
            # Any window open on this thread ends: a model's forward follows its own set-up only (an O0
            # model next to an O1 one trains as it would alone, process-wide casting included).
            context = self.cast_context
            if self.live and (context is None or not context.active):
                end_thread_casts()

        def open_after_forward(module: nn.Module, args: Any, output: Any) -> None:
            self.open_window_here()

        def close_before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            if self.live:
                end_thread_casts()

        def reopen_after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            if self.scope.process_wide:
                self.open_window_here()

        run_eagerly_as_own_frame(close_before_forward, open_after_forward, close_before_step, reopen_after_step)
        for model in self.models:
            self.hooks.append(model.register_forward_pre_hook(close_before_forward, prepend=True))
            self.hooks.append(model.register_forward_hook(open_after_forward))
        self.hooks += [optimizer.register_step_pre_hook(close_before_step) for optimizer in self.optimizers]
        self.hooks += [optimizer.register_step_post_hook(reopen_after_step) for optimizer in self.optimizers]
        for optimizer in self.optimizers:
            self.hooks += carry_amp_state(optimizer, self.engine, self.restores_carried_amp_state)

    @property
    def on_initializing_thread(self) -> bool:
        return getattr(self.initializing_thread, "marked", False)

    def open_window_here(self) -> None:
        """Apply the op lists on this thread until the next forward, ``scale_loss`` or step, if it
        initialized; not while a forward of this set-up still runs (its own context casts)."""
        context = self.cast_context  # None once torn down or op casting was stopped (handle._deactivate)
        if context is not None and self.window is not None and self.on_initializing_thread and not context.active:
            open_thread_window(self.window)

    def close_window(self) -> None:
        """Close this set-up's window if it is open on this thread."""
        if self.window is not None:
            close_thread_window(self.window)

    def modes_here(self) -> list[Any]:
        """The cast modes this set-up has open on the calling thread (its forward's, its window's)."""
        context = self.cast_context
        modes = [] if context is None else context.entered_modes()
        window = self.window
        if window is not None and window.mode_pushed and self.on_initializing_thread:
            modes.append(window.cast_mode)
        return modes

    def unwind(self) -> None:
        """Exit contexts left entered by forwards interrupted with KeyboardInterrupt on this thread."""
        self.engine.unwind_interrupted_forwards()

    def teardown(self) -> None:
        self.close_window()
        self.live = False
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
        for optimizer in self.optimizers:
            unmark_optimizer(optimizer)
        self.engine.teardown()
