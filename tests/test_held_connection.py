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
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_redislock import ConfigurationError, LockManager, RedisUnavailable
from engine_helpers import wait_until
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
    held = mgr.channel.conn()
    mgr.channel.done()
    assert isinstance(held, redis.Redis)
    return held


def _fail_next(conn: Any, method: str, error: Callable[[], BaseException]) -> None:
    """Make the next call of ``conn.<method>`` raise ``error()``; later calls
    go through (the instance attribute is removed again)."""

    def once(*args: Any, **kwargs: Any) -> Any:
        delattr(conn, method)
        raise error()

    setattr(conn, method, once)


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
    conn = _held(mgr).connection
    assert conn is not None
    _fail_next(conn, "read_response", KeyboardInterrupt)  # sent, not read
    with pytest.raises(KeyboardInterrupt):
        mgr.acquire("R", timeout=5)
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
        assert mgr.channel.conn() is blocking  # a held connection would eat into its size
        mgr.channel.done()
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


def test_scripts_and_waits_skip_the_command_wrapper_and_keep_their_replies(
    mgr: LockManager, r: redis.Redis
) -> None:
    # The held connection's scripts and BLPOP are packed and sent directly
    # (celery_redislock.store.wire): redis-py's execute_command is not called,
    # and names outside ASCII, shared grants, hand-offs and a NOSCRIPT all
    # behave as through it.
    held = _held(mgr)
    calls: list[Any] = []
    real = held.execute_command

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return real(*args, **kwargs)

    held.execute_command = counted  # type: ignore[method-assign]
    name = "dépôt:ünïcode:☃"
    with mgr.lock(name, timeout=5) as lease:
        assert r.hget(f"{{{NS}}}:lock:{name}", lease.token) == f"x{lease.fencing_token}".encode()
    with mgr.lock(shared=["S1", "S2"], timeout=5) as lease:
        assert lease.shared == ("S1", "S2")
    assert calls == []
    # A waiter woken by a hand-off (its BLPOP) on its own thread's connection.
    first = mgr.acquire("H", timeout=5)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(mgr.acquire("H", timeout=30)))
    t.start()
    while not first.contenders():
        threading.Event().wait(0.01)
    first.release()
    t.join(30)
    assert got and got[0].fencing_token > first.fencing_token
    got[0].release()
    # The server forgot the scripts: loaded again, the command sent again.
    r.script_flush()
    mgr.acquire("R", timeout=5).release()
    assert calls and set(calls) == {"SCRIPT LOAD"}


def test_a_dropped_connection_is_retried_under_the_clients_retry_policy(
    mgr: LockManager, r: redis.Redis
) -> None:
    conn = _held(mgr).connection
    assert conn is not None

    def dropped() -> BaseException:
        conn.disconnect()
        return redis.ConnectionError("dropped")

    _fail_next(conn, "send_packed_command", dropped)
    # The client's policy retries: the acquire goes through.
    conn.retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1)
    mgr.acquire("R", timeout=0).release()
    # No retries: the drop is the caller's error, as through redis-py.
    conn.retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    _fail_next(conn, "send_packed_command", dropped)
    with pytest.raises(RedisUnavailable):
        mgr.acquire("R", timeout=0)
    mgr.acquire("R", timeout=0).release()


def _lose_next_reply(conn: Any) -> None:
    """The next command on ``conn`` runs on the server, but its reply is
    lost with the connection (read, dropped, then a ConnectionError)."""
    real = conn.read_response

    def lost(*args: Any, **kwargs: Any) -> Any:
        del conn.read_response
        real(*args, **kwargs)
        conn.disconnect()
        raise redis.ConnectionError("reply lost")

    conn.read_response = lost


def test_a_grant_whose_reply_was_lost_is_found_by_the_retry(
    mgr: LockManager, r: redis.Redis
) -> None:
    # A request's first send skips the look for an earlier grant (its token
    # was never sent). The retry after a lost reply must look: it finds the
    # grant the first send made, with the same fence, and is not blocked by
    # its own grant.
    conn = _held(mgr).connection
    assert conn is not None
    conn.retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1)
    _lose_next_reply(conn)
    lease = mgr.acquire("R", timeout=0)
    assert r.hgetall(f"{{{NS}}}:lock:R") == {
        lease.token.encode(): f"x{lease.fencing_token}".encode()
    }
    lease.release()
    assert r.exists(f"{{{NS}}}:lock:R") == 0


def test_a_queued_request_whose_reply_was_lost_keeps_its_place(
    mgr: LockManager, r: redis.Redis, client: redis.Redis
) -> None:
    # The first send queued the request; its retry must find that entry and
    # keep it (one arrival number, one entry), not queue a second time.
    other = LockManager(client, NS, heartbeat=False)
    conns: list[Any] = []
    got: list[Any] = []

    def waiter() -> None:
        conn = _held(mgr).connection  # this thread's held connection
        conn.retry = redis.retry.Retry(redis.backoff.NoBackoff(), 1)
        _lose_next_reply(conn)
        conns.append(conn)
        got.append(mgr.acquire("R", timeout=30))

    try:
        held = other.acquire("R", timeout=5)
        seq = int(r.get(f"{{{NS}}}:seq") or 0)
        t = threading.Thread(target=waiter)
        t.start()
        # Queued, and the reply of the send that queued it lost (retried).
        wait_until(
            lambda: (
                r.zcard(f"{{{NS}}}:q:R") == 1
                and bool(conns)
                and "read_response" not in conns[0].__dict__
            ),
            what="the request queued and its reply lost",
        )
        entries = r.zrange(f"{{{NS}}}:q:R", 0, -1, withscores=True)
        held.release()
        t.join(30)
        assert got, "the queued request was not granted"
        assert len(entries) == 1 and int(entries[0][1]) == seq + 1, entries
        assert int(r.get(f"{{{NS}}}:seq") or 0) == seq + 1  # one arrival number
        got[0].release()
    finally:
        other.close()


def test_a_connection_class_of_its_own_goes_through_redis_py(redis_url: str) -> None:
    class Mine(redis.Connection):
        commands = 0

        def send_command(self, *args: Any, **kwargs: Any) -> None:
            Mine.commands += 1
            super().send_command(*args, **kwargs)

    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    client = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=Mine, **kwargs))
    m = LockManager(client, NS, heartbeat=False)
    try:
        m.acquire("R", timeout=5).release()
        assert Mine.commands >= 2  # its own send_command saw the scripts
    finally:
        m.close()
        client.close()


def test_a_subclass_that_only_counts_sends_keeps_the_direct_send(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection subclass that counts ``send_packed_command`` (as a metrics
    or tracing layer does) keeps redis-py's encoding and sending, so the
    scripts go straight on it, and its count still sees every one."""

    class Counting(redis.Connection):
        sends = 0

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            Counting.sends += 1
            super().send_packed_command(command, check_health)

    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    client = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=Counting, **kwargs))
    m = LockManager(client, NS, heartbeat=False)
    wrapped: list[tuple[Any, ...]] = []
    real = redis.Redis.execute_command

    def spy(self: redis.Redis, *args: Any, **options: Any) -> Any:
        wrapped.append(args)
        return real(self, *args, **options)

    try:
        m.acquire("R", timeout=5).release()  # loads the scripts
        monkeypatch.setattr(redis.Redis, "execute_command", spy)
        before = Counting.sends
        m.acquire("R", timeout=5).release()
        assert wrapped == []  # no script went through the command wrapper
        assert Counting.sends - before == 2  # and the subclass saw both
    finally:
        monkeypatch.undo()
        m.close()
        client.close()


def test_hold_connection_false_shows_every_lock_command_to_execute_command_wrappers(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tracing and APM agents wrap redis.Redis.execute_command: with the held
    # connection the scripts and the waiter's BLPOP pass them by; without
    # it they see every one (docs/operations.md, "Tracing and APM").
    seen: list[str] = []
    real = redis.Redis.execute_command

    def traced(self: redis.Redis, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(args[0]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)
    held = LockManager(client, NS, heartbeat=False)
    plain = LockManager(client, NS, heartbeat=False, hold_connection=False)
    try:
        for mgr, expected in ((held, []), (plain, ["EVALSHA", "EVALSHA"])):
            mgr.acquire("R", timeout=5).release()  # its one-off format check first
            del seen[:]
            mgr.acquire("R", timeout=5).release()
            assert [c for c in seen if c in ("EVALSHA", "BLPOP")] == expected
        # A waiter woken by a hand-off: its BLPOP is traced too.
        first = held.acquire("H", timeout=5)
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(plain.acquire("H", timeout=30)))
        del seen[:]
        t.start()
        while not first.contenders():
            threading.Event().wait(0.01)
        first.release()
        t.join(30)
        assert got and "BLPOP" in seen
        got[0].release()
    finally:
        held.close()
        plain.close()


def test_hold_connection_false_checks_out_per_command_and_holds_nothing(
    client: redis.Redis,
) -> None:
    m = LockManager(client, NS, heartbeat=False, hold_connection=False)
    try:
        assert m.channel.conn() is client
        m.channel.done()
        before = _CountingPool.checkouts
        m.acquire("R", timeout=5).release()
        assert _CountingPool.checkouts - before >= 2  # one per command
        assert m.channel.held_connections == 0
    finally:
        m.close()
    with pytest.raises(ConfigurationError, match="hold_connection"):
        LockManager(client, NS, hold_connection="no")  # type: ignore[arg-type]
