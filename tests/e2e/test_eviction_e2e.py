"""End-to-end: ``redislock_eviction_check`` against a real worker and a Redis that may evict.

The lock engine's Redis (the ``lock_redis`` server, not the broker) gets
``maxmemory-policy allkeys-lru``: liveness and lock keys could be evicted
under memory pressure, freeing locks early. With ``'raise'`` the worker must
not start (it exits non-zero, naming the setting and the fix); with
``'warn'`` it starts, consumes, and logs the risk.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import pytest

from redis_server import RedisServer

from .harness import START_TIMEOUT, Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def evicting_lock_redis(lock_redis: RedisServer) -> Iterator[RedisServer]:
    """The lock Redis with ``maxmemory-policy allkeys-lru`` (restored afterwards)."""
    client = lock_redis.client()
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")
        yield lock_redis
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.flushall()
        client.close()


def test_eviction_check_raise_stops_the_worker_naming_the_setting_and_the_fix(
    cluster: Callable[..., Cluster], evicting_lock_redis: RedisServer
) -> None:
    c = cluster(lock_url=evicting_lock_redis.url, eviction_check="raise", heartbeat=1)
    w = c.start_worker("evict-raise", concurrency=1, wait=False)
    ping = c.send("ping", queue=w.queue)

    wait_for(lambda: not w.alive, START_TIMEOUT, "the worker to refuse to start", on_timeout=w.tail)

    assert w.wait(1) != 0, w.tail()
    assert not ping.ready(), "the worker consumed a task although eviction_check='raise'"
    errors = w.log_lines("redislock_eviction_check", "allkeys-lru")
    assert errors, w.tail()
    assert any("maxmemory-policy noeviction" in line for line in errors), errors
    # it stopped before claiming its node record or starting a heartbeat
    assert c.namespace_keys("node") == []


def test_eviction_check_warn_starts_the_worker_and_logs_the_risk(
    cluster: Callable[..., Cluster], evicting_lock_redis: RedisServer
) -> None:
    c = cluster(lock_url=evicting_lock_redis.url, eviction_check="warn", heartbeat=1)
    w = c.start_worker("evict-warn", concurrency=1)  # waits until it answers a ping

    warnings = w.log_lines("startup.eviction-risk", "allkeys-lru")
    assert warnings and "WARNING" in warnings[0], w.tail()
    assert "maxmemory-policy noeviction" in warnings[0]
    assert c.send("write", "0", 0.001).get(timeout=60) == 1

    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.tail()
