"""The engine scenarios the green-thread scripts share (eventlet_engine.py, gevent_engine.py).

A script monkey-patches first, then imports this module and calls
:func:`main` with a :class:`Green`: what the scenarios need of its library.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_redislock import LockManager

Scenario = Callable[[LockManager], dict[str, object]]


@dataclass(frozen=True)
class Green:
    """A green-thread library, as the scenarios use it."""

    #: Prefix of the scenarios' resource names (``<prefix>:1``...).
    prefix: str
    #: What the library calls a green thread, for error messages.
    thread_name: str
    spawn: Callable[..., Any]
    sleep: Callable[[float], None]
    #: Wait until every spawned green thread is done.
    join_all: Callable[[list[Any]], None]
    #: The unpatched ``time.sleep``: it blocks the hub.
    real_sleep: Callable[[float], None]

    def wait(self, cond: Callable[[], bool], failure: str, timeout: float = 10) -> None:
        """Poll ``cond`` between green sleeps; RuntimeError(``failure``) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(failure)
            self.sleep(0.005)


def _spawn_in_queue_order(
    mgr: LockManager, green: Green, resource: str, worker: Callable[[int], None]
) -> list[Any]:
    """Spawn ``worker(0)`` .. ``worker(5)``, each once the one before is
    queued for ``resource`` (so that their arrival order is known)."""
    threads = []
    for i in range(6):
        threads.append(green.spawn(worker, i))
        green.wait(
            lambda queued=i + 1: mgr.client.zcard(mgr.keys.queue(resource)) >= queued,
            f"{green.thread_name} never queued",
        )
    return threads


def contention(mgr: LockManager, green: Green) -> dict[str, object]:
    """Green threads contend for one lock; order and overlap are recorded."""
    resource = f"{green.prefix}:1"
    order: list[int] = []
    inside = [0]
    overlaps = [0]

    def worker(i: int) -> None:
        with mgr.lock(exclusive=resource, timeout=30):
            inside[0] += 1
            if inside[0] > 1:
                overlaps[0] += 1
            order.append(i)
            green.sleep(0.01)
            inside[0] -= 1

    first = mgr.acquire(exclusive=resource, timeout=5)
    threads = _spawn_in_queue_order(mgr, green, resource, worker)
    first.release()
    green.join_all(threads)
    return {"order": order, "overlaps": overlaps[0]}


def blocked_hub(mgr: LockManager, green: Green) -> dict[str, object]:
    """The heartbeat keeps beating while the hub is blocked by CPU-bound code."""
    resource = f"{green.prefix}:3"
    lease = mgr.acquire(exclusive=resource, timeout=5)
    ticks_before = mgr.heartbeat.ticks
    green.real_sleep(mgr.owner_ttl * 2.5)
    result = {
        "ticks": mgr.heartbeat.ticks - ticks_before,
        "lost": lease.lost,
        "held": mgr.client.hexists(mgr.keys.lock(resource), lease.token),
    }
    lease.release()
    return result


def limited(mgr: LockManager, green: Green) -> dict[str, object]:
    """Green threads wait for slots of one limited resource (N = 3): the
    most inside at once, and each one's fence by arrival (grant order)."""
    resource = f"{green.prefix}:lim"
    fences: dict[int, int] = {}
    inside, peak = [0], [0]

    def worker(i: int) -> None:
        with mgr.lock(limited={resource: 3}, timeout=30) as lease:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            fences[i] = lease.fencing_token
            green.sleep(0.01)
            inside[0] -= 1

    held = [mgr.acquire(limited={resource: 3}, timeout=5, nested=False) for _ in range(3)]
    threads = _spawn_in_queue_order(mgr, green, resource, worker)
    for lease in held:
        lease.release()
    green.join_all(threads)
    return {
        "peak": peak[0],
        "fences_in_arrival_order": [fences[i] for i in range(6)] == sorted(fences.values()),
        "queued_after": mgr.client.zcard(mgr.keys.queue(resource)),
        "lock_exists": mgr.client.exists(mgr.keys.lock(resource)),
    }


def main(green: Green, more: dict[str, Scenario] | None = None) -> None:
    """Run scenario ``argv[2]`` against Redis ``argv[1]``; print one JSON line.

    ``more``: the library's scenarios of its own, by name.
    """
    url, scenario = sys.argv[1], sys.argv[2]
    mgr = LockManager(url, owner_ttl=1.0, heartbeat_interval=0.2)
    scenarios: dict[str, Scenario] = {
        "contention": lambda m: contention(m, green),
        "blocked_hub": lambda m: blocked_hub(m, green),
        "limited": lambda m: limited(m, green),
        **(more or {}),
    }
    print(json.dumps(scenarios[scenario](mgr)))
