"""Joining the process group: bounded by ``distributed.timeout_s`` on every rank, every failure one sentence.

torch's own join has three ways to leave a user waiting or reading C++: a peer that never arrives ends
in a ``DistStoreError`` traceback, a MASTER_PORT held by a program that accepts connections but never
answers hangs its clients for minutes and ends in a C++ frame dump, and ranks started with different
WORLD_SIZE values fail after minutes in gloo's ``connectFullMesh``. ampddp joins in steps it can name:

1. the rendezvous store: rank 0 listens on MASTER_PORT (a port in use is refused at once); the others
   first check that something answers at MASTER_ADDR:MASTER_PORT with a plain connection (a store
   client's own retries print C++ errors), then connect;
2. introductions: each rank writes its rank, world size, host and pid, and waits for every other's,
   comparing world sizes as they come (a disagreement, or two processes with one RANK, is refused
   at once, naming both) until all are there or the time is up (naming who never arrived);
3. the process group itself, over that store.

A C++ call that never returns cannot be interrupted from Python, so a watchdog thread bounds the
whole join: past the bound (a few seconds after the steps' own), it prints one line naming the step
and what to check, and ends the process with ``EXIT_PEER_FAILURE``. Nothing is written before a run
has joined, so there is nothing to leave half-way.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import threading
import time
from typing import Any, Protocol

import torch.distributed as dist

from ampddp.distributed.rendezvous import fresh_agent_store
from ampddp.errors import EXIT_PEER_FAILURE, ConfigError, RendezvousError, escape_controls

GRACE_S = 5.0
"""How long past the join's own bound the watchdog waits before it ends the process."""
POLL_S = 0.1
INTRODUCTION_KEY = "ampddp/join/rank/{rank}"
CLAIM_KEY = "ampddp/join/claims/{rank}"
GROUP_PREFIX = "ampddp/group/"


class Place(Protocol):
    """Where a process joins: the rendezvous facts of a ``DistEnv`` (``ampddp.distributed.env``)."""

    rank: int
    world_size: int
    backend: str | None
    timeout_s: float
    init_method: str | None
    master_addr: str | None
    master_port: int | None
    agent_store: bool


class JoinWatchdog:
    """Ends this process with one line on stderr when the join outlasts ``seconds`` (a C++ call that
    never returns). ``doing`` and ``advice`` say, at any moment, what the line would name."""

    def __init__(self, place: Place, seconds: float) -> None:
        self.place, self.seconds = place, seconds
        self.doing = "joining the process group"
        self.advice = "check that every rank was started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ampddp-join-watchdog", daemon=True)

    def __enter__(self) -> JoinWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        line = (
            f"ampddp: error: {who(self.place)}: {self.doing} did not end within {self.seconds:.0f} s "
            f"(distributed.timeout_s={self.place.timeout_s:g}); {self.advice}"
        )
        try:
            os.write(2, escape_controls(line).encode("utf-8", "replace") + b"\n")
        finally:
            os._exit(EXIT_PEER_FAILURE)


def join_process_group(place: Place) -> None:
    """Create the default process group for ``place``, bounded and with one-line failures (see module)."""
    budget = place.timeout_s * (2 if place.agent_store else 1)  # a torchrun restart may wait out a dead attempt first
    with JoinWatchdog(place, budget + GRACE_S) as watch:
        deadline = time.monotonic() + budget
        store = _rendezvous_store(place, watch, deadline)
        watch.doing, watch.advice = "waiting for the other ranks to arrive", "see the other ranks' logs for why they did not start"
        introduce(store, place, deadline)
        watch.doing = "connecting to the other ranks (all arrived)"
        watch.advice = "check that every host can reach the others' addresses (a firewall; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
        try:
            dist.init_process_group(backend=place.backend, store=dist.PrefixStore(GROUP_PREFIX, store), rank=place.rank,
                                    world_size=place.world_size, timeout=datetime.timedelta(seconds=place.timeout_s))  # fmt: skip
        except RuntimeError as error:
            raise RendezvousError(f"{who(place)}: every rank arrived, but they could not connect to each other ({_first_line(error)}); "
                                   f"{watch.advice}") from None  # fmt: skip


def _rendezvous_store(place: Place, watch: JoinWatchdog, deadline: float) -> dist.Store:
    """The store every rank of this attempt meets in: torchrun's agent store (a fresh namespace of
    it), a file store, or a TCP store rank 0 hosts at MASTER_ADDR:MASTER_PORT."""
    timeout = datetime.timedelta(seconds=place.timeout_s)
    if place.agent_store:
        watch.doing = f"meeting the other ranks in torchrun's store at {place.master_addr}:{place.master_port}"
        return fresh_agent_store(place.master_addr, place.master_port, place.rank, place.world_size, place.timeout_s)
    if place.init_method is not None and place.init_method.startswith("file://"):
        watch.doing, watch.advice = f"opening the rendezvous file {place.init_method[7:]}", "check that every rank can reach that file"
        return dist.FileStore(place.init_method[7:], place.world_size)
    if place.master_addr is None or place.master_port is None:
        raise ConfigError(f"{who(place)}: no rendezvous address: set MASTER_ADDR and MASTER_PORT (or give init_method='tcp://HOST:PORT')")
    where = f"{place.master_addr}:{place.master_port}"
    if place.rank == 0:
        watch.doing = f"listening for the other ranks on port {place.master_port}"
        try:
            return dist.TCPStore(place.master_addr, place.master_port, place.world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False)  # fmt: skip
        except RuntimeError as error:
            if "EADDRINUSE" in str(error) or "address already in use" in str(error):
                raise ConfigError(f"{who(place)}: cannot listen on MASTER_PORT={place.master_port}: another program uses that port; "
                                  "choose a free port for MASTER_PORT") from None  # fmt: skip
            raise RendezvousError(f"{who(place)}: cannot host the rendezvous at {where} ({_first_line(error)})") from None
    watch.doing = f"reaching rank 0's rendezvous at {where}"
    watch.advice = "check MASTER_ADDR/MASTER_PORT and that rank 0 started (its log says why not)"
    reach(place, deadline)
    watch.doing = f"connecting to rank 0's rendezvous at {where}"
    watch.advice = ("something accepts connections there but does not answer as rank 0's store: another program may hold "
                    "MASTER_PORT, or the ranks were given different MASTER_ADDR/MASTER_PORT")  # fmt: skip
    remaining = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01))
    return dist.TCPStore(place.master_addr, place.master_port, place.world_size, is_master=False, timeout=remaining)


def reach(place: Place, deadline: float) -> None:
    """Return once something accepts a connection at MASTER_ADDR:MASTER_PORT; raise, naming why, when
    nothing has by ``deadline`` (refused: nothing listens; no answer: the host cannot be reached)."""
    where = f"{place.master_addr}:{place.master_port}"
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((place.master_addr, place.master_port), timeout=max(min(deadline - time.monotonic(), 2.0), 0.01)):
                return
        except socket.gaierror as error:
            raise ConfigError(f"{who(place)}: MASTER_ADDR={place.master_addr} is not a host name this machine can resolve "
                              f"({error.strerror or error}); give rank 0's host name or address") from None  # fmt: skip
        except OSError as error:
            last = error
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
    if last is not None and last.errno == errno.ECONNREFUSED:
        why = "nothing listens there: rank 0 did not start (its log says why), or the ranks were given different MASTER_ADDR/MASTER_PORT"
    else:
        reason = "no answer" if last is None or isinstance(last, TimeoutError) else (last.strerror or str(last))
        why = f"that address cannot be reached from this host ({reason}): check MASTER_ADDR and the network between the hosts"
    raise RendezvousError(f"{who(place)}: no rendezvous at {where} within distributed.timeout_s={place.timeout_s:g} s; {why}")


def introduce(store: dist.Store, place: Place, deadline: float) -> None:
    """Write who this rank is, then wait until every rank of the world has, refusing at once a rank
    with another world size or a RANK two processes claim; naming, at ``deadline``, the ranks missing."""
    if store.add(CLAIM_KEY.format(rank=place.rank), 1) > 1:
        raise ConfigError(f"{who(place)}: another process already joined as RANK={place.rank}; start every process with its own "
                          f"RANK, 0 to {place.world_size - 1}")  # fmt: skip
    me = {"world_size": place.world_size, "host": socket.gethostname(), "pid": os.getpid()}
    store.set(INTRODUCTION_KEY.format(rank=place.rank), json.dumps(me))
    arrived: dict[int, dict[str, Any]] = {}
    while True:
        for rank in range(place.world_size):
            key = INTRODUCTION_KEY.format(rank=rank)
            if rank not in arrived and store.check([key]):
                arrived[rank] = _introduction(store.get(key))
                _compare(place, rank, arrived[rank])
        if len(arrived) == place.world_size:
            return
        if time.monotonic() >= deadline:
            missing = [rank for rank in range(place.world_size) if rank not in arrived]
            raise RendezvousError(f"{who(place)}: rank(s) {_listed(missing)} never arrived within distributed.timeout_s="
                                   f"{place.timeout_s:g} s (arrived: {_listed(sorted(arrived))}); see the missing ranks' logs for why "
                                   "they did not start, or raise distributed.timeout_s if start-up is slow")  # fmt: skip
        time.sleep(POLL_S)


def _introduction(raw: bytes) -> dict[str, Any]:
    try:
        facts = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        facts = None
    return facts if isinstance(facts, dict) else {"world_size": None, "host": "?", "pid": "?"}


def _compare(place: Place, rank: int, facts: dict[str, Any]) -> None:
    if facts.get("world_size") != place.world_size:
        other = f"rank {rank} (pid {facts.get('pid')} on {facts.get('host')}) with WORLD_SIZE={facts.get('world_size')}"
        raise ConfigError(f"{who(place)} was started with WORLD_SIZE={place.world_size}, but {other}; give every rank the same world size")


def who(place: Place) -> str:
    """'rank R of W', as each line of a join failure begins."""
    return f"rank {place.rank} of {place.world_size}"


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(error).__name__
