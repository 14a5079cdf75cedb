"""Python callbacks that a DDP communication hook chains onto torch futures, released before exit.

torch runs a hook's ``future.then(fn)`` callback on the process group's worker thread and drops its
last reference to ``fn`` there afterwards, which takes the GIL. A script that ends right after its
last backward can start interpreter finalization between those two moments: the worker thread can
then no longer take the GIL, is unwound, and the whole process aborts ("terminate called without
an active exception", SIGABRT) although training finished and every file was written. Seen about
once in 15 runs of a 2-process gloo script under torchrun.

:class:`HookCallbacks` makes that moment observable: each callback it chains is a fresh function
whose release it watches, and :meth:`HookCallbacks.settle`, run before finalization (a
``weakref.finalize`` of the wrapper, which Python calls at exit), gives up the GIL until every
callback that has run has also been released. Callbacks whose collective is still running are not
waited for: their worker thread holds no GIL request, so exiting cannot abort on them.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HookCallbacks"]

_POLL_S = 0.001


class HookCallbacks:
    """Chains callbacks onto communication futures and knows which ran but are not yet released."""

    def __init__(self) -> None:
        self._tokens = itertools.count()
        self._watched: dict[int, weakref.ref] = {}
        self._ran: set[int] = set()

    def then(self, future: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        """``future.then(fn)``, with ``fn``'s run and release tracked."""
        token = next(self._tokens)

        def run(done: torch.futures.Future) -> Any:
            self._ran.add(token)
            return fn(done)

        self._watched[token] = weakref.ref(run, lambda _gone: self._released(token))
        return future.then(run)

    def _released(self, token: int) -> None:
        self._watched.pop(token, None)
        self._ran.discard(token)

    @property
    def unreleased(self) -> int:
        """Callbacks that have run and that torch still holds (their release needs the GIL)."""
        return len(self._ran)

    def settle(self, limit_s: float = 5.0) -> bool:
        """Give up the GIL until every callback that ran is released (at most ``limit_s``);
        True when none is left."""
        deadline = time.monotonic() + limit_s
        while self._ran and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return not self._ran


EXIT_GRACE_S = 0.2


def let_worker_threads_finish(grace_s: float = EXIT_GRACE_S) -> None:
    """Give up the GIL for ``grace_s`` before the interpreter finalizes, in a process that used a
    process group.

    The same abort has a second source that cannot be tracked like a hook's callbacks: a gloo worker
    thread dropping the last reference to a finished collective's tensors (DDP's own buckets among
    them) also takes the GIL, and a script that exits right after its last backward can start
    finalization first (seen once in an mmengine job under the runner). A thread already waiting for
    the GIL takes it as soon as it is free, so a short grace removes the window in practice; the
    process-exit path of ``python -m ampddp.apex`` calls this, as apex's scripts end abruptly, and so
    does ``shutdown_distributed`` (a worker can still be releasing tensors after its last barrier).
    """
    time.sleep(grace_s)
