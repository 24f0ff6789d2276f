"""Run the engine under gevent monkey-patching (a subprocess of test_gevent.py).

Usage: python gevent_engine.py URL SCENARIO; prints one JSON line.
"""

from gevent import monkey

monkey.patch_all()

import gevent  # noqa: E402
from green_scenarios import Green, main  # noqa: E402

from celery_redislock import LockManager, LockTimeout  # noqa: E402


def _join_all(greenlets: list[gevent.Greenlet]) -> None:
    gevent.joinall(greenlets, timeout=30, raise_error=True)


# prefix, thread name, spawn, sleep, join_all, the unpatched sleep (blocks the hub)
GEVENT = Green(
    "g", "greenlet", gevent.spawn, gevent.sleep, _join_all, monkey.get_original("time", "sleep")
)


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
    GEVENT.wait(lambda: mgr.client.zcard(mgr.keys.queue("g:2")) >= 1, "waiter never queued")
    g.kill(block=True, timeout=10)
    queued_after_kill = mgr.client.zcard(mgr.keys.queue("g:2"))
    holder.release()
    return {
        "queued_after_kill": queued_after_kill,
        "lock_exists": mgr.client.exists(mgr.keys.lock("g:2")),
        "errors": errors,
    }


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
    GEVENT.wait(lambda: bool(mgr.client.exists(mgr.keys.lock("g:5"))), "holder never took g:5")
    g.kill(block=True, timeout=10)
    # Both with-blocks exited: the inner dropped its count, the outer released.
    out["g5_after_kill"] = mgr.client.exists(mgr.keys.lock("g:5"))
    out["g4_held"] = mgr.client.hexists(mgr.keys.lock("g:4"), outer.token)
    outer.release()
    out["g4_after"] = mgr.client.exists(mgr.keys.lock("g:4"))
    return out


if __name__ == "__main__":
    main(GEVENT, {"kill_waiter": kill_waiter, "reentrant": reentrant})
