"""Reentrancy: a nested acquire of a resource the same thread, greenlet or
task already holds is granted at once, without a round trip, and counted;
the locks go in Redis when the last lease counting on them is released.
Other threads of the process queue like everyone else."""

from __future__ import annotations

import threading

import pytest
import redis

from celery_redislock import LockLost, LockTimeout, LockUpgradeError
from engine_helpers import (
    Managers,
    assert_registry_truth,
    counting,
    lock_holders,
    wait_until,
)


def test_nested_acquire_of_a_held_resource_is_granted_at_once_without_a_round_trip(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    with mgr.lock("A", timeout=5) as outer:
        with counting(r) as delta:
            # No timeout needed (nothing is waited for), and no command sent.
            inner = mgr.acquire("A")
            inner2 = mgr.acquire(shared="A", timeout=0)  # exclusive covers shared
        assert delta == {}, delta
        assert inner.reentrant and inner2.reentrant
        assert inner.fencing_token == outer.fencing_token == inner2.fencing_token
        assert inner.token == outer.token
        inner2.release()
        inner.release()
        # Released by the inner leases: still held by the outer one in Redis.
        assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
        assert not outer.released
    assert lock_holders(r) == {}
    assert_registry_truth(r)


def test_an_exception_in_the_inner_block_keeps_the_outer_lock(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    other = managers()
    with mgr.lock("A", timeout=5) as outer:
        with pytest.raises(RuntimeError, match="inner failed"):
            with mgr.lock("A"):
                raise RuntimeError("inner failed")
        assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
        with pytest.raises(LockTimeout):
            other.acquire("A", timeout=0)
        outer.check()
    assert lock_holders(r) == {}
    with other.lock("A", timeout=0):
        pass


def test_the_grant_is_released_when_the_last_counting_lease_is_released(
    managers: Managers, r: redis.Redis
) -> None:
    # Not LIFO: the outer lease is released first; the inner one still
    # counts on the grant, which goes when the inner one is released.
    mgr = managers()
    outer = mgr.acquire("A", timeout=5)
    inner = mgr.acquire("A")
    outer.release()
    assert outer.released and not inner.released
    assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
    inner.release()
    assert lock_holders(r) == {}
    assert_registry_truth(r)


def test_exclusive_request_while_holding_only_shared_is_refused_not_a_deadlock(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    with mgr.lock(shared="A", timeout=5) as outer:
        with counting(r) as delta:
            with pytest.raises(LockUpgradeError, match="A"):
                mgr.acquire("A", timeout=5)
            with pytest.raises(ValueError):  # LockUpgradeError is a ValueError
                mgr.acquire(["B", "A"], timeout=5)
        assert delta == {}, delta
        with mgr.lock(shared="A") as inner:  # shared again: reentrant
            assert inner.fencing_token == outer.fencing_token
    assert lock_holders(r) == {}


def test_partly_held_request_counts_the_held_ones_and_acquires_the_rest_nested(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    waiter_mgr = managers()
    with mgr.lock("A", timeout=5) as outer:
        # A waiter queued for B must not hold up the nested request (it waits
        # only for holders, never behind queued waiters).
        blocker = waiter_mgr.acquire("C", timeout=5)
        queued = threading.Thread(
            target=lambda: waiter_mgr.acquire(["B", "C"], timeout=20).release(), daemon=True
        )
        queued.start()
        wait_until(lambda: r.zcard("{t}:q:B") == 1, what="the waiter queued on B")
        with pytest.raises(ValueError, match="finite timeout"):
            mgr.acquire(["A", "B"])  # B is new: the nested rule applies
        mixed = mgr.acquire(["A", "B"], timeout=5)
        assert mixed.reentrant and mixed.exclusive == ("A", "B")
        assert mixed.fencing_token > outer.fencing_token  # its own grant (B)
        holders = lock_holders(r)
        assert list(holders["{t}:lock:A"]) == [outer.token]
        assert list(holders["{t}:lock:B"]) == [mixed.token]
        # A reentrant acquire of both now counts on the outer and the mixed lease.
        both = mgr.acquire(["A", "B"])
        assert both.fencing_token == mixed.fencing_token
        mixed.release()
        assert list(lock_holders(r)["{t}:lock:B"]) == [mixed.token]  # `both` still counts
        both.release()
        assert "{t}:lock:B" not in lock_holders(r)
        assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
        blocker.release()
        queued.join(20)
        assert not queued.is_alive()
    assert lock_holders(r) == {}
    assert_registry_truth(r)


def test_another_thread_of_the_process_queues_like_everyone_else(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    outer = mgr.acquire("A", timeout=5)
    got: list[object] = []

    def other_thread() -> None:
        try:
            got.append(mgr.acquire("A", timeout=0.3))
        except LockTimeout as exc:
            got.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(20)
    assert isinstance(got[0], LockTimeout)
    outer.release()
    assert lock_holders(r) == {}


def test_inner_lease_reflects_the_outer_lease_being_lost(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers(heartbeat_interval=0.1)
    admin = managers(heartbeat=False)
    outer = mgr.acquire("A", timeout=5)
    inner = mgr.acquire("A")
    admin.cleanup_owner(outer.owner_id, force=True, reason="operator")
    wait_until(lambda: inner.lost, what="the inner lease lost with the outer one")
    assert inner.lost_cause == outer.lost_cause == "released by operator via CLI"
    with pytest.raises(LockLost, match="operator"):
        inner.check()
    # A lost lease is not re-entered: a new acquire is a fresh grant.
    fresh = mgr.acquire("A", timeout=5)
    assert not fresh.reentrant and fresh.fencing_token > outer.fencing_token
    fresh.release()
    inner.release()
    outer.release()


def test_a_thread_holding_many_leases_plans_an_unrelated_acquire_without_looking_at_them(
    managers: Managers,
) -> None:
    """Whether a request re-enters a held lease is decided from its own
    names (an index of the names the thread holds), so a thread holding
    thousands of locks acquires another without a pass over its leases."""
    from celery_redislock.engine.reentry import plan

    mgr = managers()
    leases = [mgr.acquire(f"many-{i}", timeout=0) for i in range(50)]
    depth = mgr.state.depth()
    looked: list[str] = []

    class Watched(type(depth.leases)):  # type: ignore[misc]
        def __iter__(self):  # type: ignore[no-untyped-def]
            looked.append("leases")
            return super().__iter__()

    depth.leases = Watched(depth.leases)
    unrelated = mgr.requests.get(["other"], None, None)
    assert plan(mgr.state, depth, unrelated) is None
    assert looked == []
    related = mgr.requests.get(["many-7"], None, None)
    got = plan(mgr.state, depth, related)
    assert got is not None and got.parents == (leases[7],) and looked == ["leases"]
    for lease in leases:
        lease.release()
    assert depth.names == {} and not depth.leases
