"""A fresh key namespace in torchrun's long-lived agent store, so a restarted group never reads stale keys.

Under ``torchrun`` the elastic agent hosts one TCPStore for the whole job and every restart of the
worker group (``--max-restarts``, a node joining) reuses it. torch's ``env://`` rendezvous puts the
new group's keys where the previous attempt's are still stored, so a restarted rank can read a dead
peer's address and fail with "connectFullMesh ... Connection refused" (it does, about two restarts in
three, on a 2-process gloo job). Restart counters cannot name the namespace: a node that joins later
counts from zero. Instead rank 0 draws a random token and every other rank proves it saw *this*
token before anyone uses it:

1. rank 0 publishes ``token``; each other rank reads it and answers ``ack/<token>/<rank>`` with a
   nonce of its own;
2. rank 0 waits for every answer and replies ``go/<token>/<nonce>``;
3. a rank whose reply does not come soon read a stale token left by a dead attempt, and reads again.

Keys under a fresh token or nonce cannot exist from an earlier attempt, so nothing stale is trusted.
"""

from __future__ import annotations

import datetime
import time
import uuid

import torch.distributed as dist

from ampddp.errors import RendezvousError

TOKEN_KEY = "ampddp/rendezvous/token"
RETRY_S = 1.0


def _wait(store: dist.Store, keys: list[str], seconds: float) -> bool:
    """Whether ``keys`` all appeared within ``seconds`` (at least 10 ms: a zero timeout means forever)."""
    try:
        store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.01)))
    except dist.DistStoreError:
        return False
    return True


def agree_on_namespace(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """Token every rank of this attempt agrees on, unused by any earlier attempt in ``store``."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(TOKEN_KEY, token)
        acks = [f"ampddp/rendezvous/ack/{token}/{peer}" for peer in range(1, world_size)]
        if not _wait(store, acks, timeout_s):
            missing = [peer for peer, key in enumerate(acks, start=1) if not store.check([key])]
            raise RendezvousError(
                f"rendezvous: rank(s) {missing} did not join within {timeout_s:g} s; see their logs for why they did not start, "
                "or raise distributed.timeout_s if start-up is slow"
            )
        for key in acks:
            store.set(f"ampddp/rendezvous/go/{token}/{store.get(key).decode()}", "1")
        return token
    nonce = uuid.uuid4().hex
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousError(
                f"rendezvous: rank {rank} got no reply from rank 0 within {timeout_s:g} s; see rank 0's log for why it did not "
                "start, or raise distributed.timeout_s if start-up is slow"
            )
        if _wait(store, [TOKEN_KEY], remaining):
            token = store.get(TOKEN_KEY).decode()
            store.set(f"ampddp/rendezvous/ack/{token}/{rank}", nonce)
            if _wait(store, [f"ampddp/rendezvous/go/{token}/{nonce}"], min(RETRY_S, remaining)):
                return token


def fresh_agent_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """Client of the agent's store, seen through a prefix no earlier attempt has written under.

    The handshake waits up to twice the collective timeout: with torchrun's static rendezvous each
    node restarts on its own, and another node's workers may need a whole ``timeout_s`` to notice
    (in a collective of the dead attempt) before their agent restarts them too.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ampddp/{agree_on_namespace(store, rank, world_size, 2 * timeout_s)}/", store)
