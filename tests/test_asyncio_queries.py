"""What an asyncio holder asks about its locks: ``AsyncLockManager.holders``
and ``AsyncLease.wait_for_contender``, as the threaded manager's."""

from __future__ import annotations

import asyncio

import pytest
import redis

from async_helpers import run, until
from celery_redislock import InvalidResource, LockHolder, LockManager
from celery_redislock.asyncio import AsyncLockManager

NS = "t"


def test_holders_lists_each_grant_as_the_threaded_manager_does(
    redis_url: str, r: redis.Redis
) -> None:
    sync = LockManager(redis_url, NS, owner_ttl=5)

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            assert await mgr.holders("free") == []
            mine = await mgr.acquire("x", shared="s", limited={"pool": 3}, timeout=5)
            theirs = await asyncio.to_thread(sync.acquire, shared="s", limited={"pool": 3})
            got = await mgr.holders("s")
            assert got == await asyncio.to_thread(sync.holders, "s")
            assert {h.token for h in got} == {mine.token, theirs.token}
            assert all(isinstance(h, LockHolder) and h.mode == "shared" for h in got)
            (x,) = await mgr.holders("x")
            assert (x.mode, x.owner_id, x.fencing_token) == (
                "exclusive",
                mgr.owner_id,
                mine.fencing_token,
            )
            pool = {h.token: h for h in await mgr.holders("pool")}
            assert pool[mine.token].mode == "limited" and pool[mine.token].limit == 3
            with pytest.raises(InvalidResource):
                await mgr.holders("")
            await asyncio.to_thread(theirs.release)
            await mine.release()
            assert await mgr.holders("x") == []

    try:
        run(main())
    finally:
        sync.close()


def test_wait_for_contender_is_woken_by_a_waiter_of_either_world(
    redis_url: str, r: redis.Redis
) -> None:
    sync = LockManager(redis_url, NS, owner_ttl=5)

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            lease = await mgr.acquire("a", shared="b", timeout=5)
            # nobody waits: blocks (XREAD) for the whole timeout, then False
            assert not await lease.wait_for_contender(0.05)
            # the event loop stays free while the holder waits
            watcher = asyncio.create_task(lease.wait_for_contender(30))
            await until(lambda: r.exists("{t}:contended:a"), "the holder watches")
            assert not watcher.done()
            waiter = asyncio.create_task(asyncio.to_thread(sync.acquire, "a", timeout=30))
            assert await watcher
            assert await lease.contenders() == 1
            await lease.release()  # handed to the waiting thread
            got = await waiter
            await asyncio.to_thread(got.release)
            # a coroutine waiting on another manager wakes a sync holder too
            held = await asyncio.to_thread(sync.acquire, shared="b", exclusive="c")
            other = asyncio.create_task(mgr.acquire("c", timeout=30))
            assert await asyncio.to_thread(held.wait_for_contender, 30)
            await asyncio.to_thread(held.release)
            await (await other).release()
            with pytest.raises(ValueError):
                await (await mgr.acquire("d")).wait_for_contender(-1)

    try:
        run(main())
    finally:
        sync.close()
