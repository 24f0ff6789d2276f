"""End-to-end: a real ``celery worker -P prefork`` whose lock Redis loses
its data (a restart without persistence) while a task holds a lock.

The running task must be told (its lease is marked lost: ``lease.lost``,
``lease.check()``), the worker must log it once and go on as a fresh
incarnation, and a later task must take the same resource normally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_redislock import LockLost
from redis_server import RedisServer

from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def restartable_lock_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A lock-only redis-server of this test's own (it gets restarted)."""
    with RedisServer(workdir=tmp_path / "lock-redis") as server:
        yield server


def test_lock_redis_restart_tells_the_running_task_and_the_worker_goes_on(
    cluster: Callable[..., Cluster], restartable_lock_redis: RedisServer
) -> None:
    c = cluster(lock_url=restartable_lock_redis.url, owner_ttl=60, heartbeat=1)
    w = c.start_worker("datalost")
    result = c.send("hold", "d1", "t1")
    first = c.wait_held("t1")

    restartable_lock_redis.restart()  # empty: no locks, no liveness, no node record

    # Nobody cleaned the owner (nothing is left to clean): the task learns it
    # from its own watcher (its liveness key is gone), within seconds.
    wait_for(
        lambda: c.data.exists("e2e:lost:t1"),
        30,
        "the task to see its lease lost",
        on_timeout=c.report,
    )
    wait_for(lambda: w.log_lines("node.state-lost"), 30, "node.state-lost", on_timeout=w.tail)
    c.go("t1")
    # on_lost="fail" (the default): the task fails and says why.
    with pytest.raises(LockLost) as info:
        result.get(timeout=30)
    assert info.value.cause == "Redis lost the lock", info.value

    # The worker goes on as a fresh incarnation: the same resource is granted
    # to a new task, whose owner is in the new incarnation's group.
    second = c.send("hold", "d1", "t2")
    held = c.wait_held("t2")
    assert held["owner"] != first["owner"]
    assert c.owners_holding("res:d1") == {held["owner"]}
    records = c.namespace_keys("node")
    assert len(records) == 1
    inc = c.lock_redis.hget(records[0], "inc")
    assert c.lock_redis.hexists(c.key("group", str(inc)), held["owner"])
    c.go("t2")
    assert second.get(timeout=30)["lost"] is False
    assert len(w.log_lines("node.state-lost")) == 1, w.tail()
