"""Each thread sends the manager's commands on one held connection.

A pool checkout per command costs a lock and a poll of the socket; a
manager on a plain ``redis.Redis`` gives every thread (and every forked
process) a client holding one connection of the same pool instead. What a
user relies on: no checkout per command, nothing leaks when threads come
and go, and a command cut short between its send and its reply never lets
that reply be read as the next command's.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redislock import LockManager
from redis_server import RedisServer

NS = "held"


class _CountingPool(redis.ConnectionPool):
    checkouts = 0

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        _CountingPool.checkouts += 1
        return super().get_connection(*args, **kwargs)


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts the server's connections: a server of its own."""
    return private_redis_server


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    c = redis.Redis(connection_pool=_CountingPool(**kwargs))
    yield c
    c.close()


@pytest.fixture
def mgr(client: redis.Redis) -> Iterator[LockManager]:
    """A manager on ``client`` whose thread made its held client already."""
    m = LockManager(client, NS, heartbeat=False)
    m.acquire("R", timeout=5).release()
    yield m
    m.close()


def _held(mgr: LockManager) -> redis.Redis:
    """This thread's held client of ``mgr`` (no command sent on it)."""
    held = mgr._conn()
    mgr._conn_done()
    assert isinstance(held, redis.Redis)
    return held


def test_a_thread_sends_its_acquires_and_releases_without_a_pool_checkout(
    mgr: LockManager,
) -> None:
    before = _CountingPool.checkouts
    for _ in range(20):
        mgr.acquire("R", timeout=5).release()
        with mgr.lock(["A", "B"], timeout=5):
            pass
    assert _CountingPool.checkouts == before


def test_a_command_cut_short_before_its_reply_is_never_read_as_the_next_ones(
    mgr: LockManager, r: redis.Redis
) -> None:
    # The window a pool would have caught at the next checkout (its socket
    # poll): the request went out, the caller was interrupted before reading
    # the reply. The next command must not take that reply for its own.
    held = _held(mgr)
    real = held.parse_response
    calls = {"n": 0}

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt  # sent, not read
        return real(*args, **kwargs)

    held.parse_response = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        mgr.acquire("R", timeout=5)
    held.parse_response = real  # type: ignore[method-assign]
    # The acquire's clean-up released the grant Redis made for it (its
    # reply unread), and the next acquire reads its own reply: the fence
    # it returns is the one stored with its grant.
    assert r.exists(f"{{{NS}}}:lock:R") == 0
    lease = mgr.acquire("S", timeout=5)
    assert r.hget(f"{{{NS}}}:lock:S", lease.token) == f"x{lease.fencing_token}".encode()
    lease.release()


def test_threads_that_come_and_go_do_not_pile_up_connections(
    mgr: LockManager, r: redis.Redis
) -> None:
    start = len(r.client_list())

    def once() -> None:
        mgr.acquire("R", timeout=5).release()

    for _ in range(20):
        t = threading.Thread(target=once)
        t.start()
        t.join()
        gc.collect()
    # Each ended thread's connection went back to the pool and was
    # taken again by the next thread.
    assert len(r.client_list()) <= start + 2


def test_close_gives_the_held_connections_back(mgr: LockManager) -> None:
    held = _held(mgr)
    assert held.connection is not None
    mgr.close()
    assert held.connection is None


def test_a_blocking_pool_is_used_as_it_is(redis_url: str) -> None:
    blocking = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url))
    mgr = LockManager(blocking, NS, heartbeat=False)
    try:
        assert mgr._conn() is blocking  # a held connection would eat into its size
        mgr._conn_done()
        mgr.acquire("R", timeout=5).release()
    finally:
        mgr.close()


def test_a_connection_the_server_closed_is_replaced_before_the_next_command(
    mgr: LockManager, redis_server: RedisServer
) -> None:
    # A restart between two commands: the pool's checkout would notice the
    # closed socket and reconnect; the held connection must as well, not
    # fail the next command (a client without retries would see an error).
    held = _held(mgr)
    assert held.connection is not None
    held.connection.retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    redis_server.restart()
    lease = mgr.acquire("R", timeout=0)  # try once: no outage riding
    lease.release()
