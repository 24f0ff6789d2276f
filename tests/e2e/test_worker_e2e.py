"""End-to-end: real ``celery worker -P prefork`` and ``celery beat`` processes.

What the Celery integration must show, against real processes
and the real redis-server: exclusion under contention, a SIGKILLed pool
child, warm shutdown, a whole worker killed and restarted under its name, a
live duplicate node name, a worker that never comes back (beat's reconcile,
then the next acquirer), and the cost of a brand-new node's start-up. Also:
children ended by a hard time limit, revoke(terminate) or recycling
(--max-tasks-per-child) leave nothing behind, and the threads, solo and
gevent pools keep exclusion and release everything at warm shutdown.

Tasks live in :mod:`e2e.proj`; processes are run by :mod:`e2e.harness`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from celery_redislock import LockLost, LockManager
from celery_redislock.exceptions import CAUSE_DECLARED_DEAD, CAUSE_EXPIRED
from redis_server import RedisServer

from .harness import Cluster, wait_for
from .scenarios import (
    beat_reconcile_frees_a_dead_workers_lock,
    contend_and_check_counts,
    restarted_worker_frees_its_predecessors_locks,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_contending_tasks_on_few_resources_keep_exact_counts_and_exclusion(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=10, heartbeat=1)
    c.start_ready_workers("cont-a", "cont-b")
    contend_and_check_counts(c, ["0", "1", "2"], writes=15, reads_per_round=2)
    assert c.no_lock_keys_left(), c.namespace_keys("lock")


@pytest.mark.parametrize("pool", ["threads", "solo", "gevent"])
def test_other_pools_keep_exclusion_and_release_everything_at_warm_shutdown(
    cluster: Callable[..., Cluster], pool: str
) -> None:
    c = cluster(owner_ttl=10, heartbeat=1)
    w = c.start_worker(f"pool-{pool}", pool=pool, concurrency=4)
    results = [c.send("write", str(i % 2), 0.005) for i in range(10)]
    results += [c.send("read", "0", 0.02) for _ in range(2)]
    for res_ in results:
        res_.get(timeout=120)
    assert c.data.lrange("e2e:violations", 0, -1) == []
    assert [int(c.data.get(f"e2e:counter:{i}") or 0) for i in range(2)] == [5, 5]

    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.tail()
    assert c.namespace_keys("lock") == [] and c.namespace_keys("held") == []
    assert c.active_owners() == set() and c.namespace_keys("alive") == []


def test_sigkilled_pool_child_locks_freed_within_a_tick_and_task_redelivered(
    cluster: Callable[..., Cluster],
) -> None:
    # owner_ttl 60 s: only the worker's child cleanup can free the lock in time.
    c = cluster(owner_ttl=60, heartbeat=1)
    w = c.start_worker("child")
    result = c.send("hold", "k1", "t1", 1)
    held = c.wait_held("t1")
    owner = held["owner"]
    assert owner and owner in c.owners_holding("res:k1")
    assert c.alive_pttl(owner) > 30_000

    killed_at = time.monotonic()
    os.kill(held["pid"], signal.SIGKILL)
    c.wait_freed(owner, "res:k1", "the dead child's lock to be freed")
    freed_after = time.monotonic() - killed_at
    # one heartbeat tick (1 s) plus a wide margin for a loaded machine; the
    # liveness TTL (60 s) is far away
    print(f"dead child's lock freed after {freed_after:.2f}s")
    assert freed_after < 10, f"freed after {freed_after:.1f}s"
    wait_for(lambda: not c.lock_redis.exists(c.key("held", owner)), 10, "dead child's registry")
    assert owner not in c.active_owners()

    # acks_late + reject_on_worker_lost: the task comes back and completes
    done = result.get(timeout=90)
    assert done["attempt"] == 2 and done["pid"] != held["pid"]
    assert done["fence"] > held["fence"]
    c.wait_no_lock_keys()
    assert w.alive


def test_children_ended_by_time_limit_revoke_or_recycling_leave_no_locks_or_owners(
    cluster: Callable[..., Cluster],
) -> None:
    # every child serves one task and exits (--max-tasks-per-child=1): the
    # active-owners set and the node's group must not grow with them
    c = cluster(owner_ttl=60, heartbeat=1)
    c.start_worker("recycle", extra_args=["--max-tasks-per-child=1"])

    # a hard time limit kills the child while it holds res:h1
    limited = c.producer.send_task("e2e.hold", args=("h1", "t1", 1), queue=c.queue, time_limit=2)
    held = c.wait_held("t1")
    started = time.monotonic()
    c.wait_freed(held["owner"], "res:h1", "the time-limited child's lock to be freed")
    assert time.monotonic() - started < 2 + 10
    with pytest.raises(Exception, match="TimeLimitExceeded"):
        limited.get(timeout=30)

    # revoke(terminate=True) of a task holding res:h2
    revoked = c.send("hold", "h2", "t2", 1)
    held2 = c.wait_held("t2")
    c.producer.control.revoke(revoked.id, terminate=True, signal="SIGKILL")
    c.wait_freed(held2["owner"], "res:h2", "the revoked task's lock to be freed")

    for r_ in [c.send("write", str(i % 2), 0.001) for i in range(12)]:
        r_.get(timeout=60)
    assert [int(c.data.get(f"e2e:counter:{i}") or 0) for i in range(2)] == [6, 6]

    def nothing_left() -> bool:
        groups = c.namespace_keys("group")
        return (
            c.no_lock_keys_left()
            and not c.active_owners()
            and not c.namespace_keys("alive")
            and all(c.lock_redis.hlen(g) == 0 for g in groups)
        )

    wait_for(nothing_left, 30, "recycled children's owners to be cleaned", on_timeout=c.report)


def test_pool_child_is_told_its_lease_is_lost_when_its_liveness_lapses(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=60, heartbeat=1)
    c.start_worker("told")
    result = c.send("hold", "l1", "t1")
    owner = c.wait_held("t1")["owner"]
    # the child's liveness lapses (evicted key, a pause past owner_ttl...)
    c.lock_redis.delete(c.key("alive", owner))
    c.wait_freed(owner, "res:l1", "the main process to free the lapsed owner's lock", timeout=20)
    try:
        # its lock may now be granted to another task: the body must learn
        # it (lease.lost / lease.check()) within a few heartbeat ticks
        wait_for(lambda: c.data.exists("e2e:lost:t1"), 6, "the lease to be marked lost")
    finally:
        c.go("t1")
    # on_lost="fail" (the default): the task fails with LockLost naming the cause
    with pytest.raises(LockLost) as info:
        result.get(timeout=30)
    assert info.value.cause in (CAUSE_EXPIRED, CAUSE_DECLARED_DEAD), info.value


def test_warm_shutdown_keeps_running_task_lock_until_it_finishes_then_releases_all(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=60, heartbeat=1)
    w = c.start_worker("warm")
    result = c.send("hold", "w1", "t1")
    held = c.wait_held("t1")
    owner = held["owner"]

    w.send_signal(signal.SIGTERM)
    wait_for(lambda: w.log_lines("warm shutdown"), 30, "warm shutdown to begin", on_timeout=w.tail)
    # the pool is draining: the child's liveness keeps being refreshed and
    # its lock stays held for as long as the task runs
    c.wait_beats(owner, 3)
    assert w.alive
    assert owner in c.owners_holding("res:w1")
    assert c.lock_redis.hexists(c.key("held", owner), "res:w1")

    c.go("t1")
    assert w.wait(60) == 0, w.tail()
    assert result.get(timeout=10)["attempt"] == 1
    assert c.namespace_keys("lock") == []
    assert c.namespace_keys("held") == []
    assert c.active_owners() == set()
    assert c.lock_redis.exists(c.key("alive", owner)) == 0


def test_worker_killed_and_restarted_under_same_name_frees_predecessor_locks_at_startup(
    cluster: Callable[..., Cluster],
) -> None:
    restarted_worker_frees_its_predecessors_locks(cluster, "phoenix")


def test_two_live_workers_with_one_node_name_never_free_each_others_locks(
    cluster: Callable[..., Cluster],
) -> None:
    # heartbeat 2 s: a predecessor counts as stopped only after 4 s without a
    # beat, so a loaded machine cannot make B mistake A for a dead predecessor
    c = cluster(owner_ttl=20, heartbeat=2)
    a = c.start_worker("twin")
    ra = c.send("hold", "d1", "ta", queue=a.queue)
    held_a = c.wait_held("ta")

    b = c.start_worker("twin")
    rb = c.send("hold", "d2", "tb", queue=b.queue)
    held_b = c.wait_held("tb")
    wait_for(
        lambda: a.log_lines("error", "duplicate") or b.log_lines("error", "duplicate"),
        timeout=30,
        what="an ERROR about the duplicate node name",
        on_timeout=c.report,
    )
    # a few heartbeat ticks of both: both children stay alive, both locks held
    c.wait_beats(held_a["owner"], 2)
    c.wait_beats(held_b["owner"], 2)
    assert held_a["owner"] in c.owners_holding("res:d1")
    assert held_b["owner"] in c.owners_holding("res:d2")
    assert a.alive and b.alive
    assert not a.log_lines("evicted") and not b.log_lines("evicted"), c.report()

    c.go("ta")
    c.go("tb")
    assert ra.get(timeout=60)["attempt"] == 1
    assert rb.get(timeout=60)["attempt"] == 1
    c.wait_no_lock_keys()


def test_dead_worker_locks_freed_by_beat_reconcile_and_by_next_acquirer_without_beat(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=4, heartbeat=1, reconcile=1)
    keeper, v1, v2 = c.start_ready_workers("keeper", "victim1", "victim2", concurrency=1)
    c.send("hold", "x1", "t1", queue=v1.queue)
    c.send("hold", "x2", "t2", queue=v2.queue)
    owner1 = c.wait_held("t1")["owner"]
    owner2 = c.wait_held("t2")["owner"]

    # 1. victim1 dies and never comes back: beat's reconcile (run by keeper)
    beat = beat_reconcile_frees_a_dead_workers_lock(c, keeper, v1, owner1, "res:x1")
    assert owner2 in c.owners_holding("res:x2"), "a live owner's lock was freed"

    # 2. no beat, no other worker: the next acquirer reclaims victim2's lock
    beat.destroy()
    keeper.destroy()
    v2.destroy()
    mgr = LockManager(c.lock_url, namespace=c.namespace, owner_ttl=4)
    try:
        with mgr.lock("res:x2", timeout=30) as lease:
            assert c.owners_holding("res:x2") == {lease.owner_id}
    finally:
        mgr.close()
    assert owner2 not in c.owners_holding("res:x2")


def _commandstats(server: RedisServer) -> dict[str, int]:
    client = server.client(decode_responses=True)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_brand_new_worker_startup_costs_the_same_with_100_and_50000_unrelated_keys(
    cluster: Callable[..., Cluster], lock_redis: RedisServer
) -> None:
    counts = {}
    for n in (100, 50_000):
        client = lock_redis.client()
        try:
            client.flushall()
            client.script_flush()  # both runs load the scripts alike
            for start in range(0, n, 1000):
                client.mset({f"unrelated:{i}": "x" for i in range(start, min(n, start + 1000))})
            assert client.dbsize() == n
            client.config_resetstat()
        finally:
            client.close()
        # the lock engine alone uses this server; heartbeat ticks are far apart
        c = cluster(lock_url=lock_redis.url, owner_ttl=120, heartbeat=50)
        w = c.start_worker(f"fresh{n}", concurrency=1)
        counts[n] = _commandstats(lock_redis)
        w.destroy()
    for n, stats in counts.items():
        assert not {"scan", "keys"} & set(stats), (n, stats)
        assert sum(stats.values()) < 50, (n, stats)
    print("start-up commands:", counts)
    assert counts[100] == counts[50_000]
