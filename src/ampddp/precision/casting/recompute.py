"""Activation checkpointing recomputes under the casting its forward had.

Why: ``torch.utils.checkpoint`` saves device autocast's state where a checkpoint is taken and enters
it again around the recompute (both variants), and nothing else: neither the torch-function mode of
an O1/O4 forward nor the thread-local state its dispatcher kernels read. The recompute in the backward
then ran LayerNorm, GELU, softmax, ... in fp16 where the forward had run them in fp32: the reentrant
variant trained differently from the same run without checkpointing, the non-reentrant one raised
``CheckpointError`` (recomputed dtypes differ from the saved ones). apex's patched torch functions were
there for the recompute too.

How: each variant keeps what it recomputes on an object of one class of ``torch.utils.checkpoint``,
looked up in that module whenever a checkpoint is taken, however ``checkpoint`` itself was imported
(``checkpoint_sequential``, Hugging Face's and FSDP's wrappers of it too): the reentrant variant's
autograd Function (``CheckpointFunction``: ``ctx.run_function``) and the non-reentrant variant's frame
(``_CheckpointFrame``: ``recompute_fn``). While ampddp casts ops on some thread, subclasses of those
stand in for them (``CheckpointStandIns``, counted per thread like the RNN hook of ``rnn_inputs.py``,
torch's classes back with the last release). A checkpoint taken where a forward casts captures that
casting (``cast_context.recompute_casting``), and its recompute applies it again on whichever thread
the backward runs it; anywhere else they behave as torch's classes. Nothing runs inside an ordinary
backward: its formulas are cast as before (not at all).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from ampddp.torch_compat import checkpoint_recompute_classes

Reapply = Callable[[], AbstractContextManager[Any]]
"""Applies, for a ``with`` block on the calling thread, the casting captured where a checkpoint was taken."""
Capture = Callable[[], "Reapply | None"]
"""The calling thread's casting now, as a ``Reapply``; None where nothing is cast."""


class _InCasting:
    """``function`` run under the casting captured where its checkpoint was taken (its recompute)."""

    def __init__(self, function: Callable[..., Any], reapply: Reapply) -> None:
        self.function = function
        self._reapply = reapply

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._reapply():
            return self.function(*args, **kwargs)


def _in_casting(function: Callable[..., Any], capture: Capture) -> Callable[..., Any]:
    reapply = capture()
    return function if reapply is None else _InCasting(function, reapply)


def _reentrant_stand_in(original: type, capture: Capture) -> type:
    class CheckpointFunction(original):  # type: ignore[valid-type,misc]  # torch's name: its node is CheckpointFunctionBackward
        """torch's reentrant checkpoint; its recompute (``ctx.run_function``) runs in the forward's casting."""

        @staticmethod
        def forward(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            recompute = _in_casting(run_function, capture)
            outputs = original.forward(ctx, run_function, preserve_rng_state, *args)
            ctx.run_function = recompute  # after the forward: that already runs in the casting
            return outputs

    return CheckpointFunction


def _non_reentrant_stand_in(original: type, capture: Capture) -> type:
    class _CheckpointFrame(original):  # type: ignore[valid-type,misc]
        """torch's non-reentrant checkpoint frame; its ``recompute_fn`` runs in the forward's casting."""

        def __init__(self, recompute_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            super().__init__(_in_casting(recompute_fn, capture), *args, **kwargs)

    return _CheckpointFrame


STAND_IN_FACTORIES = {"CheckpointFunction": _reentrant_stand_in, "_CheckpointFrame": _non_reentrant_stand_in}


class CheckpointStandIns:
    """The stand-ins for torch's checkpoint classes, in ``torch.utils.checkpoint`` exactly while some live
    thread holds them (counted per thread, as ``rnn_inputs.py`` counts its hook: a thread that ended
    holding them stops counting). A class this torch lacks is left out (its variant recomputes as torch does).

    One per process (``cast_context.CHECKPOINT_STAND_INS``): the module they stand in is one per process.
    """

    def __init__(self, capture: Capture) -> None:
        self._lock = threading.Lock()
        self._holders: dict[threading.Thread, int] = {}
        originals = checkpoint_recompute_classes()
        self._classes = {name: (original, STAND_IN_FACTORIES[name](original, capture)) for name, original in originals.items()}

    def hold(self) -> threading.Thread:
        """Put the stand-ins in place for the calling thread; returns what ``release`` takes."""
        thread = threading.current_thread()
        with self._lock:
            held = self._holders.get(thread, 0)
            if held == 0 and self._holders:
                self._drop_ended_threads()
            self._holders[thread] = held + 1
            if held == 0 and len(self._holders) == 1:
                self._place(stand_ins=True)
        return thread

    def release(self, thread: threading.Thread) -> None:
        """End one ``hold`` of ``thread``; torch's classes come back with the last holder."""
        with self._lock:
            left = self._holders.get(thread, 0) - 1
            if left > 0:
                self._holders[thread] = left
                return
            self._holders.pop(thread, None)
            if self._holders:
                self._drop_ended_threads()
            else:
                self._place(stand_ins=False)

    @property
    def held(self) -> bool:
        """Whether some live thread holds the stand-ins (they are in place)."""
        with self._lock:
            self._drop_ended_threads()
            return bool(self._holders)

    def _drop_ended_threads(self) -> None:
        """A thread that ended holding them stops counting (under ``_lock``)."""
        ended = [thread for thread in self._holders if not thread.is_alive()]
        for thread in ended:
            del self._holders[thread]
        if ended and not self._holders:
            self._place(stand_ins=False)

    def _place(self, stand_ins: bool) -> None:
        """The stand-ins, or torch's classes, into ``torch.utils.checkpoint`` (a class someone else put
        there meanwhile stays theirs). Under ``_lock``."""
        for name, (original, stand_in) in self._classes.items():
            current, wanted = (original, stand_in) if stand_ins else (stand_in, original)
            if getattr(torch_checkpoint, name) is current:
                setattr(torch_checkpoint, name, wanted)
