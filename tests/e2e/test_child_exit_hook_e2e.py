"""End-to-end: the prefork pool's process-down hook frees a dead child's locks at once.

The node heartbeat interval is 60 s (owner TTL 180 s): the first regular
tick comes 60 s after the worker claimed its node record, so a SIGKILLed
child's lock freed well before that can only be the pool hook's work
(``on_process_down`` -> ``Node.child_exited`` -> an immediate beat).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from .harness import Cluster, redis_ms, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

INTERVAL_MS = 60_000


def test_sigkilled_child_lock_freed_by_pool_hook_long_before_the_next_heartbeat_tick(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=180, heartbeat=60)
    w = c.start_worker("hook", concurrency=1)
    result = c.send("hold", "h1", "t1", 1)
    held = c.wait_held("t1")
    owner = held["owner"]
    assert owner and owner in c.owners_holding("res:h1")
    record = c.lock_redis.hgetall(c.key("node", w.nodename))
    assert record["hb"] == "0", record  # no heartbeat tick yet
    started_ms = int(record["hb_ms"])

    os.kill(held["pid"], signal.SIGKILL)
    c.wait_freed(owner, "res:h1", "the dead child's lock to be freed", timeout=45)
    freed_ms = redis_ms(c)

    # freed before a regular tick was even due (Redis TIME, no local clock)
    assert freed_ms - started_ms < INTERVAL_MS, (freed_ms - started_ms, c.report())
    wait_for(lambda: not c.lock_redis.exists(c.key("held", owner)), 10, "dead child's registry")
    assert owner not in c.active_owners()
    assert c.lock_redis.exists(c.key("alive", owner)) == 0
    # The node logs after the cleanup script and its group HDEL: wait for
    # the line rather than read the log the moment Redis shows the result.
    wait_for(
        lambda: w.log_lines("cleanup.dead-owner", owner),
        timeout=10,
        what="the cleanup.dead-owner log line",
        on_timeout=w.tail,
    )
    # the redelivered task runs in the replacement child
    done = result.get(timeout=90)
    assert done["attempt"] == 2 and done["pid"] != held["pid"]
