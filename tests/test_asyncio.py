"""The asyncio front-end (celery_redislock.asyncio) against a real redis-server.

Plain tests that run their coroutines with ``asyncio.run`` (no plugin):
the API and its validation, one queue shared with threaded managers (arrival
order, hand-off by push, one fencing counter), limited resources,
cancellation at every await point leaving nothing in Redis, a Redis restart
marking a lease lost, the local deadline, ``CLIENT KILL`` ridden out while
waiting, and a forked child's fresh owner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import pytest
import redis

from async_helpers import run, until
from celery_redislock import (
    ConfigurationError,
    InvalidResource,
    LockError,
    LockLost,
    LockManager,
    LockTimeout,
)
from celery_redislock.asyncio import AsyncLease, AsyncLockManager
from celery_redislock.protocol.keys import Keyspace
from engine_helpers import wait_until
from redis_server import RedisServer

NS = "t"
KEYS = Keyspace(NS)


def queued(r: redis.Redis, resource: str) -> int:
    return int(r.zcard(KEYS.queue(resource)))


def request_keys(r: redis.Redis) -> list[str]:
    """Every key of a request, grant or queue entry left in the namespace."""
    out = []
    for key in r.scan_iter(match="{t}:*", count=1000):
        name = key.decode()
        kind = name.split(":", 2)[1]
        held = kind == "held" and r.hlen(key)  # an empty registry is no leftover
        if held or kind in ("lock", "q", "req", "wake", "waits", "holder", "contended"):
            out.append(name)
    return sorted(out)


# -- the API -----------------------------------------------------------------


def test_acquire_release_lock_and_queries(redis_url: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            lease = await mgr.acquire("a", shared=["s"], timeout=1)
            assert isinstance(lease, AsyncLease)
            assert lease.exclusive == ("a",) and lease.shared == ("s",)
            assert lease.owner_id == mgr.owner_id
            assert await mgr.is_locked("a") and await mgr.is_locked("s")
            assert not await mgr.is_locked("free")
            assert await lease.contenders() == 0
            lease.check()
            assert not lease.lost and lease.lost_cause is None
            assert lease.deadline > time.monotonic()
            # another task is another holder (this one would re-enter)
            assert await asyncio.create_task(mgr.try_acquire("a")) is None
            with pytest.raises(LockTimeout):
                await asyncio.create_task(mgr.acquire("a", timeout=0.05))
            assert await mgr.try_acquire("a", nested=False) is None
            assert await lease.release() is True
            assert await lease.release() is False
            assert lease.released and not await mgr.is_locked("a")
            async with mgr.lock("a", timeout=1) as held:
                assert await mgr.is_locked("a")
            assert held.released and not await mgr.is_locked("a")
            got = await mgr.try_acquire(exclusive=["x", "y"])
            assert got is not None and got.fencing_token > lease.fencing_token
            async with got:
                pass
        assert mgr.closed
        with pytest.raises(LockError, match="closed"):
            await mgr.acquire("a")

    run(main())
    assert request_keys(r) == []
    # close() retired the owner: no liveness key is left behind
    assert not list(r.scan_iter(match="{t}:alive:*"))


def test_the_same_validation_and_exceptions_as_the_threaded_manager(redis_url: str) -> None:
    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr:
            with pytest.raises(InvalidResource):
                await mgr.acquire("bad name\n")
            with pytest.raises(ValueError):
                await mgr.acquire()
            with pytest.raises(ValueError):
                await mgr.acquire("a", timeout=-1)
            with pytest.raises(InvalidResource):
                await mgr.is_locked("")
            lease = await mgr.acquire(limited={"pool": 2})
            # a name taken limited is only ever taken limited
            with pytest.raises(InvalidResource):
                await mgr.acquire("pool", timeout=0)
            await lease.release()

    run(main())
    with pytest.raises(ConfigurationError, match="owner_ttl"):
        AsyncLockManager(redis_url, NS, owner_ttl=0)
    # the threaded manager's URL rules (no connection is made here)
    with pytest.raises(ConfigurationError, match="redis_url"):
        AsyncLockManager("sentinel://127.0.0.1:26379/", NS)  # no service name
    with pytest.raises(ConfigurationError, match="redis_url"):
        AsyncLockManager("redis+cluster://127.0.0.1:7000/?bogus=1", NS)
    assert AsyncLockManager("sentinel://127.0.0.1:26379/mymaster", NS).url == (
        "sentinel://127.0.0.1:26379/mymaster/0"
    )
    sync_client = redis.Redis.from_url(redis_url)
    with pytest.raises(ConfigurationError, match="synchronous"):
        AsyncLockManager(sync_client, NS)  # type: ignore[arg-type]
    sync_client.close()


def test_a_ready_asyncio_client_is_used_and_left_open(redis_url: str) -> None:
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        async with AsyncLockManager(client, NS, owner_ttl=5) as mgr:
            assert mgr.url.startswith("redis://127.0.0.1:")
            async with mgr.lock("a"):
                pass
        assert await client.ping()  # close() leaves a client it was given open
        await client.aclose()

    run(main())


def test_a_manager_is_bound_to_the_loop_it_is_first_used_on(redis_url: str) -> None:
    mgr = AsyncLockManager(redis_url, NS, owner_ttl=5)

    async def first() -> None:
        async with mgr.lock("a"):
            pass

    async def second() -> None:
        with pytest.raises(LockError, match="another event loop"):
            await mgr.acquire("a")

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(first())
        run(second())
        loop.run_until_complete(mgr.close())
    finally:
        loop.close()


# -- one queue for both worlds -------------------------------------------------


def test_threads_and_coroutines_wait_in_one_queue_in_arrival_order(
    redis_url: str, r: redis.Redis
) -> None:
    sync = LockManager(redis_url, NS, owner_ttl=5)
    served: list[tuple[str, int]] = []
    threads: list[threading.Thread] = []

    def thread_waiter(label: str) -> None:
        with sync.acquire("a", timeout=20) as lease:
            served.append((label, lease.fencing_token))

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as amgr:
            holder = sync.acquire("a", timeout=1)

            async def coro_waiter(label: str) -> None:
                async with amgr.lock("a", timeout=20) as lease:
                    served.append((label, lease.fencing_token))

            tasks = []
            # Arrival order is the order the requests reach the queue: each
            # waiter starts once the one before it is queued.
            for i, kind in enumerate(["thread", "coro", "thread", "coro", "coro", "thread"]):
                label = f"{kind}{i}"
                if kind == "thread":
                    th = threading.Thread(target=thread_waiter, args=(label,))
                    th.start()
                    threads.append(th)
                else:
                    tasks.append(asyncio.create_task(coro_waiter(label)))
                await until(lambda n=i + 1: queued(r, "a") == n, f"{label} queued")
            holder.release()
            await asyncio.gather(*tasks)
            await until(lambda: len(served) == 6, "every waiter served")
            for th in threads:
                await asyncio.to_thread(th.join, 10)

    try:
        run(main())
    finally:
        sync.close()
    labels = [label for label, _ in served]
    assert labels == ["thread0", "coro1", "thread2", "coro3", "coro4", "thread5"]
    fences = [fence for _, fence in served]
    assert fences == sorted(fences) and len(set(fences)) == 6
    assert request_keys(r) == []


def test_an_async_holder_hands_over_to_a_sync_waiter_by_push(
    redis_url: str, r: redis.Redis
) -> None:
    sync = LockManager(redis_url, NS, owner_ttl=5)
    got: list[Any] = []

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as amgr:
            lease = await amgr.acquire("b")

            def waiter() -> None:
                got.append(sync.acquire("b", timeout=20))

            th = threading.Thread(target=waiter)
            th.start()
            await until(lambda: queued(r, "b") == 1, "the thread queued")
            await lease.release()
            # release.lua granted the head of the queue in the same script:
            # the lock is the thread's before its BLPOP even returns.
            holders = {k.decode(): v for k, v in r.hgetall(KEYS.lock("b")).items()}
            assert len(holders) == 1
            (token,) = holders
            assert token.startswith(sync.liveness.identity.current().owner_id + "|")
            await asyncio.to_thread(th.join, 10)
            assert got and got[0].fencing_token > lease.fencing_token
            got[0].release()
            # and back: a sync holder hands over to a coroutine
            held = sync.acquire("b", timeout=1)
            waiting = asyncio.create_task(amgr.acquire("b", timeout=20))
            await until(lambda: queued(r, "b") == 1, "the coroutine queued")
            await asyncio.to_thread(held.release)
            mine = await waiting
            assert mine.fencing_token > held.fencing_token
            await mine.release()

    try:
        run(main())
    finally:
        sync.close()
    assert request_keys(r) == []


def test_limited_resources_across_both_worlds(redis_url: str, r: redis.Redis) -> None:
    sync = LockManager(redis_url, NS, owner_ttl=5)

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as amgr:
            one = await amgr.acquire(limited={"pool": 2})
            two = sync.acquire(limited={"pool": 2}, timeout=1)
            assert one.limited == {"pool": 2}
            # the holding task re-enters its slot; another task finds none free
            again = await amgr.try_acquire(limited={"pool": 2})
            assert again is not None and again.reentrant
            assert await again.release() and int(r.hlen(KEYS.lock("pool"))) == 2
            assert await asyncio.create_task(amgr.try_acquire(limited={"pool": 2})) is None
            third = asyncio.create_task(amgr.acquire(limited={"pool": 2}, timeout=20))
            await until(lambda: queued(r, "pool") == 1, "the third queued")
            assert not third.done()
            await asyncio.to_thread(two.release)
            lease = await third
            assert lease.fencing_token > two.fencing_token
            assert int(r.hlen(KEYS.lock("pool"))) == 2
            await lease.release()
            await one.release()

    try:
        run(main())
    finally:
        sync.close()
    assert request_keys(r) == []


def test_an_owner_refused_for_the_other_kind_is_registered_as_after_any_reply(
    redis_url: str, r: redis.Redis
) -> None:
    """The refused call registered the owner: its next cycle is a registered
    owner's (no second registration: no tombstone EXISTS, no SET NX)."""
    from engine_helpers import command_delta, commandstats

    async def main() -> dict[str, int]:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as amgr:
            hold = await amgr.acquire(exclusive="db")
            async with AsyncLockManager(redis_url, NS, owner_ttl=5) as other:
                with pytest.raises(InvalidResource):
                    await other.acquire(limited={"db": 3}, timeout=5)
                await hold.release()
                before = commandstats(r)
                await (await other.acquire(exclusive="else", timeout=0)).release()
                return command_delta(before, commandstats(r))

    delta = run(main())
    assert (delta.get("exists"), delta.get("set")) == (2, 1), delta


# -- cancellation --------------------------------------------------------------


async def _cancel_after(task: asyncio.Task[AsyncLease], steps: int) -> AsyncLease | None:
    """Let ``task`` run ``steps`` loop iterations, cancel it; its lease if it won."""
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


def test_cancelled_at_every_await_point_leaves_nothing_in_redis(
    redis_url: str, r: redis.Redis
) -> None:
    """Free, queued, and handed the lock while being cancelled: for each
    number of loop iterations before the cancel, no grant, queue entry or
    request state of the cancelled acquire is left."""
    outcomes: dict[str, set[str]] = {"free": set(), "queued": set(), "handoff": set()}

    async def main() -> None:
        async with (
            AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr,
            AsyncLockManager(redis_url, NS, owner_ttl=5) as other,
        ):
            # 1. a free resource: the cancel lands before, while and after the
            # grant's reply is in flight.
            for steps in range(60):
                task = asyncio.create_task(mgr.acquire("a", timeout=5))
                lease = await _cancel_after(task, steps)
                outcomes["free"].add("won" if lease else "cancelled")
                if lease is not None:
                    await lease.release()
                assert request_keys(r) == [], ("free", steps)
                if lease is not None and steps > 20:
                    break
            # 2. held by another owner: cancelled while queued or queueing.
            holder = await other.acquire("a")
            for steps in range(40):
                task = asyncio.create_task(mgr.acquire("a", timeout=5))
                assert await _cancel_after(task, steps) is None
                outcomes["queued"].add("cancelled")
                assert queued(r, "a") == 0, ("queued", steps)
                assert request_keys(r) == sorted([KEYS.lock("a"), KEYS.held(holder.owner_id)]), (
                    steps
                )
            await holder.release()
            # 3. handed the lock by push while the cancel lands.
            for steps in range(40):
                holder = await other.acquire("a")
                task = asyncio.create_task(mgr.acquire("a", timeout=5))
                await until(lambda: queued(r, "a") == 1, "queued")
                releasing = asyncio.create_task(holder.release())
                lease = await _cancel_after(task, steps)
                await releasing
                outcomes["handoff"].add("won" if lease else "cancelled")
                if lease is not None:
                    await lease.release()
                await until(lambda: not mgr.state.pending, "shielded releases done")
                assert request_keys(r) == [], ("handoff", steps)

    run(main(), timeout=120)
    assert outcomes["free"] == {"won", "cancelled"}
    assert "cancelled" in outcomes["handoff"]


def test_asyncio_timeout_around_a_wait_dequeues(redis_url: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with (
            AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr,
            AsyncLockManager(redis_url, NS, owner_ttl=5) as other,
        ):
            holder = await other.acquire("a")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(mgr.acquire("a"), 0.2)
            assert queued(r, "a") == 0
            # the wait's own timeout: LockTimeout, dequeued too
            with pytest.raises(LockTimeout):
                await mgr.acquire("a", timeout=0.1)
            assert queued(r, "a") == 0
            await holder.release()

    run(main())
    assert request_keys(r) == []


# -- loss and outages ----------------------------------------------------------


def test_a_redis_restart_marks_the_async_lease_lost(
    redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="celery_redislock.heartbeat")

    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=3, heartbeat_interval=0.2) as mgr:
            lease = await mgr.acquire("a")
            owner = lease.owner_id
            # From this thread, not a worker thread: the server is spawned with
            # PR_SET_PDEATHSIG, so it would die when asyncio.run's executor
            # thread exits, under the next test.
            redis_server.restart()
            await until(lambda: lease.lost, "the lease lost after the restart", timeout=15)
            with pytest.raises(LockLost) as info:
                lease.check()
            assert info.value.cause == "Redis lost the lock"
            # the manager goes on under a fresh owner
            again = await mgr.acquire("a", timeout=5)
            assert again.owner_id != owner
            assert again.fencing_token > lease.fencing_token
            await again.release()
            await lease.release()  # a lost lease is still released: harmless

    run(main())
    lost = [rec.getMessage() for rec in caplog.records if "heartbeat.lost" in rec.getMessage()]
    assert len(lost) == 1 and "Redis lost its data" in lost[0], lost


def test_a_blocked_event_loop_loses_the_lease_by_its_local_deadline(redis_url: str) -> None:
    async def main() -> None:
        async with AsyncLockManager(redis_url, NS, owner_ttl=1, heartbeat_interval=0.2) as mgr:
            lease = await mgr.acquire("a")
            assert not lease.lost
            time.sleep(1.0)  # the loop is blocked: no heartbeat runs
            with pytest.raises(LockLost) as info:
                lease.check()
            assert info.value.cause == "liveness expired"
            await lease.release()
            again = await mgr.acquire("a", timeout=5)  # a fresh owner
            assert again.owner_id != lease.owner_id
            await again.release()

    run(main())


def test_client_kill_while_waiting_is_ridden_out(redis_url: str, r: redis.Redis) -> None:
    async def main() -> None:
        async with (
            AsyncLockManager(redis_url, NS, owner_ttl=5) as mgr,
            AsyncLockManager(redis_url, NS, owner_ttl=5) as other,
        ):
            holder = await other.acquire("a")
            task = asyncio.create_task(mgr.acquire("a", timeout=20))
            await until(lambda: queued(r, "a") == 1, "queued")
            await until(
                lambda: any(c.get("cmd") == "blpop" for c in r.client_list()), "blocked in BLPOP"
            )
            killed = r.client_kill_filter(_type="normal", skipme=True)
            assert killed >= 1
            await holder.release()
            lease = await task
            assert lease.fencing_token > holder.fencing_token
            assert queued(r, "a") == 0
            await lease.release()

    run(main())
    assert request_keys(r) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_fresh_owner_and_none_of_the_parents_leases(
    redis_url: str, r: redis.Redis
) -> None:
    mgr = AsyncLockManager(redis_url, NS, owner_ttl=5)

    async def parent_holds() -> AsyncLease:
        return await mgr.acquire("a")

    loop = asyncio.new_event_loop()
    try:
        lease = loop.run_until_complete(parent_holds())
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:

                async def child() -> str:
                    assert lease.lost  # the parent's, never released from here
                    assert not await lease.release()
                    got = await mgr.acquire("b", timeout=5)
                    await mgr.close()
                    return got.owner_id

                os.write(write, asyncio.run(child()).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        child_owner = os.read(read, 200).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        assert child_owner and child_owner != lease.owner_id
        assert child_owner.startswith(f"{pid}-")
        assert not lease.lost
        wait_until(lambda: int(r.hlen(KEYS.lock("a"))) == 1, what="the parent still holds")
        loop.run_until_complete(lease.release())
        loop.run_until_complete(mgr.close())
    finally:
        loop.close()
    assert request_keys(r) == []
