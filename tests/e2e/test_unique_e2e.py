"""End-to-end: UniqueTask with real ``celery worker -P prefork`` processes.

One worker serves most scenarios in turn (worker start-up dominates the
cost): a duplicate returns the existing task's id while it is queued and
while it runs; the key is freed after success, failure, a revoke of the
queued message and a SIGKILL of the pool child running it (by the node's
cleanup, within a tick: the owner TTL is a minute away), and the
redelivered task still runs; a message never run frees its key after
``unique_ttl``. Then the whole worker is SIGKILLed and its key is freed
when it restarts under its name.

The producer is this test process: its own app defines the same unique
task, so ``apply_async`` runs UniqueTask's enqueue here.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import RedisLock

from . import unique_tasks
from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


class Producer:
    """The test's producer app: the unique task, on the cluster's broker and namespace."""

    def __init__(self, c: Cluster, unique_ttl: float) -> None:
        self.app = Celery("e2e-unique-producer", broker=c.broker_url, backend=c.broker_url)
        self.app.conf.update(
            task_default_queue=c.queue,
            result_expires=600,
            redislock_namespace=c.namespace,
            redislock_unique_ttl=unique_ttl,
        )
        self.locks = RedisLock(self.app)
        self.data = redis.Redis.from_url(c.broker_url, decode_responses=True)
        self.task = unique_tasks.define(self.app, lambda: self.data)

    def close(self) -> None:
        self.locks.close()
        self.data.close()
        gc.collect()  # AsyncResults unsubscribe while Redis is up
        consumer = getattr(self.app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        self.app.close()


@pytest.fixture
def setup(
    cluster: Callable[..., Cluster], request: pytest.FixtureRequest
) -> Iterator[tuple[Cluster, Producer]]:
    """The cluster and a producer of unique tasks; prints how long the test took."""
    c = cluster(owner_ttl=60, heartbeat=1)
    p = Producer(c, unique_ttl=600)
    t0 = time.monotonic()
    try:
        yield c, p
    finally:
        p.close()
        print(f"{request.node.name} took {time.monotonic() - t0:.1f}s")


def _holders(c: Cluster, tag: str) -> dict[str, str]:
    return c.lock_holders(f"unique:uh:{tag}")


def _started(c: Cluster, tag: str, attempt: int = 1) -> dict[str, Any]:
    what = f"unique_hold {tag} attempt {attempt}"
    return c.wait_logged(f"e2e:uh-log:{tag}", attempt, what)


def _freed(c: Cluster, tag: str, what: str, timeout: float = 30) -> float:
    t0 = time.monotonic()
    wait_for(lambda: not _holders(c, tag), timeout, what, on_timeout=c.report)
    return time.monotonic() - t0


def test_unique_task_key_lifecycle_with_a_prefork_worker(
    setup: tuple[Cluster, Producer],
) -> None:
    c, p = setup
    w = c.start_worker("uq", concurrency=2)

    # Queued (on a queue nobody consumes, with a short unique_ttl): a
    # duplicate gets the queued task; after unique_ttl the key is free again.
    short = Producer(c, unique_ttl=1.0)
    try:
        q1 = short.task.apply_async(("never",), queue=f"{c.queue}.nobody")
        assert short.task.apply_async(("never",), queue=f"{c.queue}.nobody").id == q1.id
        assert p.task.delay("never").id == q1.id
        wait_for(lambda: c.alive_pttl(f"task:{q1.id}") == -2, 30, "unique_ttl", on_timeout=c.report)
        q2 = short.task.apply_async(("never",), queue=f"{c.queue}.nobody")
        assert q2.id != q1.id
    finally:
        short.close()

    # Running: a duplicate gets the running task; success frees the key.
    r1 = p.task.delay("ok")
    info = _started(c, "ok")
    assert info["id"] == r1.id and info["pid"] != os.getpid()
    [token] = _holders(c, "ok")
    assert token.endswith(f"|task:{r1.id}") and not token.startswith("task")  # adopted
    assert p.task.delay("ok").id == r1.id
    c.go("ok")
    assert r1.get(timeout=60)["id"] == r1.id
    _freed(c, "ok", "the key after success")

    # Failure frees the key.
    r2 = p.task.delay("bad", fail=True)
    _started(c, "bad")
    c.go("bad")
    with pytest.raises(RuntimeError):
        r2.get(timeout=60)
    _freed(c, "bad", "the key after failure")

    # Revoke of a queued message: both pool processes are busy (acks_late,
    # prefetch 1), so it waits in the broker; the worker discards it when
    # it arrives and frees its key (task_revoked).
    b1, b2 = p.task.delay("busy1"), p.task.delay("busy2")
    _started(c, "busy1")
    _started(c, "busy2")
    rv = p.task.delay("revoked")
    assert c.producer.control.revoke(rv.id, reply=True, timeout=10)
    c.go("busy1")
    c.go("busy2")
    b1.get(timeout=60)
    b2.get(timeout=60)
    _freed(c, "revoked", "the revoked message's key")
    assert c.data.llen("e2e:uh-log:revoked") == 0  # it never ran

    # SIGKILL of the pool child running it: the node's cleanup frees the key
    # within a tick (owner TTL 60 s); the redelivered task still runs and
    # takes its key again for the run.
    rk = p.task.delay("kill", block=1)
    held = _started(c, "kill")
    [token] = _holders(c, "kill")
    child_owner = token.split("|")[0]
    os.kill(held["pid"], signal.SIGKILL)
    freed_after = _freed(c, "kill", "the dead child's unique key", timeout=30)
    print(f"unique key of a SIGKILLed pool child freed after {freed_after:.2f}s")
    assert freed_after < 10
    done = rk.get(timeout=90)
    assert done["attempt"] == 2 and done["id"] == rk.id
    assert w.log_lines("unique.key-retaken", rk.id), w.tail()
    # The redelivered run held the key itself, in its own process (the
    # key is free again by now, so the holders are read from the run).
    retaken = done["key_token"]
    assert retaken is not None and retaken.endswith(f"|task:{rk.id}")
    assert retaken.split("|")[0] not in (child_owner, f"task:{rk.id}")
    _freed(c, "kill", "the redelivered task's key")
    assert w.alive


def test_a_sigkilled_worker_frees_its_unique_key_when_it_restarts(
    setup: tuple[Cluster, Producer],
) -> None:
    c, p = setup
    w = c.start_worker("uqk", concurrency=1)
    first = p.task.delay("gone")
    _started(c, "gone")
    assert _holders(c, "gone")
    w.destroy()  # the whole worker: nobody cleans up
    # Still a duplicate: the key lives with the dead process's owner.
    assert p.task.delay("gone").id == first.id
    c.start_worker("uqk", concurrency=1)
    _freed(c, "gone", "the dead worker's unique key, at its successor's start-up", 60)
