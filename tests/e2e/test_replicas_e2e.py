"""End-to-end: ``redislock_wait_replicas`` in a real prefork worker.

The lock engine's Redis is a master with one replica (``--replicaof``); the
broker is the session's Redis. With ``redislock_wait_replicas = 1`` a
``@locked`` body runs only once the replica holds its grant (read from the
replica while the body holds the lock), and with the replica paused
(SIGSTOP) the task fails with ReplicationTimeout, leaving nothing held; so
does a deferred task handed the lock then (its body never runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_helpers import wait_until
from replica_helpers import Pair

from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path / "lock-redis")
    try:
        wait_until(p.in_sync, what="the replica to sync with the master")
        yield p
    finally:
        p.close()


def test_locked_body_runs_once_the_replica_has_the_grant_and_fails_without_it(
    cluster: Callable[..., Cluster], pair: Pair
) -> None:
    c = cluster(lock_url=pair.master.url, wait_replicas=1, wait_timeout=1.0, heartbeat=1)
    c.start_worker("replicas", concurrency=2)

    c.send("hold", "a", "t1")
    info = c.wait_held("t1")
    lock_key = c.key("lock", "res:a")
    assert info["token"].encode() in pair.r.hgetall(lock_key)  # on the replica already
    c.go("t1")

    # A deferred task parks behind a holder; handed the lock while the
    # replica is paused, its adoption is not acknowledged: it fails the same
    # way, its body never runs.
    c.send("hold", "d", "t2")
    c.wait_held("t2")
    deferred = c.send("dwrite", "d", "rd")
    wait_for(lambda: deferred.state == "DEFERRED", 60, "parked", on_timeout=c.report)

    pair.pause_replica()
    c.go("t2")
    with pytest.raises(Exception) as err:
        deferred.get(timeout=60)
    assert type(err.value).__name__ == "ReplicationTimeout", err.value
    assert int(c.data.get("e2e:runs:rd") or 0) == 0
    assert c.lock_holders("res:d") == {}

    result = c.send("write", "b")
    with pytest.raises(Exception) as err:
        result.get(timeout=60)
    assert type(err.value).__name__ == "ReplicationTimeout", err.value
    assert "0 of 1 replicas" in str(err.value)
    assert c.lock_holders("res:b") == {}
    assert c.namespace_keys("q") == []
    held = [k for k in c.namespace_keys("held") if c.lock_redis.hlen(k)]
    assert held == [], held
