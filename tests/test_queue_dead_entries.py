"""Dead queue entries never stall a lock, and a cleaned owner leaves no entry.

- A newcomer on a free lock is granted at once, although more dead entries
  than ``queue_scan_limit`` precede it: removing a dead entry does not use
  up the scan budget (it has its own, larger budget).
- A release wakes every waiter it unblocked: a live waiter behind more dead
  entries than the scan limit, and every shared waiter past the window
  (the last woken one carries the wake-up on).
- ``cleanup_owner`` (hence reconcile and the worker's child cleanup) removes
  the owner's queued entries on every resource it waited for, so a dead
  multi-resource waiter leaves no entry in the queue it was not blocked on.

Dead entries are made by the engine itself: a manager queues requests with
its acquire script (``_attempt``, no waiting thread), then its liveness key
is deleted, which is what its liveness expiring does. Waiters whose grant
the tests wait for use ``timeout=None``, ``owner_ttl=120`` and a client with
no socket timeout, so nothing expires and no timer re-runs their script
within the test's deadline: only a pushed wake-up grants them.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import redis

from celery_redislock import LockManager, LockTimeout
from engine_helpers import (
    DEADLINE,
    Child,
    child_waiter,
    namespace_keys,
    queue_requests,
    wait_until,
)
from fairness_helpers import client

NS = "t"
LIMIT = 4
TTL = 120.0


@pytest.fixture
def make(redis_url: str, closing: list[LockManager]) -> Any:
    """make(**kw) -> a manager with queue_scan_limit=4, owner_ttl=120, no socket timeout."""

    def _make(**kw: Any) -> LockManager:
        kw.setdefault("queue_scan_limit", LIMIT)
        kw.setdefault("owner_ttl", TTL)
        mgr = LockManager(client(redis_url), NS, **kw)
        closing.append(mgr)
        return mgr

    return _make


def kill(r: redis.Redis, *mgrs: LockManager) -> None:
    """Make owners dead as their liveness expiring would."""
    for mgr in mgrs:
        assert r.delete(mgr.keys.alive(mgr.owner_id)) == 1


def qlen(r: redis.Redis, resource: str) -> int:
    return int(r.zcard("{t}:q:" + resource))


def hold(make: Any, resources: Any = "R") -> tuple[LockManager, Any]:
    """A live holder of ``resources`` (exclusive) and its lease."""
    holder = make()
    return holder, holder.acquire(resources, timeout=0)


def dead_owner(
    r: redis.Redis, make: Any, count: int, exclusive: Any = None, shared: Any = None
) -> LockManager:
    """An owner that queued ``count`` requests and is dead now."""
    mgr = make()
    queue_requests(mgr, count, exclusive, shared)
    kill(r, mgr)
    return mgr


def waiter_behind(r: redis.Redis, make: Any, count: int) -> tuple[LockManager, Waiter]:
    """An owner queues ``count`` requests for R, then a live waiter queues behind them."""
    ahead = make()
    queue_requests(ahead, count, "R")
    waiter = Waiter(make(), "R")
    wait_until(lambda: qlen(r, "R") == count + 1, what=f"the live waiter queued behind {count}")
    return ahead, waiter


def assert_granted_and_queue_empty(r: redis.Redis, *waiters: Waiter) -> None:
    """Every waiter is granted within the deadline; the queue of R is empty."""
    for w in waiters:
        assert w.granted.wait(DEADLINE), w.error
    assert qlen(r, "R") == 0


class Waiter:
    """acquire(timeout=None) in a thread; ``granted`` is set with the lease."""

    def __init__(self, mgr: LockManager, exclusive: Any = None, shared: Any = None) -> None:
        self.lease: Any = None
        self.error: BaseException | None = None
        self.granted = threading.Event()
        self.done = threading.Event()

        def run() -> None:
            try:
                self.lease = mgr.acquire(exclusive, shared, timeout=None)
                self.granted.set()
            except BaseException as exc:  # reported by the test
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


# -- dead entries and the scan budget ----------------------------------------


def test_try_once_newcomer_is_granted_past_more_dead_entries_than_the_scan_limit(
    r: redis.Redis, make: Any
) -> None:
    # Before: each dead entry removed counted against queue_scan_limit, so a
    # request that met 4 dead entries stayed conservatively behind the rest
    # and a try-once request failed on a free lock.
    _, lease = hold(make)
    dead1, dead2 = make(), make()
    queue_requests(dead1, 10, exclusive="R")
    queue_requests(dead2, 3, shared="R")
    assert qlen(r, "R") == 13
    kill(r, dead1, dead2)
    lease.release()  # frees R; the queue still holds dead entries
    assert r.hlen("{t}:lock:R") == 0

    newcomer = make()
    got = newcomer.acquire("R", timeout=0)

    assert got.fencing_token > lease.fencing_token
    assert qlen(r, "R") == 0
    # each dead request left with its state and wake list
    assert not [k for k in namespace_keys(r) if ":req:" in k or ":wake:" in k]
    got.release()


def test_shared_try_once_newcomer_is_granted_past_dead_shared_entries(
    r: redis.Redis, make: Any
) -> None:
    # Shared entries never conflict with a shared request, but more than the
    # scan limit of them (dead) made it stay behind them.
    _, lease = hold(make)
    dead_owner(r, make, 9, shared="R")
    lease.release()

    got = make().acquire(shared="R", timeout=0)

    assert qlen(r, "R") == 0
    got.release()


def test_waiting_newcomer_past_more_dead_entries_than_the_removal_budget_is_granted(
    r: redis.Redis, make: Any
) -> None:
    # More dead entries than one script may remove (4 x the scan limit):
    # the request removes a budget's worth per attempt and runs again at
    # once, instead of waiting for a timer.
    _, lease = hold(make)
    dead_owner(r, make, 4 * LIMIT * 2 + 3, exclusive="R")
    lease.release()

    waiter = Waiter(make(), "R")

    assert_granted_and_queue_empty(r, waiter)


def test_release_serves_a_live_waiter_behind_more_dead_entries_than_the_scan_limit(
    r: redis.Redis, make: Any
) -> None:
    # Before: the release removed the 4 dead entries of its window and woke
    # nobody; the live waiter, whose liveness deadline was the first dead
    # owner's 120 s, slept until its BLPOP cap (30 s here).
    _, lease = hold(make)
    dying, waiter = waiter_behind(r, make, 10)
    kill(r, dying)

    lease.release()

    assert_granted_and_queue_empty(r, waiter)


def test_release_serves_every_shared_waiter_past_the_scan_window(r: redis.Redis, make: Any) -> None:
    # Before: the release served the first 4 shared waiters; the others were
    # woken only by their own timers (2-5 s with a socket timeout, 30 s here).
    _, lease = hold(make)
    waiters = [Waiter(make(), shared="R") for _ in range(3 * LIMIT + 1)]
    wait_until(lambda: qlen(r, "R") == len(waiters), what="every shared waiter queued")

    lease.release()

    assert_granted_and_queue_empty(r, *waiters)
    assert r.hlen("{t}:lock:R") == len(waiters)
    for w in waiters:
        w.lease.release()


def test_release_serves_shared_waiters_past_the_window_and_dead_entries_among_them(
    r: redis.Redis, make: Any
) -> None:
    _, lease = hold(make)
    waiters: list[Waiter] = []
    dead = [make() for _ in range(3)]
    for rounds, mgr in enumerate(dead, start=1):
        queue_requests(mgr, 3, shared="R")
        waiters += [Waiter(make(), shared="R") for _ in range(3)]
        wait_until(lambda n=6 * rounds: qlen(r, "R") == n, what="waiters queued")
    kill(r, *dead)

    lease.release()

    assert_granted_and_queue_empty(r, *waiters)
    for w in waiters:
        w.lease.release()


# -- cleanup removes the owner's queued entries ----------------------------------


def test_cleanup_removes_a_dead_multi_resource_waiters_entry_from_every_queue(
    r: redis.Redis, make: Any
) -> None:
    # Before: the waiter for A+B blocked on A kept its entry in q:B for ever
    # (no TTL); cleanup walked only the registry of held locks.
    holder, lease = hold(make, "A")
    owner = dead_owner(r, make, 1, exclusive=["A", "B"]).owner_id

    report = holder.cleanup_owner(owner)

    assert report.status == "cleaned"
    assert qlen(r, "A") == 0 and qlen(r, "B") == 0
    # but the expiring 'lost' signal and tombstone of the cleaned owner
    mentions = sorted(k for k in namespace_keys(r) if owner in k)
    assert mentions == ["{t}:dead:" + owner, "{t}:lost:" + owner]
    lease.release()


def test_reconcile_after_sigkilled_multi_resource_waiters_leaves_only_the_fixed_keys(
    redis_url: str, r: redis.Redis, make: Any
) -> None:
    # Processes wait on random sets of resources (exclusive and shared), held
    # by a live holder; they are SIGKILLed and their liveness is gone. After
    # reconcile, nothing in the namespace mentions them (but the expiring
    # 'lost' signal and tombstone of each cleaned owner).
    names = ["A", "B", "C", "D"]
    holder, lease = hold(make, names)
    rng = random.Random(7)
    kids = []
    entries = 0
    try:
        for _ in range(6):
            picked = rng.sample(names, rng.randint(1, 4))
            cut = rng.randint(0, len(picked))
            kids.append(
                Child(child_waiter, redis_url, NS, TTL, picked[:cut], picked[cut:], DEADLINE * 3)
            )
            entries += len(picked)
        owners = [kid.expect("waiting")[1] for kid in kids]
        wait_until(lambda: sum(qlen(r, n) for n in names) == entries, what="every child queued")
        for kid in kids:
            kid.proc.kill()
            kid.proc.join(10)
        for owner in owners:
            r.delete("{t}:alive:" + owner)  # what their liveness expiring does

        report = holder.reconcile()

        assert report.cleaned == len(owners)
        left = namespace_keys(r)
        for owner in owners:
            mentions = {k for k in left if owner in k}
            assert mentions == {"{t}:lost:" + owner, "{t}:dead:" + owner}, mentions
            assert r.pttl("{t}:lost:" + owner) > 0 and r.pttl("{t}:dead:" + owner) > 0
        me = holder.owner_id
        # the namespace's own keys and the live holder's liveness
        base = {"{t}:fence", "{t}:born", "{t}:format", "{t}:seq", "{t}:owners", "{t}:alive:" + me}
        fixed = {
            *base,
            "{t}:held:" + me,
            *("{t}:lock:" + n for n in names),
            *("{t}:contended:" + n for n in names),  # expiring signals to the holder
        }
        signals = (":lost:", ":dead:")
        assert {k for k in left if not any(x in k for x in signals)} <= fixed
        assert {k for k in left if not any(x in k for x in signals)} >= fixed - {
            "{t}:contended:" + n for n in names
        }

        lease.release()
        left = {k for k in namespace_keys(r) if not any(x in k for x in signals)}
        assert left == base
    finally:
        for kid in kids:
            kid.close()


def test_cleanup_wakes_the_waiter_behind_the_dead_owners_entries(r: redis.Redis, make: Any) -> None:
    # The dead owner's entries were ahead of a live waiter; removing them at
    # cleanup serves the waiter at once (the lock is free).
    holder, lease = hold(make)
    dying, waiter = waiter_behind(r, make, 10)
    lease.release()  # hands R to the (still live) head entry of the dying owner
    assert r.hlen("{t}:lock:R") == 1 and not waiter.granted.is_set()

    holder.cleanup_owner(dying.owner_id, force=True)

    assert_granted_and_queue_empty(r, waiter)


def test_timeout_zero_request_never_queues_and_leaves_no_waits_record(
    r: redis.Redis, make: Any
) -> None:
    _, lease = hold(make)
    other = make()
    with pytest.raises(LockTimeout):
        other.acquire("R", timeout=0)
    assert not [k for k in namespace_keys(r) if ":waits:" in k]
    lease.release()
