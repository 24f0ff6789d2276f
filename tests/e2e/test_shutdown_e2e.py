"""End-to-end: how a worker leaves (real ``celery worker`` subprocesses).

- A worker that fences itself after a same-name successor evicted it exits
  with ``EX_EVICTED`` (70), not 0, so a supervisor sees the failure.
- Warm shutdown does not wait for a task that only queues for its locks: it
  leaves the queue, its message goes back to the broker, and its body never
  runs in the stopping worker; another worker runs it later.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from celery_redislock.integration.bootsteps import EX_EVICTED

from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_worker_evicted_by_a_same_name_successor_fences_itself_and_exits_ex_evicted(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=30, heartbeat=1)
    old = c.start_worker("fenced", concurrency=1)
    c.send("hold", "f1", "t1", queue=old.queue)
    held = c.wait_held("t1")
    old.kill_group(signal.SIGSTOP)  # stalled (a VM pause, a debugger): no heartbeat
    try:
        new = c.start_worker("fenced", concurrency=1)
        wait_for(
            lambda: new.log_lines("node.evicted-predecessor"),
            60,
            "the successor to evict the stalled predecessor",
            on_timeout=c.report,
        )
        assert held["owner"] not in c.owners_holding("res:f1")
    finally:
        old.kill_group(signal.SIGCONT)
    # Resumed, the old worker finds its tombstone, fences itself and exits.
    assert old.wait(60) == EX_EVICTED, old.tail()
    assert old.log_lines("CRITICAL", "node.evicted"), old.tail()
    assert new.alive
    new.send_signal(signal.SIGTERM)
    assert new.wait(60) == 0, new.tail()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_warm_shutdown_hands_a_task_waiting_for_its_lock_back_to_the_broker(
    cluster: Callable[..., Cluster], pool: str
) -> None:
    c = cluster(owner_ttl=30, heartbeat=1)
    holder = c.start_worker("holder", concurrency=1)
    a = c.send("hold", "b1", "tA", queue=holder.queue)
    c.wait_held("tA")
    waiter = c.start_worker("waiter", concurrency=1, pool=pool)
    # The shared queue: the holder's only slot is busy, so the waiter takes
    # B; once requeued, B is free for any worker.
    b = c.send("hold", "b1", "tB", 0)
    wait_for(
        lambda: c.lock_redis.zcard(c.key("q", "res:b1")) == 1,
        60,
        "B to queue for res:b1",
        on_timeout=c.report,
    )
    waiter.send_signal(signal.SIGTERM)
    # Prompt: A still holds the lock, and nothing else would end B's wait.
    assert waiter.wait(60) == 0, waiter.tail()
    assert not c.data.exists("e2e:attempts:tB"), "B's body ran in the stopping worker"
    assert c.lock_redis.zcard(c.key("q", "res:b1")) == 0
    assert waiter.log_lines("locked.shutdown", "res:b1"), waiter.tail()
    assert not b.ready()

    c.go("tA")
    assert a.get(timeout=60)["attempt"] == 1
    info = b.get(timeout=60)  # the requeued message, run by the holder
    assert info["attempt"] == 1
    assert c.data.get("e2e:attempts:tB") == "1"
    wait_for(
        lambda: not c.namespace_keys("lock") and not c.namespace_keys("halt"),
        20,
        "no lock or halt keys left",
        on_timeout=c.report,
    )
