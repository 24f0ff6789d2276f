"""End-to-end: a helper process forked by a task is a standalone owner.

A task forks a helper (``multiprocessing`` or ``billiard`` fork-context
Process, or ``os.fork()``) that takes ``repo:1`` with a lease of its own
and holds it across several node heartbeat ticks and past ``owner_ttl``.
The helper is neither a pool child nor the worker's main process: it must
keep its liveness with its own heartbeat, never be freed by the node while
it runs, and, once SIGKILLed, be cleaned like any dead standalone owner
(its liveness expires, then an acquirer reclaims and reconcile frees).

Under ``-P prefork`` the helper is a child of a pool child; under
``-P threads`` and ``-P gevent`` the task runs in the worker's main process,
so the helper is forked from the main process itself (as is the helper a
prefork main process forks at ``worker_ready``).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_redislock import LockManager, LockTimeout

from .harness import Cluster, Worker, redis_ms, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: Short liveness so that "past owner_ttl" is seconds away; the heartbeat
#: interval leaves six beats per TTL, so a loaded machine keeps live owners.
OWNER_TTL = 3.0
HEARTBEAT = 0.5
HOWS = ("multiprocessing", "billiard", "fork")


@pytest.fixture
def contenders(cluster: Callable[..., Cluster]) -> Iterator[list[LockManager]]:
    made: list[LockManager] = []
    yield made
    for m in made:
        m.close()


def _contender(c: Cluster, made: list[LockManager]) -> LockManager:
    mgr = LockManager(c.lock_url, c.namespace, owner_ttl=OWNER_TTL)
    made.append(mgr)
    return mgr


def _started(
    cluster: Callable[..., Cluster],
    contenders: list[LockManager],
    name: str,
    pool: str,
    concurrency: int = 2,
    **config: Any,
) -> tuple[Cluster, Worker, LockManager]:
    """A cluster with the short owner TTL, one worker ``name`` on it, and a contender."""
    c = cluster(owner_ttl=OWNER_TTL, heartbeat=HEARTBEAT, **config)
    w = c.start_worker(name, pool=pool, concurrency=concurrency)
    return c, w, _contender(c, contenders)


def _helper_info(c: Cluster, tag: str) -> dict[str, Any]:
    raw = wait_for(
        lambda: c.data.lindex(f"e2e:helper:{tag}", 0),
        timeout=60,
        what=f"helper {tag} to hold its lock",
        on_timeout=c.report,
    )
    info: dict[str, Any] = json.loads(raw)
    assert "error" not in info, info
    return info


def _group(c: Cluster, w: Worker) -> dict[str, str]:
    inc = c.lock_redis.hget(c.key("node", w.nodename), "inc")
    assert inc, "the worker has no node record"
    return {str(k): str(v) for k, v in c.lock_redis.hgetall(c.key("group", str(inc))).items()}


def _node_hb(c: Cluster, w: Worker) -> int:
    return int(c.lock_redis.hget(c.key("node", w.nodename), "hb") or 0)


def _held_past_owner_ttl_then_released(
    c: Cluster, w: Worker, contender: LockManager, info: dict[str, Any], tag: str
) -> None:
    """While the helper holds ``repo:1`` across node ticks and past owner_ttl,
    every try fails; then it releases, its lease never lost, and the lock is free."""
    owner = info["owner"]
    assert c.owners_holding("repo:1") == {owner}
    start_hb, start_ms = _node_hb(c, w), redis_ms(c)
    tries = 0

    def held_past_ttl() -> bool:
        nonlocal tries
        with pytest.raises(LockTimeout):
            contender.acquire("repo:1", timeout=0)
        tries += 1
        assert c.owners_holding("repo:1") == {owner}, c.report()
        assert not c.data.exists(f"e2e:helper-lost:{tag}"), "the helper saw its lease lost"
        # several node ticks, and twice the owner TTL by Redis TIME
        return _node_hb(c, w) - start_hb >= 4 and redis_ms(c) - start_ms > 2 * OWNER_TTL * 1000

    wait_for(held_past_ttl, timeout=120, what=f"helper {tag} held past owner_ttl", interval=0.1)
    # another task of the same worker is refused too
    assert c.send("try_take", "repo:1", queue=w.queue).get(timeout=60) is False
    assert c.alive_pttl(owner) > 0  # its own heartbeat keeps it alive
    assert owner not in _group(c, w), "a forked helper joined the worker's group"
    print(f"{tag}: {tries} refused tries while the helper held repo:1")

    c.go(tag)
    done = json.loads(
        wait_for(lambda: c.data.lindex(f"e2e:helper-done:{tag}", 0), 60, f"helper {tag} done")
    )
    assert done["lost"] is False and done["check"] is True, done
    # released: the lock is free at once
    contender.acquire("repo:1", timeout=0).release()


def _helper_holds_past_owner_ttl(
    c: Cluster, w: Worker, contender: LockManager, pool: str, how: str, tag: str
) -> dict[str, Any]:
    """Run one helper forked by a task through its life; return the task's result."""
    result = c.send("fork_helper", "repo:1", tag, how, queue=w.queue)
    info = _helper_info(c, tag)
    _held_past_owner_ttl_then_released(c, w, contender, info, tag)
    ran = result.get(timeout=60)
    # CPython: a multiprocessing child forked from a ThreadPoolExecutor thread
    # (the threads pool) exits 1 after its target returned, as concurrent.futures'
    # exit hook tries to join the forking thread ("cannot join current thread").
    quirk = pool == "threads" and how == "multiprocessing"
    assert ran["helper_exit"] == (1 if quirk else 0), ran
    assert ran["helper_pid"] == info["pid"] and info["ppid"] == ran["pid"], (ran, info)
    return dict(ran)


# Not -P gevent: a process forked from a gevent worker carries copies of every
# greenlet of the worker, and its hub runs them whenever the helper blocks, so
# the helper consumes the worker's task messages itself (docs/worker.md).
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_helper_forked_by_a_task_keeps_its_lock_past_owner_ttl_and_frees_it_on_release(
    cluster: Callable[..., Cluster], contenders: list[LockManager], pool: str
) -> None:
    c, w, contender = _started(cluster, contenders, f"helper-{pool}", pool)
    for how in HOWS:
        ran = _helper_holds_past_owner_ttl(c, w, contender, pool, how, f"{pool}-{how}")
        # under threads and gevent the task runs in the main process, so the
        # helper was forked from the main process itself
        assert (ran["pid"] == w.pid) == (pool != "prefork"), (ran, w.pid)
    assert c.data.lrange("e2e:violations", 0, -1) == []
    assert w.alive


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_sigkilled_helper_is_cleaned_by_its_liveness_expiry_then_reclaim_and_reconcile(
    cluster: Callable[..., Cluster], contenders: list[LockManager], pool: str
) -> None:
    c, w, contender = _started(cluster, contenders, f"killed-{pool}", pool)
    results = {
        "repo:1": c.send("fork_helper", "repo:1", f"{pool}-k1", "multiprocessing", queue=w.queue),
        "repo:2": c.send("fork_helper", "repo:2", f"{pool}-k2", "fork", queue=w.queue),
    }
    helpers = {"repo:1": _helper_info(c, f"{pool}-k1"), "repo:2": _helper_info(c, f"{pool}-k2")}
    for res, info in helpers.items():
        assert c.owners_holding(res) == {info["owner"]}
        os.kill(info["pid"], signal.SIGKILL)
    for res_ in results.values():
        assert res_.get(timeout=60)["helper_exit"] == -signal.SIGKILL

    # An acquirer reclaims repo:1 once the dead helper's liveness ran out.
    dead1, dead2 = helpers["repo:1"]["owner"], helpers["repo:2"]["owner"]
    lease = contender.acquire("repo:1", timeout=60)
    assert c.alive_pttl(dead1) == -2
    assert lease.fencing_token > helpers["repo:1"]["fence"]
    lease.release()

    # Reconcile frees repo:2 (nobody asked for it) once that liveness ran out.
    wait_for(lambda: c.alive_pttl(dead2) == -2, 60, "the second helper's liveness to expire")
    report = contender.reconcile()
    assert dead2 in {x.owner_id for x in report.reports if x.status == "cleaned"}, report
    assert c.lock_holders("repo:2") == {}
    for dead in (dead1, dead2):
        assert not c.lock_redis.exists(c.key("held", dead))
        assert dead not in c.active_owners()
    contender.acquire("repo:2", timeout=0).release()
    assert w.alive


def test_helper_forked_by_the_prefork_main_process_keeps_its_lock_past_owner_ttl(
    cluster: Callable[..., Cluster], contenders: list[LockManager]
) -> None:
    # The main process of a prefork worker runs no task, but user code there
    # (a worker_ready handler, a bootstep) may fork: its helper's parent is
    # the main process, like a pool child's, yet the pool does not list it.
    c, w, contender = _started(
        cluster, contenders, "main-helper", "prefork", concurrency=1, main_helper="repo:1 main"
    )
    info = _helper_info(c, "main")
    assert info["ppid"] == w.pid, (info, w.pid)
    _held_past_owner_ttl_then_released(c, w, contender, info, "main")
    assert w.alive
