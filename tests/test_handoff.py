"""Hand-off: a release grants the head waiter its locks inside the script.

The waiter learns its grant from the push to its wake list ('g<fence>'),
without running its acquire script again: one round trip fewer per
hand-over, and FIFO is exact because nobody can slip in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redislock import Lease, LockManager
from fairness_helpers import PREFIX, ThreadWaiter, manager, queue_len, wait_until


def _assert_holds_a_and_b(rs: redis.Redis, lease: Lease) -> None:
    """``lease`` holds A and B exclusively, under its one token and fence."""
    token, fence = lease.token, lease.fencing_token
    assert rs.hgetall(f"{PREFIX}lock:A") == {token: f"x{fence}"}
    assert rs.hgetall(f"{PREFIX}lock:B") == {token: f"x{fence}"}


@pytest.fixture
def make(redis_url: str) -> Iterator[Any]:
    made: list[LockManager] = []

    def _make() -> LockManager:
        m = manager(redis_url)
        made.append(m)
        return m

    yield _make
    for m in made:
        m.close()


def count_attempts(mgr: LockManager) -> list[Any]:
    """Record every acquire-script reply of ``mgr``."""
    replies: list[Any] = []
    real = mgr.acquirer.attempt

    def attempt(*args: Any, **kwargs: Any) -> Any:
        reply = real(*args, **kwargs)
        replies.append(reply)
        return reply

    mgr.acquirer.attempt = attempt  # type: ignore[method-assign]
    return replies


def test_release_hands_the_lock_to_the_head_waiter_without_a_second_attempt(
    rs: redis.Redis, make: Any
) -> None:
    # Without hand-off the woken waiter runs its acquire script again (two
    # attempts); with it, the only attempt is the one that queued it.
    holder, waiter_mgr = make(), make()
    lease = holder.acquire("R")
    replies = count_attempts(waiter_mgr)
    waiter = ThreadWaiter(waiter_mgr, "R", release=False)
    wait_until(lambda: queue_len(rs, "R") == 1, what="waiter queued")
    lease.release()
    waiter.join()
    assert waiter.error is None
    assert [int(r[0]) for r in replies] == [0]  # queued once, never re-ran
    assert waiter.lease.fencing_token > lease.fencing_token
    # The grant carries its fencing token in the lock hash, the one the
    # waiter read from its wake list.
    assert rs.hgetall(f"{PREFIX}lock:R") == {waiter.lease.token: f"x{waiter.lease.fencing_token}"}
    assert rs.hgetall(f"{PREFIX}held:{waiter_mgr.owner_id}") == {"R": ""}
    assert queue_len(rs, "R") == 0
    waiter.lease.release()
    assert rs.exists(f"{PREFIX}lock:R") == 0


def test_handoff_of_a_multi_resource_request_is_all_or_nothing(rs: redis.Redis, make: Any) -> None:
    # The waiter needs A and B; freeing A alone must not hand it A (a
    # partial grant) — only when B is free too does it get both at once.
    a_holder, b_holder, waiter_mgr = make(), make(), make()
    a = a_holder.acquire("A")
    b = b_holder.acquire(shared="B")
    waiter = ThreadWaiter(waiter_mgr, ["A", "B"], release=False)
    wait_until(lambda: queue_len(rs, "A") == 1 and queue_len(rs, "B") == 1, what="queued")
    a.release()
    assert rs.exists(f"{PREFIX}lock:A") == 0  # not handed over: B still held
    assert not waiter.granted.is_set()
    assert queue_len(rs, "A") == 1 and queue_len(rs, "B") == 1
    b.release()
    waiter.join()
    assert waiter.error is None
    _assert_holds_a_and_b(rs, waiter.lease)
    waiter.lease.release()


def test_releasing_two_locks_hands_both_to_the_waiter_for_both_and_not_b_to_the_next(
    rs: redis.Redis, make: Any
) -> None:
    # One release frees A and B, then serves their queues: the head of A's
    # queue wants A and B and is handed both; B's queue must then be served
    # against B's new holder, not against the count of holders read before
    # the hand-off (which would hand B to the waiter for B alone too).
    holder, both_mgr, b_mgr = make(), make(), make()
    lease = holder.acquire(["A", "B"])
    both = ThreadWaiter(both_mgr, ["A", "B"], release=False)
    wait_until(lambda: queue_len(rs, "A") == 1, what="waiter for A and B queued")
    b_only = ThreadWaiter(b_mgr, "B", release=False)
    wait_until(lambda: queue_len(rs, "B") == 2, what="waiter for B queued")
    lease.release()
    both.join()
    assert both.error is None
    _assert_holds_a_and_b(rs, both.lease)
    assert not b_only.granted.is_set()
    assert queue_len(rs, "B") == 1
    both.lease.release()
    b_only.join()
    assert b_only.error is None
    b_only.lease.release()


def test_shared_waiters_behind_a_writer_are_all_handed_the_lock_together(
    rs: redis.Redis, make: Any
) -> None:
    writer_mgr = make()
    w = writer_mgr.acquire("R")
    readers = []
    for i in range(3):
        readers.append(ThreadWaiter(make(), shared="R", release=False, name=f"r{i}"))
        wait_until(lambda i=i: queue_len(rs, "R") == i + 1, what=f"reader {i} queued")
    w.release()
    for r in readers:
        r.join()
        assert r.error is None
    holders = rs.hgetall(f"{PREFIX}lock:R")
    assert holders == {r.lease.token: f"s{r.lease.fencing_token}" for r in readers}
    for r in readers:
        r.lease.release()


def test_a_waiter_that_missed_the_handoff_push_gets_the_same_grant_when_it_asks_again(
    rs: redis.Redis, make: Any
) -> None:
    # A waiter whose BLPOP timed out (or whose connection dropped) just as
    # the release handed it the lock runs its acquire script again: it must
    # get the grant it already has, with its fence, not a second one.
    holder, waiter_mgr = make(), make()
    lease = holder.acquire("R")
    req = waiter_mgr.request("R", None)
    ident = waiter_mgr.liveness.identity.current()
    token = f"{ident.owner_id}|missed-the-push"
    assert int(waiter_mgr.acquirer.attempt(ident, token, req, True, False)[0]) == 0  # queued
    ident.registered = True

    lease.release()  # hands R over; nobody pops the push
    fence = int(rs.get(f"{PREFIX}fence"))
    assert rs.lrange(f"{PREFIX}wake:{token}", 0, -1) == [f"g{fence}"]
    again = waiter_mgr.acquirer.attempt(ident, token, req, True, False)

    assert int(again[0]) == 1 and int(again[1]) == fence
    assert int(rs.get(f"{PREFIX}fence")) == fence  # no second grant
    assert rs.hgetall(f"{PREFIX}lock:R") == {token: f"x{fence}"}
    assert queue_len(rs, "R") == 0
    # Its release frees the lock and the unread push with it.
    waiter_mgr.releaser.run_release(ident.owner_id, token, req, lease=True)
    assert rs.exists(f"{PREFIX}lock:R", f"{PREFIX}wake:{token}", f"{PREFIX}req:{token}") == 0


@pytest.mark.parametrize("freed_by", ["next acquirer", "cleanup_owner"])
def test_a_handed_over_grant_whose_waiter_died_leaves_no_unread_push_behind(
    rs: redis.Redis, make: Any, freed_by: str
) -> None:
    # The grant push has no TTL (a blocked waiter pops it at once): whoever
    # frees the grant of a waiter that died before popping it deletes it.
    holder, waiter_mgr, other = make(), make(), make()
    lease = holder.acquire("R")
    req = waiter_mgr.request("R", None)
    ident = waiter_mgr.liveness.identity.current()
    token = f"{ident.owner_id}|died-before-popping"
    assert int(waiter_mgr.acquirer.attempt(ident, token, req, True, False)[0]) == 0
    lease.release()  # handed over; the waiter never pops it
    assert rs.llen(f"{PREFIX}wake:{token}") == 1
    rs.delete(f"{PREFIX}alive:{ident.owner_id}")  # the waiter's process died

    if freed_by == "next acquirer":
        other.acquire("R", timeout=0).release()  # reclaims the dead grant
    else:
        other.cleanup_owner(ident.owner_id)

    assert rs.exists(f"{PREFIX}wake:{token}", f"{PREFIX}req:{token}") == 0
    assert rs.exists(f"{PREFIX}lock:R") == 0
