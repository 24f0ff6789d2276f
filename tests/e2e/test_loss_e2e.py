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


def test_parked_tasks_survive_a_lock_redis_restart_and_each_runs_once(
    cluster: Callable[..., Cluster], restartable_lock_redis: RedisServer
) -> None:
    # The lock Redis is a server of its own (the broker and result backend are
    # not restarted): the parked tasks' guards, in the broker, recover them.
    c = cluster(lock_url=restartable_lock_redis.url, owner_ttl=5, heartbeat=0.5, defer_guard=1)
    w = c.start_worker("guarded", concurrency=3)
    holder = c.send("hold", "pg", "pg-h")
    c.wait_held("pg-h")
    parked = [c.send("dwrite", "pg", f"pg-d{i}") for i in range(3)]
    for r in parked:
        wait_for(lambda r=r: r.state == "DEFERRED", 60, "parked", on_timeout=c.report)
    assert c.lock_redis.zcard(c.key("q", "res:pg")) == 3
    # A deferred task whose body runs (adopted) when the data goes: its
    # guard must not publish it again.
    c.send("hold", "pa", "pa-h")
    c.wait_held("pa-h")
    running = c.send("dhold", "pa", "pa-d")
    wait_for(lambda: running.state == "DEFERRED", 60, "pa-d parked", on_timeout=c.report)
    c.go("pa-h")
    wait_for(lambda: c.data.llen("e2e:held-log:pa-d"), 60, "pa-d adopted", on_timeout=c.report)

    restartable_lock_redis.restart()  # empty: no park record, no queue, no lock
    c.go("pg-h")
    with pytest.raises(LockLost):
        holder.get(timeout=60)

    for r in parked:
        r.get(timeout=90)  # SUCCESS
    assert [int(c.data.get(f"e2e:runs:pg-d{i}") or 0) for i in range(3)] == [1, 1, 1]
    assert sorted(c.data.lrange("e2e:order:pg", 0, -1)) == ["pg-d0", "pg-d1", "pg-d2"]
    assert c.data.lrange("e2e:violations", 0, -1) == []
    wait_for(
        lambda: w.log_lines("celery_redislock.defer_guard", "ended:adopted"),
        30,
        "the running task's guard to end",
        on_timeout=w.tail,
    )
    recovered = {x.split(" id=", 1)[1].split()[0] for x in w.log_lines("defer.recovered")}
    assert recovered == {r.id for r in parked}, w.tail()  # not the running one
    c.go("pa-d")
    with pytest.raises(LockLost):  # its lock went with the data (on_lost="fail")
        running.get(timeout=60)
    assert c.data.get("e2e:attempts:pa-d") == "1"
    # The guards end once their task ran (none goes on re-arming itself).
    wait_for(
        lambda: len(w.log_lines("celery_redislock.defer_guard", "ended:")) >= 4,
        30,
        "the guards to end",
        on_timeout=w.tail,
    )
