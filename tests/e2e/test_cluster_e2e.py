"""End-to-end: real ``celery worker -P prefork`` processes whose locks live on Redis Cluster.

The broker and result backend stay on the session's redis-server; only
``redislock_url`` is a ``redis+cluster://`` URL naming two of the three
masters of a module-scoped cluster (tests/test_cluster.py's
``running_cluster``). The test's own reads of the lock keys go straight to
the master that owns the namespace's hash slot (every key of a namespace
lives there).

- contending ``@locked`` tasks on two workers keep exclusion and exact
  final counts, and leave no lock keys behind;
- a worker SIGKILLed while holding a lock and restarted under its node name
  frees its predecessor's locks at start-up (long before the liveness TTL),
  and the resource is usable again through the new worker;
- a worker SIGKILLed for good: ``celery beat`` (which loads the cluster URL
  too) schedules the reconcile task, another worker runs it on the cluster
  and frees the dead worker's lock once its liveness is gone;
- ``redislock_eviction_check='raise'`` asks every master at worker start: one
  master that may evict keys stops the worker, naming the setting and the fix;
- a worker whose lock cluster has no reachable seed node refuses to start
  with one CRITICAL line (password masked) and exit status 69
  (EX_UNAVAILABLE), not a traceback: a cluster client reads the slot map when
  it is made.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from celery.platforms import EX_UNAVAILABLE
from redis.cluster import RedisCluster

from redis_server import RedisServer, free_port
from test_cluster import running_cluster

from .harness import START_TIMEOUT, Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

#: The lock user's password in the URLs (never in a log).
PASSWORD = "Zq8-cluster-pw"


@pytest.fixture(scope="module")
def lock_cluster() -> Iterator[list[RedisServer]]:
    with running_cluster() as servers:
        yield servers


@pytest.fixture
def on_cluster(
    cluster: Callable[..., Cluster], lock_cluster: list[RedisServer]
) -> Callable[..., Cluster]:
    """``on_cluster(**settings)``: a harness Cluster whose lock URL is the Redis Cluster."""

    def make(**settings: object) -> Cluster:
        namespace = f"e2ec{uuid.uuid4().hex[:8]}"
        seeds = ",".join(f"127.0.0.1:{s.port}" for s in lock_cluster[:2])
        rc = RedisCluster(host="127.0.0.1", port=lock_cluster[0].port)
        try:
            owner = rc.get_node_from_key("{" + namespace + "}:x")
        finally:
            rc.close()
        return cluster(
            namespace=namespace,
            lock_url=f"redis+cluster://{seeds}/?socket_timeout=5",
            lock_admin_url=f"redis://{owner.host}:{owner.port}/0",
            **settings,
        )

    return make


def _no_lock_keys_left(c: Cluster) -> bool:
    return not c.namespace_keys("lock") and not c.namespace_keys("held")


def test_locked_tasks_on_two_prefork_workers_keep_exclusion_and_exact_counts_on_a_cluster(
    on_cluster: Callable[..., Cluster],
) -> None:
    c = on_cluster(owner_ttl=10, heartbeat=1)
    a = c.start_worker("clu-a", wait=False)
    b = c.start_worker("clu-b", wait=False)
    c.wait_ready(a)
    c.wait_ready(b)
    resources = ["0", "1"]
    writes = 10
    results = []
    for i in range(writes):
        for res in resources:
            results.append(c.send("write", res, 0.005))
        if i % 3 == 0:
            results.append(c.send("read", "0", 0.02))
    for res_ in results:
        res_.get(timeout=180)

    assert c.data.lrange("e2e:violations", 0, -1) == []
    for res in resources:
        assert int(c.data.get(f"e2e:counter:{res}") or 0) == writes, res
        assert int(c.data.get(f"e2e:inside:w:{res}") or 0) == 0
    assert c.data.lrange("e2e:order:0", 0, -1) == [f"w{i}" for i in range(1, writes + 1)]
    wait_for(lambda: _no_lock_keys_left(c), 20, "all locks released", on_timeout=c.report)
    # Both workers' node records are on the cluster (the node heartbeat ran there).
    assert {k.rsplit(":", 1)[-1] for k in c.namespace_keys("node")} >= {
        "clu-a@e2e",
        "clu-b@e2e",
    }


def test_worker_killed_and_restarted_on_a_cluster_frees_its_predecessor_locks_at_startup(
    on_cluster: Callable[..., Cluster],
) -> None:
    c = on_cluster(owner_ttl=60, heartbeat=1)
    w = c.start_worker("phoenix-c")
    c.send("hold", "r1", "t1")
    owner = c.wait_held("t1")["owner"]

    w.destroy()  # SIGKILL the whole process group: nobody cleans up
    killed_at = time.monotonic()
    pttl = c.alive_pttl(owner)
    assert pttl > 30_000, "the predecessor's liveness should still be live"
    assert owner in c.owners_holding("res:r1")

    w2 = c.start_worker("phoenix-c")
    wait_for(
        lambda: owner not in c.owners_holding("res:r1"),
        timeout=45,
        what="the predecessor's locks to be freed at start-up",
        on_timeout=c.report,
    )
    assert time.monotonic() < killed_at + pttl / 1000 - 5, "freed only by liveness expiry"
    assert not c.lock_redis.exists(c.key("held", owner))
    assert owner not in c.active_owners()

    again = c.send("hold", "r1", "t2", 0, queue=w2.queue)
    assert again.get(timeout=60)["attempt"] == 1
    wait_for(lambda: _no_lock_keys_left(c), 20, "all locks released", on_timeout=c.report)


def test_a_worker_whose_lock_cluster_does_not_answer_refuses_to_start_in_one_line(
    cluster: Callable[..., Cluster], redis_url: str
) -> None:
    # No seed node listens: the cluster client cannot read the slot map.
    url = f"redis+cluster://locks:{PASSWORD}@127.0.0.1:{free_port()}/?socket_connect_timeout=1"
    c = cluster(lock_url=url, lock_admin_url=redis_url, heartbeat=1)
    w = c.start_worker("clu-down", concurrency=1, wait=False)
    ping = c.send("ping", queue=w.queue)

    wait_for(lambda: not w.alive, START_TIMEOUT, "the worker to refuse to start", on_timeout=w.tail)
    assert w.wait(1) == EX_UNAVAILABLE, w.tail()
    assert not ping.ready()
    [line] = w.log_lines("worker.start-unavailable")
    assert "CRITICAL" in line and "redis+cluster://locks:***@127.0.0.1:" in line, line
    assert "start it again once a seed node answers" in line, line
    assert PASSWORD not in w.text() and "Traceback" not in w.text(), w.tail()


def test_beat_reconcile_frees_a_dead_workers_locks_on_a_cluster(
    on_cluster: Callable[..., Cluster],
) -> None:
    c = on_cluster(owner_ttl=4, heartbeat=1, reconcile=1)
    keeper = c.start_worker("clu-keeper", concurrency=1, wait=False)
    victim = c.start_worker("clu-victim", concurrency=1, wait=False)
    for w in (keeper, victim):
        c.wait_ready(w)
    c.send("hold", "x1", "t1", queue=victim.queue)
    owner = c.wait_held("t1")["owner"]

    victim.destroy()  # never comes back: beat's reconcile (run by keeper) frees it
    c.start_beat()
    wait_for(
        lambda: owner not in c.owners_holding("res:x1"),
        timeout=60,
        what="beat's reconcile to free the dead worker's lock",
        on_timeout=c.report,
    )
    assert c.alive_pttl(owner) == -2  # freed only once its liveness was gone
    assert not c.lock_redis.exists(c.key("held", owner))
    wait_for(
        lambda: keeper.log_lines("reconcile"), 10, "a reconcile log line", on_timeout=keeper.tail
    )


def test_eviction_check_raise_asks_every_master_of_the_cluster_at_worker_start(
    on_cluster: Callable[..., Cluster], lock_cluster: list[RedisServer]
) -> None:
    # Only the last master may evict (not necessarily the namespace's own):
    # any master may come to serve the namespace after a resharding.
    last = lock_cluster[-1].client()
    last.config_set("maxmemory-policy", "allkeys-lru")
    try:
        c = on_cluster(eviction_check="raise", heartbeat=1)
        w = c.start_worker("clu-evict", concurrency=1, wait=False)
        ping = c.send("ping", queue=w.queue)
        wait_for(
            lambda: not w.alive, START_TIMEOUT, "the worker to refuse to start", on_timeout=w.tail
        )
        assert w.wait(1) != 0, w.tail()
        assert not ping.ready()
        errors = w.log_lines("redislock_eviction_check", "allkeys-lru")
        assert errors and any("maxmemory-policy noeviction" in line for line in errors), w.tail()
        assert c.namespace_keys("node") == []
    finally:
        last.config_set("maxmemory-policy", "noeviction")
        last.close()
