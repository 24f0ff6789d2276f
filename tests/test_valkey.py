"""valkey-py clients and valkey:// URLs, against the suite's real redis-server.

A valkey-py client is not used as it is: the manager connects with redis-py
using the client's settings (celery_redislock/store/valkey_client.py). These
tests check that it locks, waits and hands off as on a redis-py client, and
that what it cannot carry over is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redislock import ConfigurationError, LockManager, LockTimeout
from celery_redislock.store.connect import client_from_url, validate_url
from fairness_helpers import NS, PREFIX, ThreadWaiter, queue_len, wait_until

valkey = pytest.importorskip("valkey")


@pytest.fixture
def managers(redis_url: str) -> Iterator[Any]:
    made: list[LockManager] = []

    def make(client: Any) -> LockManager:
        m = LockManager(client, NS, owner_ttl=30)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _valkey(redis_url: str, **kwargs: Any) -> Any:
    # valkey-py reads redis:// URLs as valkey:// ones; no socket timeout, as
    # the fairness helpers' clients (a waiter's BLPOP may outlast it).
    return valkey.Valkey.from_url(redis_url, socket_timeout=None, **kwargs)


def test_a_valkey_client_acquires_releases_and_contends_with_a_redis_py_one(
    redis_url: str, rs: redis.Redis, managers: Any
) -> None:
    source = _valkey(redis_url, decode_responses=True, client_name="vk-test")
    mgr = managers(source)
    assert isinstance(mgr.client, redis.Redis)  # the engine's own redis-py client
    assert mgr.url.startswith("redis://") and "vk-test" not in mgr.url
    lease = mgr.acquire("V")
    # redis-py's own pool and connections: a held connection per thread,
    # and with it the wire fast path (store/wire.py), as for any redis-py client.
    assert mgr.channel.held_connections == 1
    assert rs.hgetall(f"{PREFIX}lock:V") == {lease.token: f"x{lease.fencing_token}"}
    other = managers(redis.Redis.from_url(redis_url, socket_timeout=None))
    with pytest.raises(LockTimeout):
        other.acquire("V", timeout=0)
    assert mgr.try_acquire("V2") is not None
    assert other.is_locked("V") and mgr.holders("V")[0].owner_id == mgr.owner_id
    assert lease.release()
    assert other.try_acquire("V") is not None
    # The manager's client carried the valkey-py client's settings.
    names = [c["name"] for c in rs.client_list()]
    assert "vk-test" in names
    source.close()


def test_a_release_hands_the_lock_to_a_valkey_clients_waiter_by_push(
    redis_url: str, rs: redis.Redis, managers: Any
) -> None:
    holder = managers(_valkey(redis_url))
    waiter_mgr = managers(_valkey(redis_url, decode_responses=True))
    lease = holder.acquire("H")
    waiter = ThreadWaiter(waiter_mgr, "H", release=False)
    wait_until(lambda: queue_len(rs, "H") == 1, what="waiter queued")
    lease.release()
    waiter.join()
    assert waiter.error is None
    assert waiter.lease.fencing_token > lease.fencing_token
    assert rs.hgetall(f"{PREFIX}lock:H") == {waiter.lease.token: f"x{waiter.lease.fencing_token}"}
    waiter.lease.release()
    assert rs.exists(f"{PREFIX}lock:H") == 0


def test_a_blocking_pool_and_a_unix_socket_client_carry_over(redis_url: str) -> None:
    pool = valkey.BlockingConnectionPool.from_url(redis_url, max_connections=7, timeout=3)
    mgr = LockManager(valkey.Valkey(connection_pool=pool), NS, owner_ttl=30)
    try:
        new = mgr.client.connection_pool
        assert isinstance(new, redis.BlockingConnectionPool)
        assert new.max_connections == 7 and new.timeout == 3
        mgr.acquire("B").release()
    finally:
        mgr.close()
    unix = valkey.Valkey(unix_socket_path="/nonexistent/valkey.sock")
    mgr = LockManager(unix, NS, owner_ttl=30, eviction_check="ignore")
    try:
        assert mgr.client.connection_pool.connection_class is redis.UnixDomainSocketConnection
        assert mgr.url.startswith("unix:///nonexistent/valkey.sock")
    finally:
        mgr.close()


def test_what_cannot_carry_over_is_refused_by_name() -> None:
    class Traced(valkey.Connection):
        pass

    with pytest.raises(ConfigurationError, match="connection class .*Traced"):
        LockManager(
            valkey.Valkey(connection_pool=valkey.ConnectionPool(connection_class=Traced)), NS
        )
    sentinel = valkey.sentinel.Sentinel([("127.0.0.1", 1)]).master_for("mymaster")
    with pytest.raises(ConfigurationError, match="sentinel:// URL"):
        LockManager(sentinel, NS)
    with pytest.raises(ConfigurationError, match="valkey.Valkey or valkey.cluster"):
        LockManager(valkey.ConnectionPool(), NS)  # a valkey-py object, not a client


def test_valkey_urls_are_redis_urls(redis_url: str) -> None:
    vurl = "valkey://" + redis_url[len("redis://") :]
    assert validate_url(vurl) == vurl
    client = client_from_url("valkeys://127.0.0.1:1/3")
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert client.connection_pool.connection_kwargs["db"] == 3
    with pytest.raises(ConfigurationError, match="database"):
        validate_url("valkey://127.0.0.1:6379/x")
    mgr = LockManager(vurl, NS, owner_ttl=30)
    try:
        assert mgr.url.startswith("valkey://")
        mgr.acquire("U").release()
    finally:
        mgr.close()
