"""A waiter rides out a Redis hiccup: it re-runs its acquire until its bound.

A stalled server (SIGSTOP: the waiter's socket times out), a killed
connection (CLIENT KILL) or a refused one must not fail a waiter while its
timeout, or the outage bound of ``owner_ttl``, has not run out: the waiter
re-runs its acquire script, which is idempotent on its token, so a grant
handed over while its BLPOP connection was gone is found in the lock hash.
Past the bound it raises RedisUnavailable and leaves nothing behind once the
server answers again.

Each test runs its own redis-server (the tests stop and kill it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from celery_redislock import Lease, LockManager, LockTimeout, RedisUnavailable
from engine_helpers import Managers, assert_registry_truth, namespace_keys, wait_until
from redis_server import RedisServer

NS = "t"
PREFIX = "{" + NS + "}:"


@pytest.fixture
def server(tmp_path: Any) -> Iterator[RedisServer]:
    with RedisServer(workdir=tmp_path / "redis") as srv:
        yield srv


@pytest.fixture
def r(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    yield client
    client.close()


@pytest.fixture
def managers(server: RedisServer) -> Iterator[Managers]:
    made = Managers(server.url, NS)
    yield made
    made.close_all()


class Waiter:
    """``mgr.acquire(...)`` in a thread; ``result`` is the lease or the exception."""

    def __init__(self, mgr: LockManager, resource: str, **kwargs: Any) -> None:
        self.result: Any = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(mgr, resource, kwargs), daemon=True)
        self.thread.start()

    def _run(self, mgr: LockManager, resource: str, kwargs: dict[str, Any]) -> None:
        try:
            self.result = mgr.acquire(resource, **kwargs)
        except BaseException as exc:
            self.result = exc
        finally:
            self.done.set()

    def outcome(self, timeout: float = 30.0) -> Any:
        assert self.done.wait(timeout), "the waiter never returned"
        return self.result


def queued(r: redis.Redis, resource: str) -> int:
    return int(r.zcard(f"{PREFIX}q:{resource}"))


def blocked_clients(r: redis.Redis) -> list[dict[str, Any]]:
    """CLIENT LIST entries blocked in a BLPOP on a wake list."""
    return [c for c in r.client_list() if c.get("cmd") == "blpop" and "b" in c.get("flags", "")]


@contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    """The server process SIGSTOPped (connections hang) until the block ends."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def stall(server: RedisServer, seconds: float) -> None:
    """Stall the server for ``seconds`` (the stimulus, not a synchronisation)."""
    with stopped(server):
        time.sleep(seconds)


def short_timeout_url(server: RedisServer) -> str:
    # A 1 s socket timeout: a 2.5 s stall times out every call the waiter
    # makes (its BLPOP blocks 0.5 s at most), whenever the stall starts.
    return server.url + "?socket_timeout=1"


def _assert_held_alone_then_released(r: redis.Redis, lease: Lease) -> None:
    """``lease`` alone holds R; once released, the registry is true to Redis."""
    assert [x.decode() for x in r.hkeys(f"{PREFIX}lock:R")] == [lease.token]
    lease.release()
    assert_registry_truth(r, NS)


def test_waiter_without_timeout_is_granted_after_a_stalled_server_resumes(
    server: RedisServer, r: redis.Redis, managers: Managers
) -> None:
    holder = managers()
    waiter_mgr = managers(short_timeout_url(server))
    lease = holder.acquire("R", timeout=5)
    waiter = Waiter(waiter_mgr, "R", timeout=None)
    wait_until(lambda: queued(r, "R") == 1, what="the waiter to queue")
    wait_until(lambda: blocked_clients(r), what="the waiter to block on its wake list")
    stall(server, 2.5)
    assert not waiter.done.is_set()
    lease.release()
    got = waiter.outcome()
    assert not isinstance(got, BaseException), repr(got)
    _assert_held_alone_then_released(r, got)


def test_grant_handed_over_while_the_waiters_connection_was_killed_is_not_lost(
    server: RedisServer, r: redis.Redis, managers: Managers
) -> None:
    # CLIENT KILL of the blocked connection; the release hands the lock over
    # (token written into the lock hash, 'g<fence>' pushed) while the waiter
    # has no connection: its re-run acquire finds the grant by its token.
    holder, waiter_mgr = managers(), managers()
    lease = holder.acquire("R", timeout=5)
    waiter = Waiter(waiter_mgr, "R", timeout=None)
    wait_until(lambda: queued(r, "R") == 1, what="the waiter to queue")
    [blocked] = wait_until(lambda: blocked_clients(r), what="the waiter to block")
    r.execute_command("CLIENT", "KILL", "ID", blocked["id"])
    lease.release()
    got = waiter.outcome()
    assert not isinstance(got, BaseException), repr(got)
    assert [x.decode() for x in r.hkeys(f"{PREFIX}lock:R")] == [got.token]
    assert queued(r, "R") == 0
    got.release()
    assert_registry_truth(r, NS)


def test_waiter_killed_repeatedly_keeps_its_place_in_line(
    server: RedisServer, r: redis.Redis, managers: Managers
) -> None:
    # Two waiters; the first one's connection is killed several times while
    # it waits: it is still served first (its queue entry was never lost).
    holder, first_mgr, second_mgr = managers(), managers(), managers()
    lease = holder.acquire("R", timeout=5)
    first = Waiter(first_mgr, "R", timeout=None)
    wait_until(lambda: queued(r, "R") == 1, what="the first waiter to queue")
    second = Waiter(second_mgr, "R", timeout=None)
    wait_until(lambda: queued(r, "R") == 2, what="the second waiter to queue")
    first_token = r.zrange(f"{PREFIX}q:R", 0, 0)[0].decode()[1:]
    for _ in range(3):
        blocked = wait_until(lambda: len(blocked_clients(r)) == 2 and blocked_clients(r))
        for c in blocked:  # both waiters lose their connection
            r.execute_command("CLIENT", "KILL", "ID", c["id"])
    lease.release()
    got = first.outcome()
    assert not isinstance(got, BaseException), repr(got)
    assert got.token == first_token
    assert not second.done.is_set()
    got.release()
    second_lease = second.outcome()
    assert not isinstance(second_lease, BaseException), repr(second_lease)
    second_lease.release()
    assert_registry_truth(r, NS)


def test_waiter_gives_up_with_redis_unavailable_after_the_outage_bound_and_leaves_nothing(
    server: RedisServer, r: redis.Redis, managers: Managers
) -> None:
    # timeout=None: the outage bound is owner_ttl (2 s here). The server is
    # stalled for longer: RedisUnavailable; once it resumes, the deferred
    # dequeue (retried by the waiter manager's heartbeat) leaves no trace.
    holder = managers(owner_ttl=30)
    waiter_mgr = managers(short_timeout_url(server), owner_ttl=2.0, heartbeat_interval=0.2)
    lease = holder.acquire("R", timeout=5)
    waiter = Waiter(waiter_mgr, "R", timeout=None)
    wait_until(lambda: queued(r, "R") == 1, what="the waiter to queue")
    with stopped(server):
        got = waiter.outcome()
    assert isinstance(got, RedisUnavailable), repr(got)
    wait_until(lambda: queued(r, "R") == 0, what="the queue entry to go")
    wait_until(
        lambda: {k for k in namespace_keys(r, NS) if ":req:" in k or ":wake:" in k} == set(),
        what="the request state to go",
    )
    _assert_held_alone_then_released(r, lease)


def test_finite_timeout_waiter_rides_out_a_refused_connection_within_its_timeout(
    server: RedisServer, r: redis.Redis, managers: Managers
) -> None:
    # The server is killed and restarted empty on the same port while the
    # waiter waits (timeout 20 s): connections are refused for a while; the
    # waiter re-runs its acquire, which (the data being gone) grants it.
    holder, waiter_mgr = managers(), managers()
    holder.acquire("R", timeout=5)
    waiter = Waiter(waiter_mgr, "R", timeout=20)
    wait_until(lambda: queued(r, "R") == 1, what="the waiter to queue")
    server.kill()
    server.start()
    got = waiter.outcome()
    assert not isinstance(got, BaseException), repr(got)
    got.release()


def _unavailable_after_a_kill(
    managers: Managers, server: RedisServer, timeout: float
) -> LockManager:
    """A manager whose acquire (``timeout``) raises RedisUnavailable once ``server`` is killed."""
    mgr = managers()
    server.kill()
    with pytest.raises(RedisUnavailable):
        mgr.acquire("R", timeout=timeout)
    return mgr


def test_timeout_zero_does_not_retry_an_unreachable_server(
    managers: Managers, server: RedisServer
) -> None:
    _unavailable_after_a_kill(managers, server, timeout=0)


def test_finite_timeout_waiter_raises_redis_unavailable_when_the_outage_outlasts_it(
    server: RedisServer, managers: Managers
) -> None:
    mgr = _unavailable_after_a_kill(managers, server, timeout=1.0)
    server.start()  # back (empty): a busy lock is a plain timeout again
    managers().acquire("R", timeout=5)
    with pytest.raises(LockTimeout):
        mgr.acquire("R", timeout=0.2)


def test_a_wait_shorter_than_a_millisecond_still_ends(managers: Managers) -> None:
    """A waiter whose deadline is about to pass sends its shortest wait: BLPOP
    reads 0 as for ever and Redis 6.2 truncates 0.001 s to 0 ms, so such a
    wait must still end without a push (make test-redis62 runs this on 6.2)."""
    mgr = managers()
    done: list[Any] = []
    for seconds in (0.0, 0.0005, 0.001):
        t = threading.Thread(
            target=lambda s=seconds: done.append(mgr.acquirer.block("nobody|x", s)), daemon=True
        )
        t.start()
        t.join(10)
        assert not t.is_alive(), f"a {seconds} s wait did not end"
    assert done == [None, None, None]


def test_async_waiters_are_granted_in_order_after_a_stalled_server_resumes(
    server: RedisServer, r: redis.Redis, managers: Managers, caplog: pytest.LogCaptureFixture
) -> None:
    # The asyncio front-end rides out the same stall: three coroutines wait
    # (timeout=None) through a 3 s SIGSTOP with a 1 s socket timeout, then
    # are served first come, first served.
    import asyncio

    from async_helpers import run, until
    from celery_redislock.asyncio import AsyncLease, AsyncLockManager

    holder = managers()
    lease = holder.acquire("R", timeout=5)

    async def main() -> None:
        async with AsyncLockManager(short_timeout_url(server), NS) as mgr:
            waiters: list[asyncio.Task[AsyncLease]] = []
            for n in range(3):
                waiters.append(asyncio.create_task(mgr.acquire("R", timeout=None)))
                await until(lambda n=n: queued(r, "R") == n + 1, f"waiter {n} to queue")
            tokens = [x.decode()[1:] for x in r.zrange(f"{PREFIX}q:R", 0, -1)]
            await until(lambda: len(blocked_clients(r)) == 3, "the waiters to block")
            with caplog.at_level(logging.WARNING, logger="celery_redislock.acquire"):
                await asyncio.to_thread(stall, server, 3.0)
                assert not any(w.done() for w in waiters)
                await until(
                    lambda: any("acquire.redis-retry" in m for m in caplog.messages),
                    "the stall to reach the waiters",
                )
            await asyncio.to_thread(lease.release)
            for n, w in enumerate(waiters):
                got = await w
                assert got.token == tokens[n]
                assert [x.decode() for x in r.hkeys(f"{PREFIX}lock:R")] == [got.token]
                await got.release()
        assert_registry_truth(r, NS)

    run(main())
