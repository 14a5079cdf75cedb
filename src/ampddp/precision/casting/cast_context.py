"""The O1/O4 forward context: ops cast per ampddp's lists, only while the context is active.

How, entered around a forward: device autocast, plus dispatcher kernels on its autocast key for the
listed ops autocast does not cast as apex did (``aten_casts.py``), so that unlisted ops cost what
they cost under ``torch.autocast``. Where kernels cannot express a set-up's registrations, a
``torch.overrides.TorchFunctionMode`` sees every torch call made in the context (on this thread
only) and casts the inputs of listed ops, device autocast underneath. Registered functions that
torch cannot intercept are swapped in their module for the context's duration and restored on exit.
Nothing is left patched once the outermost context exits, and two contexts share no state.

The same lists can be applied without device autocast through an ``Opening`` made by
``list_opening``: apex's patched functions had no autocast. Whoever asked for that owns the opening
and decides when it applies — the ``amp`` facade's *window* after a forward (``ampddp/amp/set_up.py``),
the legacy ``amp.init`` handle's held casts (``ampddp/apex/amp/handle.py``). This module keeps only
the rule they share: one window per thread (``open_thread_window``), closed by the next window or by
any context being entered (``end_thread_casts``).

A checkpoint (``torch.utils.checkpoint``) taken where a forward casts recomputes under twins of the
openings applied there (``recompute_casting``; how it is hooked in: ``recompute.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ampddp.precision.casting.aten_casts import KERNELS, AtenCastPlan, EnteredPlan
from ampddp.precision.casting.cast_rules import (
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
from ampddp.precision.casting.device_autocast import DeviceAutocast
from ampddp.precision.casting.function_swaps import ORIGINAL_ATTRIBUTE, Dispatcher, install_dispatcher, release_dispatcher
from ampddp.precision.casting.mode_stack import push_below_others, remove_mode
from ampddp.precision.casting.op_table import OpTable
from ampddp.precision.casting.recompute import CheckpointStandIns, Reapply
from ampddp.precision.casting.registry import CAST_ATTRIBUTE, FP32
from ampddp.precision.casting.rnn_inputs import RnnInputAlignment
from ampddp.precision.compile_support import run_eagerly_as_own_frame
from ampddp.torch_compat import push_function_mode

_WINDOW = threading.local()
"""This thread's open window, if any (``opened``). One per thread, like apex's single set of patches:
a window, or any context being entered, closes the window open before it."""
_SUSPENDED = threading.local()
"""How many ``suspend_thread_casts`` blocks this thread is inside."""
_APPLIED = threading.local()
"""This thread's open openings that cast forwards (entered contexts, held lists; not windows), in the
order they opened: the casting a checkpoint taken here recomputes under (``recompute.py``)."""


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
    """Close the window open on this thread, whoever opened it."""
    opened = getattr(_WINDOW, "opened", None)
    _WINDOW.opened = None
    if opened is not None:
        opened.close()


def open_thread_window(opening: Opening) -> None:
    """Apply ``opening`` (a ``list_opening``) on this thread as its one window, closing the one before.

    A no-op inside ``suspend_thread_casts`` (nothing casts there) or when it is the open window already.
    """
    if casts_suspended() or window_is_open(opening):
        return
    end_thread_casts()
    opening.open(with_autocast=False, at_bottom=True, forward=False)
    _WINDOW.opened = opening


def window_is_open(opening: Opening) -> bool:
    """Whether ``opening`` is this thread's open window."""
    return getattr(_WINDOW, "opened", None) is opening


def close_thread_window(opening: Opening) -> None:
    """Close ``opening`` if it is this thread's open window."""
    if window_is_open(opening):
        end_thread_casts()


def casts_suspended() -> bool:
    """Whether this thread is inside ``suspend_thread_casts``."""
    return _suspension_depth() > 0


def _suspension_depth() -> int:
    return getattr(_SUSPENDED, "depth", 0)


class Opening:
    """One way one context is applied on one thread (entered, or the lists alone): made once, reopened.

    It owns its cast mode and cache, so that opening and closing only push, pop and reset objects
    made before any compiled code ran. When dynamo inlines a model's call into a graph, the hooks
    that open the context and the window run in the graph, and what they leave behind (the window's
    mode on the stack, the window in thread-local state) dynamo rebuilds after the graph: it cannot
    rebuild a mode, cache or ``ExitStack`` callback created while tracing.
    """

    def __init__(self, table: OpTable, low_dtype: torch.dtype, device_types: tuple[str, ...], plan: AtenCastPlan | None = None) -> None:
        self._remake = functools.partial(Opening, table, low_dtype, device_types, plan)
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
        self._stand_ins_holder: threading.Thread | None = None

    @property
    def blueprint(self) -> OpeningBlueprint:
        """How to open this opening's twin elsewhere, casting as it casts now (a checkpoint's recompute)."""
        return OpeningBlueprint(self._remake, self._rnn_inputs.installed)

    @property
    def casts(self) -> bool:
        """Whether it is open and casts (an opening opened inside ``suspend_thread_casts`` passes calls through)."""
        return self._plan_open or (self.mode_pushed and self._suspension is None)

    def open(self, with_autocast: bool, at_bottom: bool, align_rnn_inputs: bool | None = None, forward: bool = True) -> None:
        """Device autocast (if asked), then the dispatcher kernels' casts or the cast mode and the swaps;
        ``close`` undoes them in reverse. Inside ``suspend_thread_casts`` kernels have nothing to do.
        RNN inputs are aligned without autocast unless ``align_rnn_inputs`` says otherwise.

        ``forward``: it casts forwards (a context, the legacy handle's held lists), so a checkpoint taken
        under it recomputes under its twin (``recompute_casting``). Not a window: that is the span between
        forwards, and a forward a checkpoint wraps closes it (the model's hooks), in its recompute too."""
        self.is_open = True
        try:
            if with_autocast:
                self._autocast.__enter__()
                self._with_autocast = True
            if self._plan is None:
                self._open_mode(at_bottom, not with_autocast if align_rnn_inputs is None else align_rnn_inputs)
            elif _suspension_depth() == 0:
                self._plan.open()
                self._plan_open = True
        except BaseException:
            self.close()
            raise
        if forward:
            _applied().append(self)
            self._hold_stand_ins(True)

    def _open_mode(self, at_bottom: bool, align_rnn_inputs: bool) -> None:
        if _suspension_depth() > 0:
            self._suspension = self.cast_mode.suspended()
            self._suspension.__enter__()
        if at_bottom:
            push_below_others(self.cast_mode)
        else:
            push_function_mode(self.cast_mode)
        self.mode_pushed = True
        if align_rnn_inputs and _suspension_depth() == 0:
            self._rnn_inputs.install()
        for entry in self._swaps:
            self._dispatchers.append((entry.module, entry.name, install_dispatcher(entry.module, entry.name)))

    def _hold_stand_ins(self, hold: bool) -> None:
        """The checkpoint stand-ins are in place while a forward's opening is open (see ``recompute.py``). Not while
        dynamo traces an opening (a compiled region's checkpoints are recomputed by its graph): the next
        eager open or close of the same opening squares the count."""
        if hold == (self._stand_ins_holder is not None) or torch.compiler.is_compiling():
            return
        if hold:
            self._stand_ins_holder = CHECKPOINT_STAND_INS.hold()
        else:
            holder, self._stand_ins_holder = self._stand_ins_holder, None
            CHECKPOINT_STAND_INS.release(holder)

    def close(self) -> None:
        _forget(self)
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
        self._hold_stand_ins(False)


@dataclass(frozen=True)
class OpeningBlueprint:
    """What a checkpoint taken under an opening keeps to recompute under its twin."""

    make: Callable[[], Opening]
    aligns_rnn_inputs: bool


def _applied() -> list[Opening]:
    openings = getattr(_APPLIED, "openings", None)
    if openings is None:
        openings = _APPLIED.openings = []
    return openings


def _forget(opening: Opening) -> None:
    """Take ``opening`` off this thread's open openings wherever it sits (they may close out of order)."""
    openings = _applied()
    for index in range(len(openings) - 1, -1, -1):
        if openings[index] is opening:
            del openings[index]
            return


def recompute_casting() -> Reapply | None:
    """The forward casting this thread applies now (entered contexts, the legacy handle's held lists), as a
    context that applies it again around a checkpoint's recompute wherever that runs; None where none casts.

    Not a window's: a twin of it would cast under the forward's own context where the forward had not
    (inside the forward's ``torch.autocast(enabled=False)`` blocks, say), since the model's hooks closed it."""
    if casts_suspended():
        return None
    blueprints = tuple(opening.blueprint for opening in _applied() if opening.casts)
    return functools.partial(_reapplied, blueprints) if blueprints else None


@contextlib.contextmanager
def _reapplied(blueprints: tuple[OpeningBlueprint, ...]) -> Iterator[None]:
    """A twin of each opening, opened on this thread as the forward had them: not suspended (the forward's
    casts were not), device autocast left to torch's checkpoint (it enters the forward's again)."""
    depth, _SUSPENDED.depth = _suspension_depth(), 0
    twins: list[Opening] = []
    try:
        for blueprint in blueprints:
            twins.append(blueprint.make())
            twins[-1].open(with_autocast=False, at_bottom=False, align_rnn_inputs=blueprint.aligns_rnn_inputs)
        yield
    finally:
        for twin in reversed(twins):
            twin.close()
        _SUSPENDED.depth = depth


CHECKPOINT_STAND_INS = CheckpointStandIns(recompute_casting)
"""torch.utils.checkpoint's recompute classes' stand-ins, in place while some opening is open (one per process)."""


class OpCastContext:
    """Re-entrant (per thread) context that applies an OpTable; reusable across iterations.

    Entered (``with``), it applies device autocast plus the op lists, on top of the mode stack, as a
    forward needs; ``list_opening`` makes the lists alone for whoever applies them otherwise.
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
        self._entered()  # this thread's, made before any compiled forward could open it (see Opening)

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

    def __enter__(self) -> OpCastContext:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            end_thread_casts()
            self._entered().open(with_autocast=not casts_suspended(), at_bottom=False)
        self._local.depth = depth + 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            self._entered().close()

    def list_opening(self) -> Opening:
        """The op lists without device autocast, on the bottom of the mode stack (as apex's patched
        functions): a new opening for its owner to open and close. Make it on the thread that opens it,
        before any compiled forward runs there (see ``Opening``)."""
        return Opening(self._table, self._low, self._device_types)

    def entered_modes(self) -> list[_OpCastMode]:
        """The cast mode this context has entered on the calling thread (none with dispatcher kernels)."""
        entered = self._entered()
        return [entered.cast_mode] if entered.mode_pushed else []

    def _entered(self) -> Opening:
        entered = getattr(self._local, "entered", None)
        if entered is None:
            entered = self._local.entered = Opening(self._table, self._low, self._device_types, self._plan)
        return entered


@contextlib.contextmanager
def suspend_thread_casts(modes: list[_OpCastMode], device_types: tuple[str, ...]) -> Any:
    """No op-list casts and no autocast on this thread inside the block (apex's ``disable_casts``):
    ``modes`` (the cast modes open on this thread: ``entered_modes``, an opening's ``cast_mode``)
    pass calls through, and forwards run inside the block open theirs already passing through."""
    _SUSPENDED.depth = _suspension_depth() + 1
    push_entered_casts(None)
    try:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode.suspended())
            stack.enter_context(DeviceAutocast(device_types, enabled=False))
            yield
    finally:
        remove_entered_casts(None)
        _SUSPENDED.depth -= 1
