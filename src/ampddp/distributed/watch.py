"""Turn a dead, hung or stuck peer into an error that names it.

When a rank dies, the others see only a backend error ("Connection closed by peer") or a timeout.
``PeerWatch`` keeps a heartbeat per rank in the process group's key-value store: a counter, and where
the rank is in its step (loading data, forward, backward, ...) with the seconds it has been there.
When a collective fails inside ``watch.guard()``, it checks whose counter stopped advancing (dead or
hung) and, among the living, who has been in one phase for most of the timeout (alive but stuck: a
data set or user code that does not return), and raises ``PeerFailureError`` naming them. Counters
and durations (not clocks) are compared, so hosts need not agree on the time.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
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
STUCK_SHARE = 0.5
"""A living peer in one phase for this share of the collective timeout or more is named as stuck there."""
Where = Callable[[], tuple[str, float]]
"""This rank's phase in words and the seconds it has been in it (``ampddp.training.phase.StepPhase.where``)."""


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
    """Context manager: heartbeat thread while active; ``guard()`` names silent and stuck ranks on failure.
    ``where``: what the heartbeat says of this rank's progress (nothing when None)."""

    def __init__(self, env: DistEnv, interval_s: float = 0.5, where: Where | None = None) -> None:
        self.env = env
        self.interval_s = interval_s
        self.where = where
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeerWatch:
        if self.env.distributed and dist.is_initialized():
            self._store = _default_store()
        if self._store is not None:
            self._store.set(KEY.format(rank=self.env.rank), self._heartbeat(0))
            self._thread = threading.Thread(target=self._beat, name="ampddp-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s)

    def _heartbeat(self, count: int) -> str:
        where, seconds = self.where() if self.where is not None else (None, 0.0)
        return json.dumps({"beat": count, "where": where, "for_s": round(seconds, 1)})

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            count += 1
            try:
                self._store.set(KEY.format(rank=self.env.rank), self._heartbeat(count))
            except RuntimeError:
                return

    def _heartbeats(self) -> dict[int, dict | None]:
        beats: dict[int, dict | None] = {}
        for rank in range(self.env.world_size):
            key = KEY.format(rank=rank)
            beats[rank] = _parsed(self._store.get(key)) if self._store.check([key]) else None
        return beats

    def peer_states(self) -> tuple[list[int], dict[int, tuple[str, float]]] | None:
        """The other ranks whose heartbeat did not advance over a few intervals, and the living ones'
        phase and seconds in it (None: the store is gone)."""
        if self._store is None:
            return [], {}
        try:
            before = self._heartbeats()
            time.sleep(3 * self.interval_s)
            after = self._heartbeats()
        except RuntimeError:
            return None
        others = [rank for rank in range(self.env.world_size) if rank != self.env.rank]
        silent = [rank for rank in others if after[rank] is None or after[rank]["beat"] == (before[rank] or {}).get("beat")]
        alive = {rank: (after[rank]["where"], after[rank]["for_s"]) for rank in others if rank not in silent and after[rank]["where"]}
        return silent, alive

    def explain(self, error: BaseException) -> PeerFailureError:
        states = self.peer_states()
        where = f"rank {self.env.rank} of {self.env.world_size}"
        if states is None:
            who = (
                f"the rendezvous store at {self.env.master_addr}:{self.env.master_port} no longer answers, so rank 0 "
                "(or the launcher hosting the store) died"
            )
        else:
            who = self._who(*states)
        return PeerFailureError(f"{where}: a collective failed because {who}. Original error: {error}")

    def _who(self, silent: list[int], alive: dict[int, tuple[str, float]]) -> str:
        """The peers to blame, in words: silent ones first, else the living ones stuck in one phase."""
        if silent:
            return f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped responding (dead or hung)"
        stuck = [(rank, phase, seconds) for rank, (phase, seconds) in alive.items() if seconds >= STUCK_SHARE * self.env.timeout_s]
        if stuck:
            named = "; ".join(f"rank {rank} has been in {phase} for {seconds:.0f} s" for rank, phase, seconds in stuck)
            return f"a peer is alive but not progressing: {named} (a data set, sampler or user code that does not return?)"
        return "no peer looks dead or stuck; the collective itself failed or timed out"

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


def _parsed(raw: bytes) -> dict:
    """A heartbeat as written by ``PeerWatch._heartbeat`` (or an older bare counter)."""
    try:
        beat = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        beat = None
    if isinstance(beat, int):
        return {"beat": beat, "where": None, "for_s": 0.0}
    return beat if isinstance(beat, dict) else {"beat": None, "where": None, "for_s": 0.0}
