"""The O1/O4 forward context: ops cast per ampddp's lists, only while the context is active.

How, entered around a forward: device autocast, plus dispatcher kernels on its autocast key for the
listed ops autocast does not cast as apex did (``aten_casts.py``), so that unlisted ops cost what
they cost under ``torch.autocast``. Where kernels cannot express a set-up's registrations, a
``torch.overrides.TorchFunctionMode`` sees every torch call made in the context (on this thread
only) and casts the inputs of listed ops, device autocast underneath. Registered functions that
torch cannot intercept are swapped in their module for the context's duration and restored on exit.
Nothing is left patched once the outermost context exits, and two contexts share no state.

A *window* (``open_window``/``close_window``) keeps only the op lists applied on this thread after
a forward has returned, as apex's process-wide patching did for the loss computed outside the
model; the ``amp`` facade opens and closes it (see ``ampddp/amp.py``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ampddp.precision.aten_casts import KERNELS, AtenCastPlan, EnteredPlan
from ampddp.precision.cast_rules import (
    BANNED,
    INPLACE_FP32,
    CastCache,
    cast_floating_to,
    push_entered_casts,
    refuse_banned_on_low,
    refuse_inplace_on_low,
    remove_entered_casts,
    target_dtype,
)
from ampddp.precision.compile_support import run_eagerly_as_own_frame
from ampddp.precision.device_autocast import DeviceAutocast
from ampddp.precision.function_swaps import ORIGINAL_ATTRIBUTE, Dispatcher, install_dispatcher, release_dispatcher
from ampddp.precision.mode_stack import push_below_others, remove_mode
from ampddp.precision.op_table import OpTable
from ampddp.precision.registry import CAST_ATTRIBUTE, FP32
from ampddp.precision.rnn_inputs import RnnInputAlignment
from ampddp.torch_compat import push_function_mode

_WINDOW = threading.local()
"""This thread's open window, if any: ``(context, opened)``. One per thread, like apex's single set
of patches: a window, or any context being entered, closes the window open before it."""
_SUSPENDED = threading.local()
"""How many ``suspend_thread_casts`` blocks this thread is inside."""


def _copy_into(out: Any, result: Any) -> None:
    if isinstance(out, torch.Tensor):
        with torch.no_grad():
            out.resize_(result.shape).copy_(result)
        return
    for target, value in zip(out, result):
        _copy_into(target, value)


class _OpCastMode(TorchFunctionMode):
    def __init__(self, table: OpTable, low_dtype: torch.dtype, device_types: tuple[str, ...], cache: CastCache) -> None:
        super().__init__()
        self._kinds = table.kinds
        self._banned = table.banned_messages
        self._low = low_dtype
        self._device_types = device_types
        self._cache = cache
        self._suspended = False

    @contextlib.contextmanager
    def suspended(self) -> Any:
        """Pass every call through unchanged for the block (apex's ``disable_casts``)."""
        kinds, was = self._kinds, self._suspended
        self._kinds, self._suspended = {}, True
        try:
            yield
        finally:
            self._kinds, self._suspended = kinds, was

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        kind = self._kinds.get(func)
        if kind is None:
            if self._suspended:
                return func(*args, **kwargs)
            kind = self._kinds.get(getattr(func, ORIGINAL_ATTRIBUTE, None)) or getattr(func, CAST_ATTRIBUTE, None)
            if kind is None:
                return func(*args, **kwargs)
        if kind == INPLACE_FP32:
            refuse_inplace_on_low(getattr(func, "__name__", str(func)), args)
            return func(*args, **kwargs)
        if kwargs.get("out") is not None:
            # An out= buffer must be written, not replaced by a cast copy: compute, then copy in.
            out = kwargs.pop("out")
            result = self.__torch_function__(func, types, args, kwargs)
            _copy_into(out, result)
            return out
        if kind == BANNED:
            refuse_banned_on_low(getattr(func, "__name__", str(func)), self._banned[func], args, kwargs)
            kind = FP32
        dtype = target_dtype(kind, self._low, args, kwargs)
        args, kwargs = (args, kwargs) if dtype is None else (self._cast(args, dtype), self._cast(kwargs, dtype))
        if kind != FP32:
            return func(*args, **kwargs)
        with DeviceAutocast(self._device_types, enabled=False):
            return func(*args, **kwargs)

    def _cast(self, obj: Any, dtype: torch.dtype) -> Any:
        return cast_floating_to(obj, dtype, self._cache)


def end_thread_casts() -> None:
    """Close the window open on this thread, whichever context opened it."""
    opened = getattr(_WINDOW, "opened", None)
    _WINDOW.opened = _WINDOW.owner = None
    if opened is not None:
        opened.close()


def _suspension_depth() -> int:
    return getattr(_SUSPENDED, "depth", 0)


class _Opening:
    """One way one context is applied on one thread (entered, window or held): made once, reopened.

    It owns its cast mode and cache, so that opening and closing only push, pop and reset objects
    made before any compiled code ran. When dynamo inlines a model's call into a graph, the hooks
    that open the context and the window run in the graph, and what they leave behind (the window's
    mode on the stack, the window in thread-local state) dynamo rebuilds after the graph: it cannot
    rebuild a mode, cache or ``ExitStack`` callback created while tracing.
    """

    def __init__(self, table: OpTable, low_dtype: torch.dtype, device_types: tuple[str, ...], plan: AtenCastPlan | None = None) -> None:
        self._swaps = table.swaps
        self._autocast = DeviceAutocast(device_types, low_dtype)
        self.cache = CastCache()
        self.cast_mode = _OpCastMode(table, low_dtype, device_types, self.cache)
        self._plan = None if plan is None else EnteredPlan(plan, device_types)
        self.is_open = False
        self.mode_pushed = False
        self._plan_open = False
        self._with_autocast = False
        self._suspension: Any = None
        self._dispatchers: list[tuple[Any, str, Dispatcher]] = []
        self._rnn_inputs = RnnInputAlignment()

    def open(self, with_autocast: bool, at_bottom: bool) -> None:
        """Device autocast (if asked), then the dispatcher kernels' casts or the cast mode and the swaps;
        ``close`` undoes them in reverse. Inside ``suspend_thread_casts`` kernels have nothing to do."""
        self.is_open = True
        try:
            if with_autocast:
                self._autocast.__enter__()
                self._with_autocast = True
            if self._plan is not None:
                if _suspension_depth() == 0:
                    self._plan.open()
                    self._plan_open = True
                return
            if _suspension_depth() > 0:
                self._suspension = self.cast_mode.suspended()
                self._suspension.__enter__()
            if at_bottom:
                push_below_others(self.cast_mode)
            else:
                push_function_mode(self.cast_mode)
            self.mode_pushed = True
            if not with_autocast and _suspension_depth() == 0:
                self._rnn_inputs.install()
            for entry in self._swaps:
                self._dispatchers.append((entry.module, entry.name, install_dispatcher(entry.module, entry.name)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._rnn_inputs.remove()
        dispatchers, self._dispatchers = self._dispatchers, []
        for module, name, dispatcher in reversed(dispatchers):
            release_dispatcher(module, name, dispatcher)
        if self._plan_open:
            self._plan_open = False
            self._plan.close()
        if self.mode_pushed:
            self.mode_pushed = False
            remove_mode(self.cast_mode)
        suspension, self._suspension = self._suspension, None
        if suspension is not None:
            suspension.__exit__(None, None, None)
        self.cache.clear()
        if self._with_autocast:
            self._with_autocast = False
            self._autocast.__exit__(None, None, None)
        self.is_open = False


class OpCastContext:
    """Re-entrant (per thread) context that applies an OpTable; reusable across iterations.

    Three ways to apply it on a thread: entered (``with``: device autocast plus the op lists, on top
    of the mode stack, as a forward needs), a *window* (op lists only, one per thread, see module
    doc), and *held* (op lists only, until ``release``: the legacy ``amp.init`` handle).
    """

    def __init__(self, table: OpTable, low_dtype: torch.dtype, device_types: tuple[str, ...], kernels: bool = True) -> None:
        """``kernels=False``: entered forwards use the torch-function mode even where dispatcher
        kernels could apply the lists (the reference the kernels are tested against)."""
        self._table = table
        self._low = low_dtype
        self._device_types = device_types
        self._plan = AtenCastPlan.build(table.registrations, low_dtype, device_types) if kernels and not table.swaps else None
        if self._plan is not None:
            KERNELS.acquire(self._plan.kernels, owner=self)
        self._local = threading.local()
        self._local.depth = 0  # set here, not at the first entry: a compiled step guards on it
        run_eagerly_as_own_frame(_OpCastMode.__torch_function__)
        self._openings()  # this thread's, made before any compiled forward could open them (see _Opening)

    @property
    def uses_kernels(self) -> bool:
        """Whether entered forwards apply the lists through dispatcher kernels (else the torch-function mode)."""
        return self._plan is not None

    @property
    def device_types(self) -> tuple[str, ...]:
        """The device types whose autocast the context drives."""
        return self._device_types

    @property
    def active(self) -> bool:
        """Whether this context is entered on the calling thread."""
        return getattr(self._local, "depth", 0) > 0

    @property
    def window_open(self) -> bool:
        """Whether this context's window (op lists without device autocast) is open on the calling thread."""
        return getattr(_WINDOW, "owner", None) is self

    def __enter__(self) -> OpCastContext:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            end_thread_casts()
            self._openings().entered.open(with_autocast=_suspension_depth() == 0, at_bottom=False)
        self._local.depth = depth + 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            self._openings().entered.close()

    def open_window(self) -> None:
        """Keep the op lists (not device autocast) applied on this thread until ``close_window``.

        A no-op inside the context (the outer forward still runs), when a window is open already, or
        inside ``suspend_thread_casts``.
        """
        if self.active or self.window_open or _suspension_depth() > 0:
            return
        end_thread_casts()
        window = self._openings().window
        window.open(with_autocast=False, at_bottom=True)
        _WINDOW.opened = window
        _WINDOW.owner = self

    def close_window(self) -> None:
        """Close this context's window on the calling thread, if it has one open there."""
        if self.window_open:
            end_thread_casts()

    def hold(self) -> None:
        """Apply the op lists on this thread until ``release`` (idempotent)."""
        held = self._openings().held
        if not held.is_open:
            held.open(with_autocast=False, at_bottom=True)

    def release(self) -> None:
        """End ``hold`` on this thread."""
        held = self._openings().held
        if held.is_open:
            held.close()

    def clear_cache(self) -> None:
        """Forget cached casts of the held opening on this thread (it spans iterations: the legacy
        ``amp.init`` handle calls this after each backward, as apex cleared its cache)."""
        self._openings().held.cache.clear()

    def opened_modes(self) -> list[_OpCastMode]:
        """The cast modes this context has open on the calling thread (entered, window, held)."""
        openings = self._openings()
        return [opening.cast_mode for opening in (openings.entered, openings.window, openings.held) if opening.mode_pushed]

    def _openings(self) -> _ThreadOpenings:
        openings = getattr(self._local, "openings", None)
        if openings is None:
            entered = _Opening(self._table, self._low, self._device_types, self._plan)
            window, held = (_Opening(self._table, self._low, self._device_types) for _ in range(2))
            openings = self._local.openings = _ThreadOpenings(entered, window, held)
        return openings


@dataclass(frozen=True)
class _ThreadOpenings:
    """A context's three openings on one thread."""

    entered: _Opening
    window: _Opening
    held: _Opening


@contextlib.contextmanager
def suspend_thread_casts(contexts: list[OpCastContext], device_types: tuple[str, ...]) -> Any:
    """No op-list casts and no autocast on this thread inside the block (apex's ``disable_casts``):
    the modes ``contexts`` have open pass calls through, and forwards run inside the block open theirs
    already passing through."""
    _SUSPENDED.depth = _suspension_depth() + 1
    push_entered_casts(None)
    try:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                for mode in context.opened_modes():
                    stack.enter_context(mode.suspended())
            stack.enter_context(DeviceAutocast(device_types, enabled=False))
            yield
    finally:
        remove_entered_casts(None)
        _SUSPENDED.depth -= 1
