"""End-to-end: a release that hit a lock-Redis outage is retried in every pool.

The lock engine of a real ``celery worker`` talks to Redis through a TCP
proxy (:mod:`tcp_proxy`); the broker does not. A ``hold`` task holds
``res:x1``; the proxy cuts every connection and refuses new ones, the task
finishes and its release fails (deferred). Once the proxy is back the lock
must be freed by the worker's own heartbeat (the node heartbeat in the main
process for threads, solo and gevent; the lost-owner watcher in a prefork
child), with no other task running, and the failure logged once.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import pytest

from redis_server import RedisServer
from tcp_proxy import TcpProxy

from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[TcpProxy]:
    with TcpProxy(redis_server.port) as p:
        yield p


@pytest.mark.parametrize("pool", ["threads", "solo", "gevent", "prefork"])
def test_release_that_hit_an_outage_is_retried_by_the_heartbeat_once_redis_is_back(
    cluster: Callable[..., Cluster], proxy: TcpProxy, pool: str
) -> None:
    c = cluster(lock_url=proxy.url, owner_ttl=30, heartbeat=1)
    w = c.start_worker(f"rel-{pool}", pool=pool, concurrency=1)
    result = c.send("hold", "x1", "t1", queue=w.queue)
    held = c.wait_held("t1")
    lock_key = c.key("lock", "res:x1")
    assert c.data.hkeys(lock_key) == [held["token"]]  # read past the proxy

    proxy.cut()
    c.go("t1")
    assert result.get(timeout=60)["attempt"] == 1  # the body ended; its release failed
    wait_for(
        lambda: w.log_lines("locked.release-error", "res:x1"),
        60,
        "the release to fail and be deferred",
        on_timeout=w.tail,
    )
    assert c.data.hkeys(lock_key) == [held["token"]]

    proxy.restore()
    wait_for(
        lambda: not c.data.exists(lock_key),
        60,
        "the deferred release to be retried by the heartbeat",
        on_timeout=w.tail,
    )
    # logged just after the script deleted the key: wait for the line
    wait_for(
        lambda: w.log_lines("release.retried", held["token"]),
        10,
        "the release.retried log line",
        on_timeout=w.tail,
    )
    assert len(w.log_lines("release.retry-failed")) <= 1, w.tail()
    assert not w.log_lines("Traceback"), w.tail()
    assert not c.data.exists(c.key("held", held["owner"]))
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.tail()
