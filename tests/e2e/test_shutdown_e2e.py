"""End-to-end: how a worker leaves (real ``celery worker`` subprocesses).

- A worker that fences itself after a same-name successor evicted it exits
  with ``EX_EVICTED`` (70), not 0, so a supervisor sees the failure.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from celery_redislock.bootsteps import EX_EVICTED

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
