"""Run the engine under eventlet monkey-patching (a subprocess of test_eventlet.py).

Usage: python eventlet_engine.py URL SCENARIO; prints one JSON line.
"""

import eventlet

eventlet.monkey_patch()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from eventlet import patcher  # noqa: E402

from celery_redislock import LockManager  # noqa: E402


def contention(mgr: LockManager) -> dict[str, object]:
    """Green threads contend for one lock; order and overlap are recorded."""
    order: list[int] = []
    inside = [0]
    overlaps = [0]

    def worker(i: int) -> None:
        with mgr.lock(exclusive="e:1", timeout=30):
            inside[0] += 1
            if inside[0] > 1:
                overlaps[0] += 1
            order.append(i)
            eventlet.sleep(0.01)
            inside[0] -= 1

    first = mgr.acquire(exclusive="e:1", timeout=5)
    threads = []
    for i in range(6):
        threads.append(eventlet.spawn(worker, i))
        deadline = time.monotonic() + 10
        while mgr.client.zcard(mgr.keys.queue("e:1")) < i + 1:
            if time.monotonic() > deadline:
                raise RuntimeError("green thread never queued")
            eventlet.sleep(0.005)
    first.release()
    for t in threads:
        t.wait()
    return {"order": order, "overlaps": overlaps[0]}


def blocked_hub(mgr: LockManager) -> dict[str, object]:
    """The heartbeat keeps beating while the hub is blocked by CPU-bound code."""
    lease = mgr.acquire(exclusive="e:3", timeout=5)
    ticks_before = mgr.heartbeat.ticks
    patcher.original("time").sleep(mgr.owner_ttl * 2.5)
    result = {
        "ticks": mgr.heartbeat.ticks - ticks_before,
        "lost": lease.lost,
        "held": mgr.client.hexists(mgr.keys.lock("e:3"), lease.token),
    }
    lease.release()
    return result


if __name__ == "__main__":
    url, scenario = sys.argv[1], sys.argv[2]
    mgr = LockManager(url, owner_ttl=1.0, heartbeat_interval=0.2)
    out = {"contention": contention, "blocked_hub": blocked_hub}[scenario](mgr)
    print(json.dumps(out))
