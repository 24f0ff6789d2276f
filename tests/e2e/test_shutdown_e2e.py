"""End-to-end: how a worker leaves (real ``celery worker`` subprocesses).

- A worker that fences itself after a same-name successor evicted it exits
  with ``EX_EVICTED`` (70), not 0, so a supervisor sees the failure.
- Warm shutdown does not wait for a task that only queues for its locks: it
  leaves the queue, its message goes back to the broker, and its body never
  runs in the stopping worker; another worker runs it later.
- Warm shutdown ends the worker's own threads (the deferred-task
  dispatcher, the node heartbeat) before the process exits, whether the
  dispatcher waits in its BLMOVE or pauses after a failed pass (the lock
  Redis out of reach): none of them runs on while the interpreter exits.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator

import pytest

from celery_redislock.integration.bootsteps import EX_EVICTED
from redis_server import RedisServer
from tcp_proxy import TcpProxy

from .harness import Cluster, Worker, wait_for

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


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[TcpProxy]:
    with TcpProxy(redis_server.port) as p:
        yield p


def _threads_at_exit(c: Cluster, w: Worker) -> list[str]:
    """The threads alive in ``w``'s main process at ``worker_shutdown``."""
    raw = wait_for(
        lambda: c.data.lindex(f"e2e:threads-at-exit:{w.nodename}", 0),
        30,
        "the worker to record its threads at worker_shutdown",
        on_timeout=w.tail,
    )
    names: list[str] = json.loads(raw)
    return names


@pytest.mark.parametrize("outage", [False, True], ids=["blmove", "outage"])
def test_warm_shutdown_ends_the_dispatcher_and_node_heartbeat_threads(
    cluster: Callable[..., Cluster], proxy: TcpProxy, outage: bool
) -> None:
    # The default interval: the dispatcher's BLMOVE blocks for seconds.
    c = cluster(lock_url=proxy.url, record_threads=1)
    w = c.start_worker("exit", pool="threads", concurrency=1)
    if outage:
        proxy.cut()
        wait_for(
            lambda: w.log_lines("defer.dispatch-unavailable"),
            30,
            "the dispatcher to meet the outage",
            on_timeout=w.tail,
        )
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.tail()
    left = [n for n in _threads_at_exit(c, w) if n.startswith("redislock-")]
    assert left == [], w.tail()
    if not outage:
        assert w.log_lines("node.stop"), w.tail()
    assert not w.log_lines("stop-timeout"), w.tail()
