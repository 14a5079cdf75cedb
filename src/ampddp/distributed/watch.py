"""Turn a dead or hung peer into an error that names it.

When a rank dies, the others see only a backend error ("Connection closed by peer") or a timeout.
``PeerWatch`` keeps a heartbeat counter per rank in the process group's key-value store; when a
collective fails inside ``watch.guard()``, it checks whose counter stopped advancing and raises
``PeerFailureError`` naming those ranks. Counters (not clocks) are compared, so hosts need not
agree on the time.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ampddp.distributed.env import DistEnv
from ampddp.errors import PeerFailureError

KEY = "ampddp/heartbeat/{rank}"
COLLECTIVE_MARKERS = (
    "gloo",
    "nccl",
    "processgroup",
    "connection",
    "timed out",
    "timeout",
    "socket",
    "peer",
    "watchdog",
    "store",
    "tcpstore",
    "filestore",
)
"""Words in the message of a plain RuntimeError that come from a collective or its transport."""


def is_distributed_error(error: BaseException) -> bool:
    """True for errors a collective or the rendezvous store raised: torch's ``DistError`` family,
    or a plain ``RuntimeError`` from the transport (gloo raises those). ampddp's own errors,
    out-of-memory and other ``RuntimeError`` subclasses keep their type and message."""
    if isinstance(error, dist.DistError):
        return True
    if type(error) is not RuntimeError:
        return False
    words = re.findall(r"[a-z]+(?: out)?", str(error).lower())
    return any(marker in words for marker in COLLECTIVE_MARKERS)


def _default_store() -> Any:
    # torch exposes the default group's store only privately; without it, errors stay unnamed.
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    return getter() if getter is not None else None


class PeerWatch:
    """Context manager: heartbeat thread while active; ``guard()`` names silent ranks on failure."""

    def __init__(self, env: DistEnv, interval_s: float = 0.5) -> None:
        self.env = env
        self.interval_s = interval_s
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeerWatch:
        if self.env.distributed and dist.is_initialized():
            self._store = _default_store()
        if self._store is not None:
            self._store.set(KEY.format(rank=self.env.rank), "0")
            self._thread = threading.Thread(target=self._beat, name="ampddp-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            count += 1
            try:
                self._store.set(KEY.format(rank=self.env.rank), str(count))
            except RuntimeError:
                return

    def _counters(self) -> dict[int, str | None]:
        counters: dict[int, str | None] = {}
        for rank in range(self.env.world_size):
            key = KEY.format(rank=rank)
            counters[rank] = self._store.get(key).decode() if self._store.check([key]) else None
        return counters

    def silent_ranks(self) -> list[int] | None:
        """Ranks whose heartbeat did not advance over a few intervals (None: the store is gone)."""
        if self._store is None:
            return []
        try:
            before = self._counters()
            time.sleep(3 * self.interval_s)
            after = self._counters()
        except RuntimeError:
            return None
        return [
            rank for rank in range(self.env.world_size) if rank != self.env.rank and (after[rank] is None or after[rank] == before[rank])
        ]

    def explain(self, error: BaseException) -> PeerFailureError:
        silent = self.silent_ranks()
        where = f"rank {self.env.rank} of {self.env.world_size}"
        if silent is None:
            who = (
                f"the rendezvous store at {self.env.master_addr}:{self.env.master_port} no longer answers, so rank 0 "
                "(or the launcher hosting the store) died"
            )
        elif silent:
            who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped responding (dead or hung)"
        else:
            who = "no peer looks dead; the collective itself failed or timed out"
        return PeerFailureError(f"{where}: a collective failed because {who}. Original error: {error}")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Re-raise a failing collective's error as PeerFailureError naming the silent ranks; any
        other error (a non-finite model, a checkpoint problem, out of memory) passes unchanged."""
        try:
            yield
        except RuntimeError as error:
            if not self.env.distributed or not is_distributed_error(error):
                raise
            raise self.explain(error) from error
