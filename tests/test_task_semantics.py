"""@locked task semantics in Celery's in-process test worker (threads pool):
on_lost (fail, ignore, terminate's fallback where there is no child to
kill), reentrant nested @locked calls, and the task holder record the
Inspector shows. The prefork counterparts are in tests/e2e/test_task_semantics_e2e.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_helpers import QUICK_NS as NS
from celery_redislock import (
    Inspector,
    LockLost,
    LockManager,
    RedisLock,
    current_lease,
    locked,
)
from celery_redislock.exceptions import CAUSE_OPERATOR
from engine_helpers import wait_until


@pytest.fixture
def worker_app(quick_apps: Callable[..., Celery]) -> tuple[Celery, RedisLock]:
    app = quick_apps("sem", locks=False, redislock_owner_ttl=30, redislock_heartbeat_interval=0.2)
    return app, RedisLock(app)


@pytest.fixture
def operator(redis_url: str) -> Iterator[LockManager]:
    """The CLI's manager: frees an owner as `redislock release --force` does."""
    mgr = LockManager(redis_url, NS, heartbeat=False, eviction_check="ignore")
    yield mgr
    mgr.close()


@pytest.fixture
def task_log() -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("celery_redislock.task")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the test worker sets the root logger to ERROR
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_lost_lock_fails_the_task_by_default_and_ignore_keeps_its_result(
    worker_app: tuple[Celery, RedisLock],
    operator: LockManager,
    task_log: list[str],
    r: redis.Redis,
) -> None:
    app, _ = worker_app
    inside: dict[str, Any] = {}
    started = threading.Event()
    go = threading.Event()

    def body() -> bool:
        lease = current_lease()
        assert lease is not None
        inside["owner"], inside["lease"] = lease.owner_id, lease
        inside["holder"] = Inspector(operator).locks(["res:1"])[0].holders[0]
        started.set()
        go.wait(30)
        return lease.lost

    @app.task(shared=False, bind=True, name="sem.fail")
    @locked("res:{n}", timeout=10)
    def default(self: Any, n: int) -> bool:
        return body()

    @app.task(shared=False, bind=True, name="sem.ignore")
    @locked("res:{n}", timeout=10, on_lost="ignore")
    def ignore(self: Any, n: int) -> bool:
        return body()

    @app.task(shared=False, bind=True, name="sem.terminate")
    @locked("res:{n}", timeout=10, on_lost="terminate")
    def terminate(self: Any, n: int) -> bool:
        return body()

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False) as w:
        try:
            run_modes(w, inside, started, go, operator, task_log, default, ignore, terminate)
        finally:
            go.set()  # never leave a body waiting in the worker
    # Holder records go with the grants (registry values; no key of their own).
    assert not r.keys("{quick}:held:*") and not r.keys("{quick}:holder:*")
    assert any("no pool child to kill" in x for x in task_log)


def run_modes(
    w: Any,
    inside: dict[str, Any],
    started: threading.Event,
    go: threading.Event,
    operator: LockManager,
    task_log: list[str],
    *tasks: Any,
) -> None:
    default, ignore, terminate = tasks
    for task, mode in ((default, "fail"), (ignore, "ignore"), (terminate, "terminate")):
        started.clear()
        go.clear()
        res = task.delay(1)
        assert started.wait(20)
        # Who holds it, as the operator sees it: the task, its id, the node.
        holder = inside["holder"]
        assert (holder.task_name, holder.task_id, holder.node) == (
            task.name,
            res.id,
            w.hostname,
        )
        operator.cleanup_owner(inside["owner"], force=True, reason="operator")
        wait_until(lambda: inside["lease"].lost, what="the node heartbeat to tell the task")
        go.set()
        if mode == "ignore":
            assert res.get(timeout=20) is True  # the result stands
        else:
            # fail; terminate has no pool child to kill here: it fails too
            with pytest.raises(LockLost) as info:
                res.get(timeout=20)
            assert info.value.cause == CAUSE_OPERATOR, info.value
            assert "released by operator via CLI" in str(info.value)
        wait_until(
            lambda m=mode: any(f"on_lost={m}" in line for line in task_log),
            what=f"the locked.lost line of on_lost={mode}",
        )
        line = next(x for x in task_log if f"on_lost={mode}" in x)
        assert line.startswith("locked.lost") and 'cause="released by operator via CLI"' in line
        assert f"id={res.id}" in line


def test_a_grant_found_gone_only_at_release_fails_the_task(
    worker_app: tuple[Celery, RedisLock], task_log: list[str], r: redis.Redis
) -> None:
    # Redis lost the grant while the body ran (a failover to a replica that
    # missed it): nothing tells the holder, and its local deadline holds.
    # The release is the first to see it (fewer locks released than held),
    # and the task must not report success as if it had held the lock.
    app, _ = worker_app

    @app.task(shared=False, bind=True, name="sem.vanished")
    @locked("res:{n}", timeout=10)
    def vanished(self: Any, n: int) -> bool:
        lease = current_lease()
        assert lease is not None
        assert r.hdel("{quick}:lock:res:" + str(n), lease.token) == 1
        return lease.lost  # not known yet

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        res = vanished.delay(7)
        with pytest.raises(LockLost):
            res.get(timeout=20)
    assert any(x.startswith("locked.lost") and f"id={res.id}" in x for x in task_log)


def test_a_locked_task_calling_a_locked_function_on_its_resource_reenters(
    worker_app: tuple[Celery, RedisLock], r: redis.Redis
) -> None:
    app, _ = worker_app

    @locked("res:{n}")  # the app's default timeout: None (the reentry waits for nothing)
    def helper(n: int) -> int:
        lease = current_lease()
        assert lease is not None
        return lease.fencing_token

    @locked("res:{n}", shared=["other:{n}"], timeout=5)
    def helper_more(n: int) -> int:
        lease = current_lease()
        assert lease is not None
        return lease.fencing_token

    @app.task(shared=False, bind=True)
    @locked("res:{n}", timeout=10)
    def outer(self: Any, n: int) -> dict[str, Any]:
        lease = current_lease()
        assert lease is not None
        inner = helper(n)
        more = helper_more(n)  # res held, other:{n} new: a nested acquire of it
        with pytest.raises(RuntimeError):
            helper_raises(n)
        return {
            "outer": lease.fencing_token,
            "inner": inner,
            "more": more,
            "still_held": bool(r.hexists("{quick}:lock:res:" + str(n), lease.token)),
        }

    @locked("res:{n}")
    def helper_raises(n: int) -> None:
        raise RuntimeError("inner failed")

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        out = outer.delay(3).get(timeout=20)
    assert out["inner"] == out["outer"]
    assert out["more"] > out["outer"]
    assert out["still_held"] is True  # the inner exception did not release it
    assert not r.keys("{quick}:lock:*")
