"""A restarted torchrun group agrees on a namespace no earlier attempt wrote to, whatever the timing."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from ampddp.distributed.rendezvous import TOKEN_KEY, agree_on_namespace, fresh_agent_store
from ampddp.errors import PeerFailureError


def run_attempt(store: dist.Store, world_size: int, start_delays: dict[int, float]) -> dict[int, str]:
    """Every rank in its own thread, each starting after its delay; returns the token each rank chose."""
    chosen: dict[int, str] = {}

    def rank_main(rank: int) -> None:
        time.sleep(start_delays.get(rank, 0.0))
        chosen[rank] = agree_on_namespace(store, rank, world_size, timeout_s=20)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return chosen


@pytest.mark.parametrize("late_rank_zero", [0.0, 1.5])
def test_every_attempt_gets_one_new_namespace_even_when_old_keys_remain(late_rank_zero):
    store = dist.HashStore()
    first = run_attempt(store, 3, {})
    assert len(set(first.values())) == 1
    # The next attempt finds the first one's token, acks and replies still in the store. With rank 0
    # late, ranks 1 and 2 read the stale token first and must not settle on it.
    second = run_attempt(store, 3, {0: late_rank_zero})
    assert len(second) == 3 and len(set(second.values())) == 1
    assert set(second.values()) != set(first.values())
    assert store.get(TOKEN_KEY).decode() == second[0]


def test_a_rank_that_never_joins_is_named_and_the_others_give_up_too():
    store = dist.HashStore()
    errors: list[Exception] = []

    def rank_one() -> None:
        try:
            agree_on_namespace(store, 1, 3, timeout_s=2)
        except PeerFailureError as error:
            errors.append(error)

    helper = threading.Thread(target=rank_one)
    helper.start()
    with pytest.raises(PeerFailureError, match=r"rank\(s\) \[2\] did not join within 1 s"):
        agree_on_namespace(store, 0, 3, timeout_s=1)
    helper.join(timeout=10)
    assert len(errors) == 1 and str(errors[0]).startswith("rendezvous: rank 1 got no reply from rank 0 within 2 s; see rank 0's log")


def test_rank_zero_never_answering_is_an_error():
    with pytest.raises(PeerFailureError, match=r"rank 1 got no reply from rank 0 within 0\.5 s"):
        agree_on_namespace(dist.HashStore(), 1, 2, timeout_s=0.5)


def test_agent_store_clients_share_one_fresh_prefix_per_attempt():
    """Over a real TCPStore (as torchrun's agent hosts it): each attempt's keys live apart from the last."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    attempts = []
    for _ in range(2):
        stores: dict[int, dist.Store] = {}

        def rank_main(rank: int, stores: dict[int, dist.Store] = stores) -> None:
            stores[rank] = fresh_agent_store("127.0.0.1", agent.port, rank, 2, timeout_s=20)

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not stores[0].check(["address/1"]), "a previous attempt's key is visible"
        stores[1].set("address/1", f"attempt-{len(attempts)}")
        assert stores[0].get("address/1").decode() == f"attempt-{len(attempts)}"
        attempts.append(stores)
    assert attempts[0][0].get("address/1") == b"attempt-0"


def test_rank_zero_never_answering_over_tcp_is_an_error():
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(PeerFailureError, match="rank 1 got no reply from rank 0"):
        fresh_agent_store("127.0.0.1", agent.port, 1, 2, timeout_s=0.25)  # waits twice the collective timeout
