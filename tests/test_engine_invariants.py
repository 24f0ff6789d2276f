"""Invariants 2-4 and 10 of docs/design.md against a real Redis, in one process.

All or nothing, owner-checked release, registry truth, odd keys kept and
reported, and one failing key not stopping the cleanup of the others. A dead
owner is made by deleting its liveness key, which is what its expiry does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import redis

from celery_redislock import LockManager, LockTimeout
from engine_helpers import (
    Managers,
    assert_registry_truth,
    lock_holders,
    namespace_keys,
    queue_requests,
    registries,
    wait_until,
)

T = TypeVar("T")


def kill_liveness(r: redis.Redis, mgr_or_owner: LockManager | str) -> str:
    """Make an owner dead as its liveness expiring would; returns its id."""
    owner = mgr_or_owner if isinstance(mgr_or_owner, str) else mgr_or_owner.owner_id
    assert r.delete("{t}:alive:" + owner) == 1
    return owner


def lock(name: str) -> str:
    return "{t}:lock:" + name


# -- all or nothing -------------------------------------------------------


def test_try_once_on_partial_conflict_leaves_only_the_holders_keys(
    managers: Managers, r: redis.Redis
) -> None:
    holder, other = managers(), managers()
    held = holder.acquire(exclusive=["b"], timeout=0)

    with pytest.raises(LockTimeout) as info:
        other.acquire(exclusive=["a"], shared=["b"], timeout=0)

    assert info.value.resources == ("a", "b")
    # A grant keeps no request record: its fence is stored in the lock hash.
    assert namespace_keys(r) == {
        "{t}:fence",
        "{t}:born",
        "{t}:format",
        "{t}:owners",
        lock("b"),
        "{t}:held:" + holder.owner_id,
        "{t}:alive:" + holder.owner_id,
        # no {t}:contended:b: that stream exists only while a holder of b
        # waits in wait_for_contender
        "{t}:alive:" + other.owner_id,  # liveness expires by itself
    }
    assert lock_holders(r) == {lock("b"): {held.token: "x"}}
    assert_registry_truth(r)


def test_timed_out_wait_on_partial_conflict_leaves_no_lock_queue_or_request(
    managers: Managers, r: redis.Redis
) -> None:
    holder, other = managers(), managers()
    held = holder.acquire(exclusive=["b"], timeout=0)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            other.acquire(exclusive=["a"], shared=["b"], timeout=1.0)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    # while it waits it is queued on both resources and holds neither
    wait_until(lambda: r.zcard("{t}:q:a") == 1 and r.zcard("{t}:q:b") == 1, what="queued")
    assert not r.exists(lock("a"))
    waiter.join(30)

    assert len(outcome) == 1 and isinstance(outcome[0], LockTimeout)
    assert namespace_keys(r) == {
        "{t}:fence",
        "{t}:born",
        "{t}:format",
        "{t}:seq",
        "{t}:owners",
        lock("b"),
        "{t}:held:" + holder.owner_id,
        "{t}:alive:" + holder.owner_id,
        "{t}:alive:" + other.owner_id,
    }
    assert lock_holders(r) == {lock("b"): {held.token: "x"}}
    assert_registry_truth(r)

    # and the freed resource is grantable at once
    held.release()
    with other.lock(exclusive=["a"], shared=["b"], timeout=0):
        pass


# -- owner-checked release ------------------------------------------------


def test_release_of_an_old_lease_after_reclaim_keeps_the_new_holder(
    managers: Managers, r: redis.Redis
) -> None:
    first, second = managers(), managers()
    old = first.acquire(exclusive=["a"], timeout=0)
    kill_liveness(r, first)
    new = second.acquire(exclusive=["a"], timeout=0)  # reclaims the dead owner's lock
    assert new.fencing_token > old.fencing_token

    old.release()

    assert old.lost  # release found its lock gone: the lease learns it was lost
    assert lock_holders(r) == {lock("a"): {new.token: "x"}}
    assert registries(r) == {second.owner_id: {lock("a")}}
    assert_registry_truth(r)


def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a thread of its own (not reentrant with this one's leases)."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    assert out, "the thread failed"
    return out[0]


def test_old_lease_of_a_reborn_owner_does_not_free_its_newer_lease(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    old = mgr.acquire(exclusive=["a"], timeout=0)
    kill_liveness(r, mgr)
    # Another thread (the same thread would re-enter its own lease, which it
    # does not know to be lost yet): it continues under a new identity.
    new = in_thread(lambda: mgr.acquire(exclusive=["a"], timeout=0))
    assert new.owner_id != old.owner_id
    assert old.lost

    old.release()

    assert lock_holders(r) == {lock("a"): {new.token: "x"}}
    assert_registry_truth(r)
    new.release()
    assert lock_holders(r) == {}


def test_releasing_one_of_two_shared_leases_of_one_owner_keeps_the_other(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    one = mgr.acquire(shared=["a"], timeout=0)
    two = in_thread(lambda: mgr.acquire(shared=["a"], timeout=1))  # a second thread's lease
    assert one.token != two.token

    one.release()
    one.release()  # idempotent

    assert lock_holders(r) == {lock("a"): {two.token: "s"}}
    assert registries(r) == {mgr.owner_id: {lock("a")}}
    two.release()
    assert lock_holders(r) == {} and registries(r) == {}


# -- registry truth -------------------------------------------------------


def test_registry_equals_held_lock_keys_after_every_operation(
    managers: Managers, r: redis.Redis
) -> None:
    a, b, c = managers(), managers(), managers()

    def check(expected: dict[str, set[str]]) -> None:
        assert registries(r) == expected
        assert_registry_truth(r)

    la = a.acquire(exclusive=["x1"], shared=["s1"], timeout=0)
    check({a.owner_id: {lock("x1"), lock("s1")}})
    # shared twice by one owner (another thread: this one would re-enter la)
    la2 = in_thread(lambda: a.acquire(shared=["s1", "s2"], timeout=1))
    check({a.owner_id: {lock("x1"), lock("s1"), lock("s2")}})
    lb = b.acquire(shared=["s1"], exclusive=["y"], timeout=0)
    check({a.owner_id: {lock("x1"), lock("s1"), lock("s2")}, b.owner_id: {lock("s1"), lock("y")}})
    la.release()
    check({a.owner_id: {lock("s1"), lock("s2")}, b.owner_id: {lock("s1"), lock("y")}})

    dead = kill_liveness(r, b)
    lc = c.acquire(exclusive=["y"], timeout=0)  # reclaim of y from the dead owner
    check({a.owner_id: {lock("s1"), lock("s2")}, dead: {lock("s1")}, c.owner_id: {lock("y")}})

    report = a.cleanup_owner(dead)
    assert (report.status, report.released, report.remaining) == ("cleaned", 1, 0)
    check({a.owner_id: {lock("s1"), lock("s2")}, c.owner_id: {lock("y")}})
    assert dead not in {m.decode() for m in r.smembers("{t}:owners")}

    dead_c = kill_liveness(r, c)
    rec = a.reconcile()
    assert rec.cleaned == 1 and rec.released == 1 and rec.alive == 1
    check({a.owner_id: {lock("s1"), lock("s2")}})
    assert {m.decode() for m in r.smembers("{t}:owners")} == {a.owner_id}
    assert dead_c not in registries(r)

    la2.release()
    lb.release()  # dead owner's lease: frees nothing now
    lc.release()
    check({})
    assert lock_holders(r) == {}
    # release never takes a live owner out of the active-owners set
    assert {m.decode() for m in r.smembers("{t}:owners")} == {a.owner_id}


def test_an_owner_listed_by_its_first_grant_is_found_by_reconcile_after_later_grants(
    managers: Managers, r: redis.Redis
) -> None:
    # Only an owner's first grant (or queued request) adds it to {ns}:owners;
    # later acquires skip the SADD. Reconcile must still find it when it dies
    # holding locks taken by those later acquires, and the new identity of a
    # process whose owner was cleaned up is added again.
    owner_mgr, other = managers(), managers()
    owner_mgr.acquire("first", timeout=0).release()
    assert owner_mgr.liveness.identity.current().listed
    held = owner_mgr.acquire(exclusive=["a", "b"], timeout=0)
    dead = kill_liveness(r, owner_mgr)
    assert dead in {m.decode() for m in r.smembers("{t}:owners")}

    report = other.reconcile()

    assert (report.cleaned, report.released) == (1, 2)
    assert lock_holders(r) == {}
    held.release()  # the dead owner's lease: frees nothing now
    lease = owner_mgr.acquire("again", timeout=0)  # a new identity
    assert lease.owner_id != dead
    assert lease.owner_id in {m.decode() for m in r.smembers("{t}:owners")}
    lease.release()


def test_an_owner_whose_grant_and_listing_redis_lost_is_listed_again_by_its_next_grant(
    managers: Managers, r: redis.Redis
) -> None:
    # A failover to a replica that missed the owner's first grant loses that
    # grant and the owner's {ns}:owners entry together, while the owner (its
    # liveness registered earlier) lives on. Its release finds the grant
    # gone; its next grant must list it again, or reconcile would never
    # find it when it dies.
    mgr = managers()
    lease = mgr.acquire("a", timeout=0)
    assert mgr.liveness.identity.current().listed
    # What the replica missed: the grant and the listing.
    r.hdel("{t}:lock:a", lease.token)
    r.hdel("{t}:held:" + mgr.owner_id, "a")
    r.srem("{t}:owners", mgr.owner_id)

    lease.release()  # finds the grant gone
    again = mgr.acquire("b", timeout=0)

    assert again.owner_id == lease.owner_id  # the same, live owner
    assert mgr.owner_id in {m.decode() for m in r.smembers("{t}:owners")}
    again.release()


def test_cleanup_of_a_live_owner_frees_nothing_unless_forced(
    managers: Managers, r: redis.Redis
) -> None:
    live = managers(owner_ttl=2.0)
    cleaner = managers()
    lease = live.acquire(exclusive=["a"], timeout=0)

    report = cleaner.cleanup_owner(live.owner_id)
    assert report.status == "alive" and report.released == 0
    assert lock_holders(r) == {lock("a"): {lease.token: "x"}}

    forced = cleaner.cleanup_owner(live.owner_id, force=True)
    assert (forced.status, forced.released) == ("cleaned", 1)
    assert lock_holders(r) == {} and registries(r) == {}
    # the live owner's heartbeat finds its liveness gone and fences itself
    wait_until(lambda: lease.lost, what="lease marked lost by the heartbeat")


# -- odd keys and failure isolation ----------------------------------------


def test_cleanup_keeps_and_reports_registry_keys_of_unexpected_type(
    managers: Managers, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    owner_mgr, cleaner = managers(), managers()
    owner_mgr.acquire(exclusive=["good"], timeout=0)
    owner = kill_liveness(r, owner_mgr)
    r.set(lock("odd"), "not a hash")
    r.hset("{t}:held:" + owner, "odd", "")

    with caplog.at_level(logging.WARNING, logger="celery_redislock.cleanup"):
        report = cleaner.cleanup_owner(owner)

    assert report.status == "partial"
    assert report.released == 1
    assert sorted(report.skipped) == [(lock("odd"), "string")]
    assert report.errors == ()
    assert report.remaining == 1
    # kept, not silently orphaned: the registry still names it, the key is intact
    assert registries(r) == {owner: {lock("odd")}}
    assert r.get(lock("odd")) == b"not a hash"
    assert not r.exists(lock("good"))
    assert owner in {m.decode() for m in r.smembers("{t}:owners")}  # retried next pass
    assert f"cleanup.skipped owner={owner} key={lock('odd')} type=string" in caplog.text

    rec = cleaner.reconcile()
    assert rec.partial == 1
    assert [owner, lock("odd"), "string"] in rec.as_dict()["skipped"]  # type: ignore[operator]


def test_cleanup_frees_every_lock_of_the_owner_before_serving_a_waiter(
    managers: Managers, r: redis.Redis
) -> None:
    # Before: each lock's waiters were served as soon as that lock was freed.
    # Here the waiter queued for b and a is handed both once b is freed
    # (a is held shared by the same dead owner), and the hand-off's wake-up
    # of a's queue reclaimed the owner's grant on a as a dead holder's: the
    # report said 1 lock released for an owner that held 2.
    owner_mgr, waiter, cleaner = managers(), managers(), managers()
    owner_mgr.acquire(exclusive=["b"], timeout=0)
    owner_mgr.acquire(shared=["a"], timeout=0)
    [both] = queue_requests(waiter, 1, exclusive="b", shared="a")
    queue_requests(waiter, 1, exclusive="a")
    owner = owner_mgr.owner_id

    report = cleaner.cleanup_owner(owner, force=True)

    assert (report.status, report.released, report.errors) == ("cleaned", 2, ())
    assert lock_holders(r) == {lock("b"): {both: "x"}, lock("a"): {both: "s"}}
    assert_registry_truth(r)


def test_cleanup_failure_of_one_key_does_not_stop_the_others(
    managers: Managers, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    owner_mgr, cleaner = managers(), managers()
    owner_mgr.acquire(exclusive=["a", "b", "c"], timeout=0)
    owner = kill_liveness(r, owner_mgr)
    r.set("{t}:q:b", "wrong type")  # b's cleanup errors when it wakes b's queue

    with caplog.at_level(logging.ERROR, logger="celery_redislock.cleanup"):
        report = cleaner.cleanup_owner(owner)

    assert report.status == "partial"
    assert [key for key, _ in report.errors] == [lock("b")]
    assert "WRONGTYPE" in report.errors[0][1]
    assert not r.exists(lock("a")) and not r.exists(lock("c"))  # the others freed
    assert registries(r) == {owner: {lock("b")}}  # the failing key kept for the next pass
    assert owner in {m.decode() for m in r.smembers("{t}:owners")}
    assert f"cleanup.key-error owner={owner} key={lock('b')}" in caplog.text

    r.delete("{t}:q:b")
    again = cleaner.cleanup_owner(owner)
    assert again.status == "cleaned" and again.errors == ()
    assert registries(r) == {} and lock_holders(r) == {}
    assert owner not in {m.decode() for m in r.smembers("{t}:owners")}


def test_reconcile_isolates_an_owner_whose_cleanup_fails(
    managers: Managers, r: redis.Redis
) -> None:
    bad_mgr, good_mgr, cleaner = managers(), managers(), managers()
    bad_mgr.acquire(exclusive=["bad"], timeout=0)
    good_mgr.acquire(exclusive=["good"], timeout=0)
    bad, good = kill_liveness(r, bad_mgr), kill_liveness(r, good_mgr)
    r.delete("{t}:held:" + bad)
    r.set("{t}:held:" + bad, "registry of the wrong type")  # HKEYS fails

    rec = cleaner.reconcile()

    assert list(rec.errors) == [bad]
    assert rec.cleaned == 1
    assert not r.exists(lock("good"))
    owners = {m.decode() for m in r.smembers("{t}:owners")}
    assert bad in owners and good not in owners


def test_reconcile_counts_a_dead_holder_reclaimed_while_serving_another_dead_owners_waiter(
    managers: Managers, r: redis.Redis
) -> None:
    # Two dead owners share 'a'; a live owner queues for it exclusively.
    # Cleaning the first serves the waiter, which reclaims the second's
    # grant on the way: the second's own cleanup then finds nothing, and
    # the pass must still count both grants.
    one, two = managers(heartbeat=False), managers(heartbeat=False)
    for dead in (one, two):  # no lost-owner watch freeing them first
        dead.watcher.exempt_pid = os.getpid()
    waiter, sweeper = managers(), managers()
    one.acquire(shared="a", timeout=0)
    two.acquire(shared="a", timeout=0)
    (token,) = queue_requests(waiter, 1, exclusive="a")
    kill_liveness(r, one)
    kill_liveness(r, two)

    report = sweeper.reconcile()

    assert report.cleaned == 2, report
    assert report.released == 2, report
    assert sum(c.reclaimed for c in report.reports) == 1, report
    assert set(lock_holders(r)[lock("a")]) == {token}  # handed to the waiter
    assert_registry_truth(r)
