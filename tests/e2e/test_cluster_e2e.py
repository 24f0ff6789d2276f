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

import uuid
from collections.abc import Callable, Iterator

import pytest
from celery.platforms import EX_UNAVAILABLE
from redis.cluster import RedisCluster

from redis_server import RedisServer, free_port
from test_cluster import running_cluster

from .harness import START_TIMEOUT, Cluster, wait_for
from .scenarios import (
    beat_reconcile_frees_a_dead_workers_lock,
    contend_and_check_counts,
    restarted_worker_frees_its_predecessors_locks,
)

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


def test_locked_tasks_on_two_prefork_workers_keep_exclusion_and_exact_counts_on_a_cluster(
    on_cluster: Callable[..., Cluster],
) -> None:
    c = on_cluster(owner_ttl=10, heartbeat=1)
    c.start_ready_workers("clu-a", "clu-b")
    contend_and_check_counts(c, ["0", "1"], writes=10, reads_per_round=1)
    c.wait_no_lock_keys()
    # Both workers' node records are on the cluster (the node heartbeat ran there).
    assert {k.rsplit(":", 1)[-1] for k in c.namespace_keys("node")} >= {
        "clu-a@e2e",
        "clu-b@e2e",
    }


def test_worker_killed_and_restarted_on_a_cluster_frees_its_predecessor_locks_at_startup(
    on_cluster: Callable[..., Cluster],
) -> None:
    restarted_worker_frees_its_predecessors_locks(on_cluster, "phoenix-c")


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
    keeper, victim = c.start_ready_workers("clu-keeper", "clu-victim", concurrency=1)
    c.send("hold", "x1", "t1", queue=victim.queue)
    owner = c.wait_held("t1")["owner"]
    # victim never comes back: beat's reconcile (run by keeper) frees it
    beat_reconcile_frees_a_dead_workers_lock(c, keeper, victim, owner, "res:x1")


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
