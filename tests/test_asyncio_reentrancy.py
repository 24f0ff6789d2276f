"""Reentrancy of the asyncio front-end: the asyncio task is the holder.

A nested acquire of a resource the same task holds (through a lease of
the same AsyncLockManager) is granted at once, without a round trip, and
counted; the locks go in Redis when the last lease counting on them is
released. Another task, even one the holder started, queues like everyone
else. The same rules as tests/test_reentrancy.py for threads.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from async_helpers import run, until
from celery_redislock import LockLost, LockManager, LockTimeout, LockUpgradeError
from celery_redislock.asyncio import AsyncLockManager
from engine_helpers import assert_registry_truth, counting, lock_holders

NS = "t"


def test_a_task_re_enters_what_it_holds_at_once_without_a_round_trip(
    redis_url: str, r: redis.Redis
) -> None:
    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            async with mgr.lock("A", timeout=5) as outer:
                with counting(r) as delta:
                    inner = await mgr.acquire("A")  # no timeout needed: nothing waited for
                    inner2 = await mgr.acquire(shared="A", timeout=0)  # exclusive covers shared
                assert delta == {}, delta
                assert inner.reentrant and inner2.reentrant and not outer.reentrant
                assert inner.fencing_token == outer.fencing_token == inner2.fencing_token
                assert inner.token == outer.token
                assert await inner2.release() and await inner.release()
                assert not await inner.release()
                # released by the inner leases: still held by the outer one
                assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
                assert not outer.released
                # an exception in an inner block keeps the outer lock
                with pytest.raises(RuntimeError, match="inner failed"):
                    async with mgr.lock("A"):
                        raise RuntimeError("inner failed")
                assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
                outer.check()
            assert lock_holders(r) == {}

    run(main())
    assert_registry_truth(r)


def test_the_grant_goes_when_the_last_counting_lease_is_released(
    redis_url: str, r: redis.Redis
) -> None:
    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            outer = await mgr.acquire("A", timeout=5)
            inner = await mgr.acquire("A")
            await outer.release()  # not LIFO
            assert outer.released and not inner.released
            assert list(lock_holders(r)["{t}:lock:A"]) == [outer.token]
            await inner.release()
            assert lock_holders(r) == {}
            # an outer lease left to close(): its reentrant leases go with it
            await mgr.acquire("B", timeout=5)
            await mgr.acquire("B")
        assert lock_holders(r) == {}

    run(main())
    assert_registry_truth(r)


def test_upgrade_and_the_nested_rules_as_for_threads(redis_url: str, r: redis.Redis) -> None:
    sync = LockManager(redis_url, NS, owner_ttl=5)

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            outer = await mgr.acquire(shared="A", timeout=5)
            with counting(r) as delta:
                with pytest.raises(LockUpgradeError, match="A"):
                    await mgr.acquire("A", timeout=5)
            assert delta == {}, delta
            # C is held by a thread; a thread queued for B and C must not
            # hold up the nested request for B (it waits only for holders).
            blocker = sync.acquire("C", timeout=5)
            queued = asyncio.create_task(
                asyncio.to_thread(lambda: sync.acquire(["B", "C"], timeout=20).release())
            )
            await until(lambda: r.zcard("{t}:q:B") == 1, "the thread queued on B")
            with pytest.raises(ValueError, match="finite timeout"):
                await mgr.acquire(shared=["A", "B"])  # B is new: the nested rule applies
            mixed = await mgr.acquire(shared=["A", "B"], timeout=5)
            assert mixed.reentrant and mixed.shared == ("A", "B")
            assert mixed.fencing_token > outer.fencing_token  # its own grant (B)
            holders = lock_holders(r)
            assert list(holders["{t}:lock:A"]) == [outer.token]
            assert list(holders["{t}:lock:B"]) == [mixed.token]
            await mixed.release()
            assert "{t}:lock:B" not in lock_holders(r)
            await asyncio.to_thread(blocker.release)
            await queued
            # nested=False: an ordinary request, a grant of its own that
            # waits for its own task like for anyone
            other = await mgr.acquire(shared="A", timeout=0, nested=False)
            assert not other.reentrant and other.token != outer.token
            await other.release()
            with pytest.raises(LockTimeout):
                await mgr.acquire("A", timeout=0, nested=False)
            await outer.release()
        assert lock_holders(r) == {}

    try:
        run(main())
    finally:
        sync.close()
    assert_registry_truth(r)


def test_another_task_is_another_holder_even_one_the_holder_started(
    redis_url: str, r: redis.Redis
) -> None:
    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            async with mgr.lock("A", timeout=5):
                with pytest.raises(LockTimeout):
                    await asyncio.create_task(mgr.acquire("A", timeout=0.2))
                got = await asyncio.gather(mgr.try_acquire("A"), mgr.try_acquire("A"))
                assert got == [None, None]
                child = asyncio.create_task(mgr.acquire("A", timeout=10))
                await until(lambda: r.zcard("{t}:q:A") == 1, "the child task queued")
            lease = await child  # handed over when the holder released
            assert not lease.reentrant
            await lease.release()

    run(main())
    assert lock_holders(r) == {}


def test_the_inner_lease_is_lost_with_the_outer_one(redis_url: str, r: redis.Redis) -> None:
    admin = LockManager(redis_url, NS, heartbeat=False)

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5, heartbeat_interval=0.1) as mgr:
            outer = await mgr.acquire("A", timeout=5)
            inner = await mgr.acquire("A")
            await asyncio.to_thread(
                admin.cleanup_owner, outer.owner_id, force=True, reason="operator"
            )
            await until(lambda: inner.lost, "the inner lease lost with the outer one")
            assert inner.lost_cause == outer.lost_cause == "released by operator via CLI"
            with pytest.raises(LockLost, match="operator"):
                inner.check()
            # a lost lease is not re-entered: a new acquire is a fresh grant
            fresh = await mgr.acquire("A", timeout=5)
            assert not fresh.reentrant and fresh.fencing_token > outer.fencing_token
            await fresh.release()
            await inner.release()
            await outer.release()

    try:
        run(main())
    finally:
        admin.close()
    assert lock_holders(r) == {}
