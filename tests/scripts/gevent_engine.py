"""Run the engine under gevent monkey-patching (a subprocess of test_gevent.py).

Usage: python gevent_engine.py URL SCENARIO; prints one JSON line.
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402

from celery_redislock import LockManager, LockTimeout  # noqa: E402


def contention(mgr: LockManager) -> dict[str, object]:
    """Greenlets contend for one lock; order and overlap are recorded."""
    order: list[int] = []
    inside = [0]
    overlaps = [0]

    def worker(i: int) -> None:
        with mgr.lock(exclusive="g:1", timeout=30):
            inside[0] += 1
            if inside[0] > 1:
                overlaps[0] += 1
            order.append(i)
            gevent.sleep(0.01)
            inside[0] -= 1

    first = mgr.acquire(exclusive="g:1", timeout=5)
    greenlets = []
    for i in range(6):
        greenlets.append(gevent.spawn(worker, i))
        # wait until greenlet i is queued before starting the next (FIFO check)
        deadline = time.monotonic() + 10
        while mgr.client.zcard(mgr.keys.queue("g:1")) < i + 1:
            if time.monotonic() > deadline:
                raise RuntimeError("greenlet never queued")
            gevent.sleep(0.005)
    first.release()
    gevent.joinall(greenlets, timeout=30, raise_error=True)
    return {"order": order, "overlaps": overlaps[0]}


def kill_waiter(mgr: LockManager) -> dict[str, object]:
    """A waiting greenlet is killed (GreenletExit): its queue entry goes."""
    holder = mgr.acquire(exclusive="g:2", timeout=5)
    errors: list[str] = []

    def waiter() -> None:
        try:
            mgr.acquire(exclusive="g:2", timeout=30)
        except LockTimeout as exc:  # not expected
            errors.append(repr(exc))

    g = gevent.spawn(waiter)
    deadline = time.monotonic() + 10
    while mgr.client.zcard(mgr.keys.queue("g:2")) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("waiter never queued")
        gevent.sleep(0.005)
    g.kill(block=True, timeout=10)
    queued_after_kill = mgr.client.zcard(mgr.keys.queue("g:2"))
    holder.release()
    return {
        "queued_after_kill": queued_after_kill,
        "lock_exists": mgr.client.exists(mgr.keys.lock("g:2")),
        "errors": errors,
    }


def blocked_hub(mgr: LockManager) -> dict[str, object]:
    """The heartbeat keeps beating while the hub is blocked by CPU-bound code."""
    lease = mgr.acquire(exclusive="g:3", timeout=5)
    ticks_before = mgr.heartbeat.ticks
    # Block the hub: the unpatched sleep holds the only greenlet thread.
    real_sleep = monkey.get_original("time", "sleep")
    real_sleep(mgr.owner_ttl * 2.5)
    ticks_after = mgr.heartbeat.ticks
    result = {
        "ticks": ticks_after - ticks_before,
        "lost": lease.lost,
        "held": mgr.client.hexists(mgr.keys.lock("g:3"), lease.token),
    }
    lease.release()
    return result


def reentrant(mgr: LockManager) -> dict[str, object]:
    """Greenlet-local reentrancy: the holder re-enters, a sibling greenlet
    queues (and times out), and a greenlet killed inside its inner block
    leaves the outer lock held."""
    out: dict[str, object] = {}
    outer = mgr.acquire(exclusive="g:4", timeout=5)
    inner = mgr.acquire(exclusive="g:4")  # same greenlet: at once, no timeout needed
    out["same_fence"] = inner.fencing_token == outer.fencing_token
    inner.release()

    def sibling() -> str:
        try:
            mgr.acquire(exclusive="g:4", timeout=0.3).release()
            return "granted"
        except LockTimeout:
            return "timeout"

    out["sibling"] = gevent.spawn(sibling).get(timeout=10)

    def holder_killed_inside() -> None:
        with mgr.lock(exclusive="g:5", timeout=5):
            with mgr.lock(exclusive="g:5"):
                gevent.sleep(30)  # killed here, inside the inner block

    g = gevent.spawn(holder_killed_inside)
    deadline = time.monotonic() + 10
    while not mgr.client.exists(mgr.keys.lock("g:5")):
        if time.monotonic() > deadline:
            raise RuntimeError("holder never took g:5")
        gevent.sleep(0.005)
    g.kill(block=True, timeout=10)
    # Both with-blocks exited: the inner dropped its count, the outer released.
    out["g5_after_kill"] = mgr.client.exists(mgr.keys.lock("g:5"))
    out["g4_held"] = mgr.client.hexists(mgr.keys.lock("g:4"), outer.token)
    outer.release()
    out["g4_after"] = mgr.client.exists(mgr.keys.lock("g:4"))
    return out


if __name__ == "__main__":
    url, scenario = sys.argv[1], sys.argv[2]
    mgr = LockManager(url, owner_ttl=1.0, heartbeat_interval=0.2)
    out = {
        "contention": contention,
        "kill_waiter": kill_waiter,
        "blocked_hub": blocked_hub,
        "reentrant": reentrant,
    }[scenario](mgr)
    print(json.dumps(out))
