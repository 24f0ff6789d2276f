"""Deferred tasks on the engine side (docs/defer.md), against a real redis-server.

No Celery worker here: the park record, the hand-off to a parked request
(dispatch list, not a wake list), adoption, withdrawal, the upkeep's
recovery of a dead dispatcher's list and the re-parking of a grant nobody
adopted. tests/e2e/test_defer_e2e.py runs the same path with real workers.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_redislock import Lease, LockManager
from celery_redislock.engine.identity import new_request_id
from celery_redislock.engine.manager import RequestMoved
from celery_redislock.ops.inspector import Inspector
from celery_redislock.worker import defer
from celery_redislock.worker.defer import Dispatcher, adopt, mark_done, park, park_limit, withdraw
from engine_helpers import Managers, namespace_keys, queue_requests, wait_until

NS = "t"
P = "{t}:"


@pytest.fixture
def managers(redis_url: str) -> Iterator[Managers]:
    m = Managers(redis_url, namespace=NS)
    yield m
    m.close_all()


@pytest.fixture
def rs(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def _park(
    mgr: LockManager, task_id: str, *res: str, grant_ttl: float = 60.0, park_ttl: float = 600
) -> str:
    req = mgr.request(list(res), [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}, "resources": list(res)}
    result = park(mgr, task_id, req, message, park_ttl=park_ttl, grant_ttl=grant_ttl)
    return result.outcome


class _Sent:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str | None]] = []

    def __call__(self, task_id: str, message: dict[str, Any], header: str | None) -> None:
        self.sent.append((task_id, header))


def _dispatcher(mgr: LockManager, inc: str = "inc1") -> tuple[Dispatcher, _Sent]:
    sent = _Sent()
    return Dispatcher(mgr, inc, publish=sent, on_withdrawn=lambda *a: None), sent


def _recording_dispatcher(
    mgr: LockManager, revoked: set[str] | None = None, *, revoked_ids: bool = True
) -> tuple[Dispatcher, _Sent, list[tuple[str, str]]]:
    """A dispatcher (``inc1``) that records what it publishes and what it
    withdraws (task id, why); ``revoked``: the revoked set it looks at (and
    lists, unless ``revoked_ids`` is false)."""
    sent = _Sent()
    withdrawn: list[tuple[str, str]] = []
    kwargs: dict[str, Any] = {}
    if revoked is not None:
        kwargs["revoked"] = revoked.__contains__
        if revoked_ids:
            kwargs["revoked_ids"] = lambda: sorted(revoked)
    dispatcher = Dispatcher(
        mgr,
        "inc1",
        publish=sent,
        on_withdrawn=lambda tid, why, msg: withdrawn.append((tid, why)),
        **kwargs,
    )
    return dispatcher, sent, withdrawn


def _holding(managers: Managers, res: str) -> tuple[LockManager, Lease]:
    """A new manager and the exclusive lease it holds on ``res``."""
    mgr = managers()
    return mgr, mgr.acquire(res)


def _grant(mgr: LockManager, rs: redis.Redis, task_id: str = "t1", res: str = "a") -> str | None:
    """Park ``task_id`` behind a holder that then releases; the grant's fence."""
    holder = mgr.acquire(res)
    _park(mgr, task_id, res)
    holder.release()
    return rs.hget(f"{P}defer:{task_id}", "fence")


def test_release_hands_a_parked_request_its_locks_and_pushes_the_task_id_to_dispatch(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    assert _park(mgr, "t1", "a", grant_ttl=60) == "parked"
    entries = rs.zrange(f"{P}q:a", 0, -1)
    assert entries == ["xdefer:t1|task:t1"]
    assert rs.hget(f"{P}defer:t1", "state") == "parked"

    holder.release()
    token = entries[0][1:]
    assert rs.hget(f"{P}lock:a", token) is not None
    assert rs.lrange(f"{P}dispatch", 0, -1) == ["t1"]
    assert not rs.exists(f"{P}wake:{token}")
    record = rs.hgetall(f"{P}defer:t1")
    assert record["state"] == "granted" and rs.hget(f"{P}lock:a", token) == "x" + record["fence"]
    assert 0 < rs.pttl(f"{P}alive:defer:t1") <= 60_000


def test_adopt_moves_the_grant_to_the_adopting_owner_with_its_fence_once(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    fence = int(_grant(mgr, rs) or 0)

    assert adopt(child, "t1", 1) == ("expired", [])  # another life's copy: nothing
    outcome, leases = adopt(child, "t1", 0)
    assert outcome == "adopted" and len(leases) == 1
    lease = leases[0]
    assert lease.fencing_token == fence and lease.owner_id == child.owner_id
    assert rs.hgetall(f"{P}lock:a") == {lease.token: f"x{fence}"}
    assert rs.hget(f"{P}defer:t1", "state") == "adopted"
    assert rs.hget(f"{P}defer:t1", "owner") == child.owner_id
    assert rs.zcard(f"{P}deferred") == 0 and rs.zcard(f"{P}deadlines") == 0
    # A second copy of the message: adopted already (by a live owner).
    assert adopt(managers(), "t1", 0) == ("adopted-elsewhere", [])
    assert _park(managers(), "t1", "a") == "duplicate"

    lease.release()
    mark_done(child, "t1", child.owner_id)
    assert rs.hget(f"{P}defer:t1", "state") == "done"
    assert _park(managers(), "t1", "a") == "duplicate"
    assert not rs.exists(f"{P}lock:a")


def test_parked_requests_keep_their_fifo_place_among_waiting_threads(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, waiter_mgr = managers(), managers()
    holder = mgr.acquire("a")
    assert _park(mgr, "t1", "a") == "parked"
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter_mgr.acquire("a", timeout=30)))
    thread.start()
    wait_until(lambda: rs.zcard(f"{P}q:a") == 2, what="thread queued")
    assert _park(mgr, "t2", "a") == "parked"

    holder.release()
    assert rs.hget(f"{P}defer:t1", "state") == "granted" and not got
    _, first = adopt(managers(), "t1", 0)
    assert len(first) == 1
    first[0].release()
    # Handed to the waiting thread by the release itself (not by its next try).
    assert [t.split("|")[0] for t in rs.hkeys(f"{P}lock:a")] == [waiter_mgr.owner_id]
    thread.join(20)
    assert got and rs.hget(f"{P}defer:t2", "state") == "parked"
    got[0].release()
    assert rs.hget(f"{P}defer:t2", "state") == "granted"
    assert rs.lrange(f"{P}dispatch", 0, -1) == ["t2", "t1"]


def test_dispatcher_publishes_each_grant_once_with_its_fence(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr = managers()
    fence = int(_grant(mgr, rs) or 0)
    rs.lpush(f"{P}dispatch", "t1")  # a second push of the same id
    dispatcher, sent = _dispatcher(mgr)
    dispatcher.step()
    dispatcher.step()
    assert sent.sent == [("t1", f"0:{fence}")]
    assert rs.llen(f"{P}dispatch") == 0 and rs.llen(dispatcher.dispatching_key) == 0


def test_a_dead_dispatchers_in_progress_list_is_moved_back_to_dispatch(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr = managers()
    rs.rpush(f"{P}dispatching:dead", "x1", "x2")
    rs.sadd(f"{P}dispatchers", "dead")  # its liveness key {t}:dispatcher:dead is gone
    rs.set(f"{P}dispatcher:live", "1", px=60_000)
    rs.sadd(f"{P}dispatchers", "live")
    rs.rpush(f"{P}dispatching:live", "y1")
    dispatcher, _ = _dispatcher(mgr, "inc2")
    dispatcher.upkeep()
    assert sorted(rs.lrange(f"{P}dispatch", 0, -1)) == ["x1", "x2"]
    assert not rs.exists(f"{P}dispatching:dead")
    assert rs.smembers(f"{P}dispatchers") == {"live", "inc2"}
    assert rs.lrange(f"{P}dispatching:live", 0, -1) == ["y1"]


def test_a_grant_nobody_adopts_is_handed_on_and_the_task_parked_again_behind(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, waiter_mgr = managers(), managers()
    holder = mgr.acquire("a")
    _park(mgr, "t1", "a", grant_ttl=0.3)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter_mgr.acquire("a", timeout=30)))
    thread.start()
    wait_until(lambda: rs.zcard(f"{P}q:a") == 2, what="thread queued")
    holder.release()
    old_token = rs.hget(f"{P}defer:t1", "token")
    wait_until(lambda: not rs.exists(f"{P}alive:defer:t1"), what="grant TTL ran out")
    dispatcher, sent = _dispatcher(mgr)
    dispatcher.due("t1")
    # The withdrawal handed the lock to the waiter behind (not its own next try).
    assert [t.split("|")[0] for t in rs.hkeys(f"{P}lock:a")] == [waiter_mgr.owner_id]
    thread.join(20)
    assert got, "the waiter behind was not handed the lock"
    record = rs.hgetall(f"{P}defer:t1")
    assert record["state"] == "parked" and record["life"] == "1"
    assert record["token"] == "defer+1:t1|task:t1" != old_token
    assert rs.zrange(f"{P}q:a", 0, -1) == ["x" + record["token"]]
    got[0].release()
    assert rs.hget(f"{P}defer:t1", "state") == "granted"


def test_withdrawing_a_parked_task_leaves_nothing_of_it(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr = managers()
    holder = mgr.acquire(["a", "b"])
    before = namespace_keys(rs)
    _park(mgr, "t1", "a", "b")
    assert withdraw(mgr, "t1")[0] == "parked"
    # Only the arrival counter is new (a contended stream exists only while a
    # holder watches for contenders).
    assert namespace_keys(rs) - before == {f"{P}seq"}
    assert rs.zcard(f"{P}deferred") == 0 and not rs.exists(f"{P}q:a", f"{P}q:b")
    assert withdraw(mgr, "t1") == ["none"]
    holder.release()


def test_a_task_parked_past_its_park_ttl_is_withdrawn_and_reported_expired(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    assert _park(mgr, "t1", "a", park_ttl=0.3) == "parked"
    dispatcher, _, withdrawn = _recording_dispatcher(mgr)
    wait_until(lambda: not rs.exists(f"{P}alive:defer:t1"), what="park TTL ran out")
    dispatcher.upkeep()  # the first pass after the deadline withdraws it
    assert withdrawn == [("t1", "expired")]
    assert not rs.exists(f"{P}defer:t1") and rs.zcard(f"{P}q:a") == 0
    holder.release()


def test_a_revoked_parked_task_is_withdrawn_by_the_next_upkeep(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    for task_id in ("t1", "t2"):
        _park(mgr, task_id, "a")
    revoked: set[str] = set()
    dispatcher, _, withdrawn = _recording_dispatcher(mgr, revoked)
    revoked.add("t1")
    dispatcher.upkeep()
    assert withdrawn == [("t1", "revoked")]
    assert [m.split("|")[0] for m in rs.zrange(f"{P}q:a", 0, -1)] == ["xdefer:t2"]
    holder.release()  # goes to t2, the revoked t1 is not in line
    assert rs.hget(f"{P}defer:t2", "state") == "granted"


def test_a_grant_whose_message_expired_is_withdrawn_not_published(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, waiter_mgr = managers(), managers()
    holder = mgr.acquire("a")
    req = mgr.request(["a"], [])
    past = "2000-01-01T00:00:00+00:00"
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {"expires": past}}
    assert park(mgr, "t1", req, message, park_ttl=60, grant_ttl=60).outcome == "parked"
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(waiter_mgr.acquire("a", timeout=30)))
    thread.start()
    wait_until(lambda: rs.zcard(f"{P}q:a") == 2, what="thread queued")
    holder.release()  # handed to t1, whose message has expired
    dispatcher, sent, withdrawn = _recording_dispatcher(mgr)
    dispatcher.step()
    assert [t.split("|")[0] for t in rs.hkeys(f"{P}lock:a")] == [waiter_mgr.owner_id]
    thread.join(20)
    assert sent.sent == [] and withdrawn == [("t1", "expired-message")]
    assert got, "the lock went on to the waiter behind"
    got[0].release()


def _task_of(mgr: LockManager, resource: str) -> tuple[str | None, str | None, str | None]:
    """(task name, task id, node) of the one holder of ``resource``, as the
    operator sees it (``redislock locks``)."""
    (holder,) = Inspector(mgr).locks([resource])[0].holders
    return holder.task_name, holder.task_id, holder.node


def test_a_parked_task_carries_its_holder_record_through_hand_off_dispatch_and_adopt(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    first = "t.task\nt1\ncelery@parker"
    req = mgr.request(["a", "b"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    holder = mgr.acquire("a")
    assert park(mgr, "t1", req, message, park_ttl=600, grant_ttl=60, holder=first).outcome == (
        "parked"
    )
    token = "defer:t1|task:t1"
    # The queued request carries the record (naming its request id).
    assert rs.hget(f"{P}req:{token}", "holder") == "task:t1\n" + first
    # The release hands the grant over (try_handoff): the record follows it,
    # into the task owner's registry, for both resources.
    holder.release()
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    assert _task_of(mgr, "a") == _task_of(mgr, "b") == ("t.task", "t1", "celery@parker")
    # The adopting process records itself (its node) with its new token.
    second = "t.task\nt1\ncelery@runner"
    outcome, leases = adopt(child, "t1", 0, holder=second)
    assert outcome == "adopted" and len(leases) == 1
    assert _task_of(mgr, "a") == _task_of(mgr, "b") == ("t.task", "t1", "celery@runner")
    assert rs.hgetall(f"{P}held:{child.owner_id}") == {
        "a": "task:t1\n" + second,
        "b": "task:t1\n" + second,
    }
    assert not rs.exists(f"{P}held:defer:t1")
    leases[0].release()
    assert not rs.exists(f"{P}held:{child.owner_id}")
    assert not rs.keys(f"{P}holder:*")


def test_an_adopted_grant_without_new_holder_info_keeps_the_task_owners_record(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    info = "t.task\nt1\ncelery@parker"
    holder = mgr.acquire("a")
    req = mgr.request(["a"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    park(mgr, "t1", req, message, park_ttl=600, grant_ttl=60, holder=info)
    holder.release()
    outcome, leases = adopt(child, "t1", 0)
    assert outcome == "adopted"
    assert _task_of(mgr, "a") == ("t.task", "t1", "celery@parker")
    leases[0].release()


def test_the_dispatcher_granting_a_parked_task_writes_its_holder_record(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr = managers()
    req = mgr.request(["a"], [])
    info = "t.task\nt1\ncelery@parker"
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    holder = mgr.acquire("a")
    assert park(mgr, "t1", req, message, park_ttl=600, grant_ttl=60, holder=info).outcome == (
        "parked"
    )
    # The holder leaves without a hand-off (its grant reclaimed as a dead
    # owner's would be): the dispatcher's own attempt grants the request.
    rs.hdel(f"{P}lock:a", holder.token)
    dispatcher, _ = _dispatcher(mgr)
    dispatcher._attempt("t1", "defer:t1|task:t1", "x", "a", 600_000, info)
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    assert _task_of(mgr, "a") == ("t.task", "t1", "celery@parker")


def test_a_withdrawn_grant_leaves_no_holder_record(managers: Managers, rs: redis.Redis) -> None:
    mgr = managers()
    req = mgr.request(["a"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    holder = mgr.acquire("a")
    park(mgr, "t1", req, message, park_ttl=600, grant_ttl=60, holder="t.task\nt1\nnode")
    holder.release()
    assert _task_of(mgr, "a") == ("t.task", "t1", "node")
    assert withdraw(mgr, "t1")[0] == "granted"
    assert not rs.exists(f"{P}held:defer:t1")
    assert not rs.keys(f"{P}holder:*")
    assert not rs.exists(f"{P}lock:a")


def test_a_body_running_adopted_grants_re_enters_them(managers: Managers, rs: redis.Redis) -> None:
    mgr, child = managers(), managers()
    holder = mgr.acquire("a")
    _park(mgr, "t1", "a")
    holder.release()
    outcome, leases = adopt(child, "t1", 0)
    assert outcome == "adopted"
    child.hold_in_thread(leases)
    # @locked runs the adopted body in this thread: a nested acquire of the
    # same resource re-enters the adopted grant (same fence), never queues
    # behind it.
    inner = child.acquire("a", timeout=0)
    assert inner.fencing_token == leases[0].fencing_token
    inner.release()
    assert rs.hget(f"{P}lock:a", leases[0].token) is not None
    leases[0].release()
    assert not rs.exists(f"{P}lock:a")


def _granted(mgr: LockManager, rs: redis.Redis, task_id: str = "t1", res: str = "a") -> int:
    """Park ``task_id`` behind a holder and release: its grant is in transit."""
    holder = mgr.acquire(res)
    assert _park(mgr, task_id, res) == "parked"
    holder.release()
    assert rs.hget(f"{P}defer:{task_id}", "state") == "granted"
    return int(rs.hget(f"{P}defer:{task_id}", "fence") or 0)


def _adopted(mgr: LockManager, child: LockManager, rs: redis.Redis) -> list[Lease]:
    """t1 granted (:func:`_granted`) and adopted by ``child``: its leases."""
    _granted(mgr, rs)
    return adopt(child, "t1", 0)[1]


def test_an_upkeep_landing_right_after_the_adoption_finds_the_task_adopted_not_due_again(
    managers: Managers, rs: redis.Redis
) -> None:
    # The adoption lands at the grant deadline: the upkeep looks at the task
    # (due: its grant TTL ran out) right after the engine moved the grant,
    # its task owner's liveness gone. The record must already say adopted,
    # or the upkeep parks the task again and the body runs twice.
    mgr, child = managers(), managers()
    fence = _granted(mgr, rs)
    dispatcher, sent = _dispatcher(mgr)
    engine_adopt = child.adopt
    looked: list[str | None] = []

    def adopt_then_upkeep(*args: Any, **kwargs: Any) -> Any:
        adoption = engine_adopt(*args, **kwargs)
        assert not rs.exists(f"{P}alive:defer:t1")  # the task owner is retired
        dispatcher.due("t1")
        looked.append(rs.hget(f"{P}defer:t1", "state"))
        return adoption

    child.adopt = adopt_then_upkeep  # type: ignore[method-assign]
    outcome, leases = adopt(child, "t1", 0)
    assert looked == ["adopted"]
    # The body runs (a lease with the grant's fence) and nothing else of the
    # task is in line: no second life, no second dispatch.
    assert outcome == "adopted" and [x.fencing_token for x in leases] == [fence]
    record = rs.hgetall(f"{P}defer:t1")
    assert (record["state"], record["life"], record["owner"]) == ("adopted", "0", child.owner_id)
    assert rs.zcard(f"{P}q:a") == 0 and rs.zscore(f"{P}deferred", "t1") is None
    assert rs.hgetall(f"{P}lock:a") == {leases[0].token: f"x{fence}"}
    leases[0].release()
    mark_done(child, "t1", child.owner_id)
    assert not rs.exists(f"{P}lock:a") and rs.hget(f"{P}defer:t1", "state") == "done"
    # The dispatch list still has the id of the hand-off: nothing to publish.
    dispatcher.step()
    assert sent.sent == [] and rs.hget(f"{P}defer:t1", "state") == "done"


def test_an_upkeep_before_the_adoption_parks_the_task_again_and_the_late_copy_is_a_duplicate(
    managers: Managers, rs: redis.Redis
) -> None:
    # The other order: the grant deadline passes first (the task owner's
    # liveness ran out), the upkeep hands the lock on and parks the task
    # again; the copy that arrives late adopts nothing and is dropped.
    mgr, child = managers(), managers()
    _granted(mgr, rs)
    rs.pexpire(f"{P}alive:defer:t1", 1)
    wait_until(lambda: not rs.exists(f"{P}alive:defer:t1"), what="the grant TTL to run out")
    dispatcher, _ = _dispatcher(mgr)
    dispatcher.due("t1")
    assert rs.hget(f"{P}defer:t1", "life") == "1"
    assert adopt(child, "t1", 0) == ("expired", [])
    assert _park(child, "t1", "a") == "duplicate"
    assert rs.hget(f"{P}defer:t1", "state") == "granted"  # the new life has the lock
    assert not rs.exists(f"{P}held:{child.owner_id}")


def test_an_adoption_the_park_record_does_not_name_moves_nothing_and_runs_no_body(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    fence = _granted(mgr, rs)
    token = "defer:t1|task:t1"
    # The record names another life's request: the grant stays in transit.
    rs.hset(f"{P}defer:t1", "token", "defer+1:t1|task:t1")
    assert adopt(child, "t1", 0) == ("superseded", [])
    assert rs.hgetall(f"{P}lock:a") == {token: f"x{fence}"}
    assert rs.exists(f"{P}alive:defer:t1") and not rs.exists(f"{P}adopted:defer:t1")
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    assert not rs.exists(f"{P}held:{child.owner_id}")
    # Nor one that is no longer waiting for a grant (done, or gone).
    rs.hset(f"{P}defer:t1", mapping={"token": token, "state": "done"})
    assert adopt(child, "t1", 0) == ("superseded", [])
    rs.delete(f"{P}defer:t1")
    assert adopt(child, "t1", 0) == ("superseded", [])
    assert rs.hgetall(f"{P}lock:a") == {token: f"x{fence}"}
    # The engine's adopt without a park record (a UniqueTask's key) is not
    # held back by it.
    adoption = child.adopt("t1", 0, owner="defer:t1")
    assert adoption.status == "adopted" and adoption.leases[0].fencing_token == fence
    adoption.leases[0].release()


def test_adopting_again_after_a_lost_reply_returns_the_same_grant(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    fence = _granted(mgr, rs)
    outcome, leases = adopt(child, "t1", 0)
    assert outcome == "adopted"
    again = child.adopt("t1", 0, park_record_ttl=60.0, owner="defer:t1")
    assert again.status == "adopted"
    assert [x.token for x in again.leases] == [leases[0].token]
    assert again.leases[0].fencing_token == fence


def _park_attempt(mgr: LockManager, task_id: str, retries: int, *res: str) -> str:
    """Park ``task_id``'s message of retry number ``retries`` (Celery's request.retries)."""
    req = mgr.request(list(res), [])
    options = {"retries": retries} if retries else {}
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": options}
    return park(mgr, task_id, req, message, park_ttl=600, grant_ttl=60).outcome


def test_a_retry_sent_by_the_adopted_run_parks_as_a_new_life_and_stale_copies_stay_duplicates(
    managers: Managers, rs: redis.Redis
) -> None:
    """Celery's self.retry() sends the same task id again with retries + 1:
    a new life of the task, whether its record is still 'adopted' (the body
    is ending) or already 'done'. A copy of an attempt that ran (or of an
    older one) is still a duplicate."""
    mgr, child = managers(), managers()
    holder = mgr.acquire("a")
    assert _park_attempt(mgr, "t1", 0, "a") == "parked"
    holder.release()
    outcome, [lease] = adopt(child, "t1", 0)
    assert rs.hget(f"{P}defer:t1", "state") == "adopted"
    # The body runs and retries while it still holds the lock: the retry parks.
    assert _park_attempt(managers(), "t1", 0, "a") == "duplicate"  # a stale copy
    assert _park_attempt(managers(), "t1", 1, "a") == "parked"
    record = rs.hgetall(f"{P}defer:t1")
    assert (record["state"], record["life"], record["retries"]) == ("parked", "1", "1")
    assert record["token"] == "defer+1:t1|task:t1"
    assert _park_attempt(managers(), "t1", 1, "a") == "duplicate"  # a copy of the retry
    assert _park_attempt(managers(), "t1", 0, "a") == "duplicate"
    # The first run's end leaves the new life alone and hands it the lock.
    lease.release()
    mark_done(child, "t1", child.owner_id)
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    runner = managers()
    outcome, [second] = adopt(runner, "t1", 1)
    second.release()
    mark_done(runner, "t1", runner.owner_id)
    assert rs.hget(f"{P}defer:t1", "state") == "done"
    # A 'done' record: the next retry is a new life, a copy of attempt 1 is not.
    blocker = mgr.acquire("a")
    assert _park_attempt(managers(), "t1", 1, "a") == "duplicate"
    assert _park_attempt(managers(), "t1", 2, "a") == "parked"
    assert rs.hget(f"{P}defer:t1", "life") == "2"
    withdraw(mgr, "t1")
    blocker.release()


def test_a_record_an_earlier_release_wrote_counts_as_attempt_zero(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    rs.hset(f"{P}defer:t1", mapping={"state": "done", "life": "0", "owner": "gone"})
    # Attempt 0 is the earlier release's; attempt 1 is a new life.
    assert [_park_attempt(mgr, "t1", n, "a") for n in (0, 1)] == ["duplicate", "parked"]
    assert rs.hgetall(f"{P}defer:t1")["life"] == "1"
    withdraw(mgr, "t1")
    holder.release()


def test_a_unique_key_adopted_for_the_task_does_not_hide_its_deferred_grant(
    managers: Managers, rs: redis.Redis
) -> None:
    """A task both unique and deferred: its unique key's task owner
    (task:<id>) is adopted when it first runs; its park record's task owner
    has a name of its own, so the re-dispatched copy adopts its grant."""
    mgr, first_child, second_child = managers(), managers(), managers()
    assert mgr.acquire_for_task("t1", "unique:k", ttl=60).granted
    assert first_child.adopt("t1").adopted  # the unique key, at the first run
    holder = mgr.acquire("a")
    assert _park(first_child, "t1", "a") == "parked"
    holder.release()
    outcome, leases = adopt(second_child, "t1", 0)
    assert outcome == "adopted" and [x.resources for x in leases] == [("a",)]
    assert rs.hkeys(f"{P}lock:a") == [f"{second_child.owner_id}|task:t1"]
    assert rs.hget(f"{P}adopted:defer:t1", "by") == second_child.owner_id
    assert rs.hget(f"{P}defer:t1", "state") == "adopted"
    leases[0].release()


def test_a_done_record_whose_adopter_exited_still_drops_a_stale_copy(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    leases = _adopted(mgr, child, rs)
    leases[0].release()
    mark_done(child, "t1", child.owner_id)
    owner = child.owner_id
    child.close()
    assert not rs.exists(f"{P}alive:{owner}")  # the adopter has exited
    # A stale copy of the message (a broker redelivery): never granted again.
    assert _park(managers(), "t1", "a") == "duplicate"
    assert rs.hget(f"{P}defer:t1", "state") == "done"
    assert rs.zcard(f"{P}q:a") == 0 and not rs.exists(f"{P}lock:a")


def test_mark_done_by_an_owner_that_did_not_adopt_leaves_the_record_alone(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, child = managers(), managers()
    leases = _adopted(mgr, child, rs)
    before = rs.hgetall(f"{P}defer:t1")
    mark_done(mgr, "t1", mgr.owner_id)
    assert rs.hgetall(f"{P}defer:t1") == before and before["state"] == "adopted"
    leases[0].release()
    mark_done(child, "t1", child.owner_id)
    assert rs.hget(f"{P}defer:t1", "state") == "done"


def test_a_copy_finding_its_adopter_a_dead_process_of_its_worker_frees_it_and_runs_again(
    managers: Managers, rs: redis.Redis
) -> None:
    # D8: the child that adopted the grant was killed (mid-body, or after
    # its body and before its result was stored), and the redelivered copy
    # reaches a sibling before the node's tick has freed the dead child: its
    # liveness is still there. The copy frees it (a process of its own
    # worker's group that no longer runs) and is parked as a new life,
    # instead of being dropped while the adopter looks alive.
    from celery_redislock.engine.identity import process_tag
    from celery_redislock.worker.node import group_key

    group = group_key(P, "inc1")
    mgr = managers()
    child, sibling = managers(group=lambda: group), managers(group=lambda: group)
    _granted(mgr, rs)
    assert adopt(child, "t1", 0)[0] == "adopted"
    assert rs.hexists(group, child.owner_id) and rs.exists(f"{P}alive:{child.owner_id}")
    # The adopting child's process is gone: its group entry names a process
    # that no longer runs (this pid with another start time).
    tag = process_tag(os.getpid())
    pid, start = tag.split(".")
    rs.hset(group, child.owner_id, f"{pid}.{int(start) - 1}")

    assert adopt(sibling, "t1", 0) == ("adopted-elsewhere", [])
    assert not rs.exists(f"{P}alive:{child.owner_id}")  # freed, as the node would
    assert _park(sibling, "t1", "a") == "granted"  # the lock is free: a new life
    assert rs.hgetall(f"{P}defer:t1")["state"] == "adopted"
    assert rs.hget(f"{P}defer:t1", "owner") == sibling.owner_id
    assert rs.hget(f"{P}defer:t1", "life") == "1"
    # A copy meeting a live adopter of its worker frees nothing: a duplicate.
    late = managers(group=lambda: group)
    assert adopt(late, "t1", 1) == ("adopted-elsewhere", [])
    assert rs.exists(f"{P}alive:{sibling.owner_id}")
    assert _park(late, "t1", "a") == "duplicate"


# -- through @locked's task path (Celery's in-process test worker) ----------


@pytest.fixture
def deferring(redis_url: str) -> Iterator[tuple[Any, Any]]:
    """An app with a ``@locked(on_busy="defer")`` task on the namespace of
    :data:`NS`; yields ``(task, locks)``. The tests run it in Celery's
    in-process worker (threads pool, the RedisLock bootstep and its
    dispatcher), which parks, dispatches and adopts as a prefork worker does."""
    from celery_helpers import close_app, quick_app
    from celery_redislock import RedisLock, current_lease, locked

    app = quick_app(redis_url, "defer-engine", NS)
    locks = RedisLock(app)

    @app.task(bind=True, name="de.reenter", shared=False)
    @locked("res:{tag}", on_busy="defer")
    def reenter(self: Any, tag: str) -> dict[str, Any]:
        outer = current_lease()
        # timeout=0: a nested acquire re-enters at once; one that is not
        # counted as held by this thread queues behind the task's own
        # grant and is refused at once (LockTimeout), never by a time-out.
        inner = locks.manager.acquire(f"res:{tag}", timeout=0)
        try:
            return {
                "outer": outer.fencing_token if outer else None,
                "inner": inner.fencing_token,
                "inner_token": inner.token,
                "outer_token": outer.token if outer else None,
                "header": getattr(self.request, "redislock_defer", None),
            }
        finally:
            inner.release()

    try:
        yield reenter, locks
    finally:
        close_app(app)


def test_an_adopted_deferred_body_re_enters_its_own_lock_through_the_task_path(
    deferring: tuple[Any, Any], managers: Managers, rs: redis.Redis
) -> None:
    from celery.contrib.testing.worker import start_worker

    task, locks = deferring
    holder = managers().acquire("res:x")
    with start_worker(task.app, pool="threads", concurrency=1, perform_ping_check=False):
        result = task.apply_async(("x",), task_id="d1")
        wait_until(lambda: result.state == "DEFERRED", what="the task to park")
        holder.release()  # handed to the parked request, dispatched, adopted
        out = result.get(timeout=30)
    fence = int(rs.hget(f"{P}defer:d1", "fence") or 0)
    assert out["header"] == f"0:{fence}"  # the run was the adopting copy
    assert out["outer"] == out["inner"] == fence
    assert out["inner_token"] == out["outer_token"]  # the same grant, re-entered
    assert rs.hget(f"{P}defer:d1", "state") == "done"
    assert not rs.exists(f"{P}lock:res:x")


# -- the upkeep: deadlines on time whatever the backlog ---------------------

BACKLOG = 2000


def _park_backlog(mgr: LockManager, rs: redis.Redis, count: int, resource: str) -> list[str]:
    """``count`` tasks parked on ``resource`` (held by a live holder), each with
    its re-attempt due at once (score 0): the load a fleet of parked tasks
    behind long holders puts on the upkeep, every owner_ttl."""
    ids = [f"b{i}" for i in range(count)]
    for task_id in ids:
        assert _park(mgr, task_id, resource) == "parked"
    rs.zadd(f"{P}deferred", dict.fromkeys(ids, 0), xx=True)
    return ids


def test_a_passed_park_deadline_is_withdrawn_by_the_next_upkeep_pass_whatever_the_backlog(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    _park_backlog(mgr, rs, BACKLOG, "a")
    assert _park(mgr, "late", "a", park_ttl=0.2) == "parked"
    wait_until(lambda: not rs.exists(f"{P}alive:defer:late"), what="park TTL ran out")
    assert rs.zcount(f"{P}deferred", "-inf", 0) == BACKLOG  # all due, ahead of it
    dispatcher, _, withdrawn = _recording_dispatcher(mgr)
    more = dispatcher.upkeep()
    # One pass withdrew it, in its own script: record, queue entry, schedules.
    assert withdrawn == [("late", "expired")]
    assert not rs.exists(f"{P}defer:late") and rs.zscore(f"{P}deadlines", "late") is None
    assert rs.zscore(f"{P}deferred", "late") is None
    assert "xdefer:late|task:late" not in rs.zrange(f"{P}q:a", 0, -1)
    assert rs.zcard(f"{P}q:a") == BACKLOG
    assert more is True  # the re-attempts left over go to the next passes, at once
    holder.release()


def test_a_withdrawn_grant_deadline_hands_the_lock_to_the_next_waiter_in_the_same_pass(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    _park(mgr, "t1", "a", grant_ttl=0.2)
    assert _park(mgr, "t2", "a") == "parked"
    holder.release()  # t1 is granted; nobody adopts it
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    wait_until(lambda: not rs.exists(f"{P}alive:defer:t1"), what="grant TTL ran out")
    dispatcher, _ = _dispatcher(mgr)
    dispatcher.upkeep()
    # t1's grant went to t2 inside the upkeep's script; t1 is parked behind.
    assert rs.hget(f"{P}defer:t2", "state") == "granted"
    assert list(rs.hgetall(f"{P}lock:a")) == ["defer:t2|task:t2"]
    record = rs.hgetall(f"{P}defer:t1")
    assert record["state"] == "parked" and record["life"] == "1"
    assert rs.zrange(f"{P}q:a", 0, -1) == ["x" + record["token"]]


def test_an_upkeep_that_leaves_due_entries_is_followed_by_another_pass_at_once(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    count = 300  # several passes of DUE_BATCH re-attempts
    _park_backlog(mgr, rs, count, "a")
    dispatcher, _ = _dispatcher(mgr)
    dispatcher.interval = 3600.0  # one interval would outlast the test
    dispatcher.manager.options = dataclasses.replace(dispatcher.manager.options, block_cap=0.05)
    passes: list[bool] = []
    upkeep = dispatcher.upkeep
    dispatcher.upkeep = lambda: passes.append(upkeep()) or passes[-1]  # type: ignore[method-assign]
    for _ in range(count // 64 + 2):
        dispatcher.step()
    # Every step ran a pass until nothing due was left, none waited an interval.
    assert passes == [True] * (count // 64) + [False]
    now_ms = int(rs.time()[0]) * 1000
    assert rs.zcount(f"{P}deferred", "-inf", now_ms) == 0
    holder.release()


# -- withdrawals hand the lock on at once; dispatch never publishes a dead grant


def _expires(seconds: float) -> str:
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    return at.isoformat()


def _granted_with_a_waiter_behind(
    managers: Managers, rs: redis.Redis, *, grant_ttl: float = 60.0, options: Any = None
) -> tuple[LockManager, str]:
    """t1 parked on ``a``, then a queued request (no thread behind it: only a
    hand-off can make it the holder), then the holder releases: t1 is granted.
    Returns the manager and the waiting request's token."""
    mgr, holder = _holding(managers, "a")
    req = mgr.request(["a"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": dict(options or {})}
    message.update(resources=["a"], modes="x")
    assert park(mgr, "t1", req, message, park_ttl=600, grant_ttl=grant_ttl).outcome == "parked"
    (waiter,) = queue_requests(managers(), 1, exclusive="a")
    holder.release()
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    assert rs.hkeys(f"{P}lock:a") == ["defer:t1|task:t1"]
    return mgr, waiter


def _handed_to(rs: redis.Redis, token: str) -> None:
    """``token`` holds ``a`` now, its grant pushed to its wake list (a hand-off,
    not a wake-up that leaves the waiter to its own next try)."""
    assert rs.hkeys(f"{P}lock:a") == [token]
    fence = rs.hget(f"{P}lock:a", token)
    assert fence is not None and rs.lrange(f"{P}wake:{token}", 0, -1) == ["g" + fence[1:]]
    assert rs.zcard(f"{P}q:a") == 0 or rs.zrange(f"{P}q:a", 0, 0)[0].startswith("xdefer+1:t1|")


@pytest.mark.parametrize("why", ["revoked", "expired-message", "grant-ttl"])
def test_withdrawing_a_granted_task_hands_its_lock_to_the_next_waiter_in_the_same_script(
    managers: Managers, rs: redis.Redis, why: str
) -> None:
    options = {"expires": "2000-01-01T00:00:00+00:00"} if why == "expired-message" else {}
    mgr, waiter = _granted_with_a_waiter_behind(
        managers, rs, grant_ttl=0.2 if why == "grant-ttl" else 60.0, options=options
    )
    revoked = {"t1"} if why == "revoked" else set()
    dispatcher, sent, withdrawn = _recording_dispatcher(mgr, revoked)
    if why == "grant-ttl":
        wait_until(lambda: not rs.exists(f"{P}alive:defer:t1"), what="grant TTL ran out")
        dispatcher.upkeep()  # the deadline: withdrawn in the upkeep's script
        assert rs.hget(f"{P}defer:t1", "state") == "parked"  # parked again, behind
    elif why == "revoked":
        dispatcher.upkeep()  # the revoke: withdrawn by the upkeep
        assert withdrawn == [("t1", "revoked")]
    else:
        dispatcher.step()  # the dispatch finds its message expired
        assert withdrawn == [("t1", "expired-message")]
    _handed_to(rs, waiter)
    assert sent.sent == []


def test_a_grant_revoked_before_its_dispatch_is_withdrawn_not_published(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, waiter = _granted_with_a_waiter_behind(managers, rs)
    # Revoked after the grant, after the last upkeep looked at the revoked
    # set: only the dispatch itself can see it.
    dispatcher, sent, withdrawn = _recording_dispatcher(mgr, {"t1"}, revoked_ids=False)
    assert rs.lrange(f"{P}dispatch", 0, -1) == ["t1"]
    dispatcher.step()
    assert sent.sent == [] and withdrawn == [("t1", "revoked")]
    assert not rs.exists(f"{P}defer:t1") and rs.llen(f"{P}dispatch") == 0
    _handed_to(rs, waiter)


def test_a_failed_publish_is_retried_once_and_never_sent_twice(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr = managers()
    fence = _grant(mgr, rs)
    attempts: list[str | None] = []
    sent = _Sent()

    def publish(task_id: str, message: dict[str, Any], header: str | None) -> None:
        attempts.append(header)
        if len(attempts) == 1:
            raise ConnectionError("broker down")
        sent(task_id, message, header)

    dispatcher = Dispatcher(mgr, "inc1", publish=publish, on_withdrawn=lambda *a: None)
    with pytest.raises(ConnectionError):
        dispatcher.step()
    # Un-claimed and back on the dispatch list, nothing left in progress.
    assert rs.hget(f"{P}defer:t1", "sent") is None
    assert rs.lrange(f"{P}dispatch", 0, -1) == ["t1"] and rs.llen(dispatcher.dispatching_key) == 0
    dispatcher.step()
    assert sent.sent == [("t1", f"0:{fence}")] and rs.hget(f"{P}defer:t1", "sent") == fence
    rs.lpush(f"{P}dispatch", "t1")  # another push of the same grant
    dispatcher.step()
    assert attempts == [f"0:{fence}", f"0:{fence}"] and len(sent.sent) == 1


def test_a_park_that_fails_after_writing_its_record_leaves_nothing_of_it(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    before = namespace_keys(rs)
    # The arrival counter is not a counter: the queueing acquire fails (WRONGTYPE)
    # after defer_park.lua wrote the record and its schedules.
    seq = rs.get(f"{P}seq")
    rs.delete(f"{P}seq")
    rs.hset(f"{P}seq", "not", "a counter")
    req = mgr.request(["a"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        park(mgr, "t1", req, message, park_ttl=600, grant_ttl=60)
    assert not rs.exists(f"{P}defer:t1")
    assert rs.zscore(f"{P}deferred", "t1") is None and rs.zscore(f"{P}deadlines", "t1") is None
    assert rs.zcard(f"{P}q:a") == 0 and not rs.exists(f"{P}alive:defer:t1")
    assert not rs.sismember(f"{P}owners", "task:t1")
    assert namespace_keys(rs) == before | {f"{P}seq"}
    rs.delete(f"{P}seq")
    if seq is not None:
        rs.set(f"{P}seq", seq)
    holder.release()


def test_a_park_ended_by_the_tasks_expires_is_withdrawn_as_expired_not_timed_out(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    req = mgr.request(["a"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {"expires": _expires(0.3)}}
    park_ttl = park_limit(message, 600.0)  # the expires comes first
    assert park_ttl < 1 and message["ends"] == "expires"
    assert park(mgr, "t1", req, message, park_ttl=park_ttl, grant_ttl=60).outcome == "parked"
    other = {"name": "t.task", "args": [], "kwargs": {}, "options": {"expires": _expires(60)}}
    assert park_limit(other, 0.3) == 0.3 and "ends" not in other  # the time-out comes first
    assert park(mgr, "t2", req, other, park_ttl=0.3, grant_ttl=60).outcome == "parked"
    dispatcher, _, withdrawn = _recording_dispatcher(mgr)
    wait_until(
        lambda: not rs.exists(f"{P}alive:defer:t1", f"{P}alive:defer:t2"), what="parks ended"
    )
    dispatcher.upkeep()
    assert sorted(withdrawn) == [("t1", "expired-message"), ("t2", "expired")]
    assert not rs.exists(f"{P}defer:t1", f"{P}defer:t2") and rs.zcard(f"{P}q:a") == 0
    holder.release()


@pytest.fixture
def storing(
    redis_url: str,
) -> Iterator[tuple[tuple[Any, Any], list[tuple[str, str, str | None]]]]:
    """An app with a ``@locked(on_busy="defer")`` task (``fail``: it raises)
    and one with ``ignore_result``, whose result backend reads the task's
    park record as it stores each final state; yields ``((task, quiet
    task), seen)``, ``seen`` a list of ``(task id,
    state stored, park record state then)``. The Redis backend's own
    storing is unchanged: the read is an observation, made first."""
    from celery.backends.redis import RedisBackend
    from celery.states import READY_STATES

    from celery_helpers import close_app, quick_app
    from celery_redislock import RedisLock, locked

    seen: list[tuple[str, str, str | None]] = []
    reader = redis.Redis.from_url(redis_url, decode_responses=True)

    class ReadingBackend(RedisBackend):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["url"] = redis_url
            super().__init__(*args, **kwargs)

        def _store_result(self, task_id: str, result: Any, state: str, *a: Any, **kw: Any) -> Any:
            if state in READY_STATES:
                seen.append((task_id, state, reader.hget(f"{P}defer:{task_id}", "state")))
            return super()._store_result(task_id, result, state, *a, **kw)

    app = quick_app(redis_url, "defer-store", NS)
    app.backend_cls = ReadingBackend
    RedisLock(app)

    @app.task(bind=True, name="de.finish", shared=False)
    @locked("res:{tag}", on_busy="defer")
    def finish(self: Any, tag: str, fail: bool = False) -> str:
        if fail:
            raise ValueError(f"{tag} fails")
        return tag

    @app.task(bind=True, name="de.quiet", shared=False, ignore_result=True)
    @locked("res:{tag}", on_busy="defer")
    def quiet(self: Any, tag: str, fail: bool = False) -> str:
        return tag

    try:
        yield (finish, quiet), seen
    finally:
        close_app(app)
        reader.close()


def test_an_adopted_deferred_task_is_marked_done_only_after_its_result_is_stored(
    storing: tuple[tuple[Any, Any], list[tuple[str, str, str | None]]],
    managers: Managers,
    rs: redis.Redis,
) -> None:
    # A pool child killed after the body returned and before Celery stored
    # its result must leave the record 'adopted' (by a dead owner: the
    # redelivered copy runs again, D8), never 'done' (the copy would be
    # dropped and the task left DEFERRED for ever).
    from celery.contrib.testing.worker import start_worker

    tasks, seen = storing
    with start_worker(tasks[0].app, pool="threads", concurrency=1, perform_ping_check=False):
        # s3: ignore_result, nothing is stored: marked done all the same.
        for task_id, fail, quiet in (("s1", False, False), ("s2", True, False), ("s3", 0, 1)):
            holder = managers().acquire("res:x")
            result = tasks[quiet].apply_async(("x",), {"fail": fail}, task_id=task_id)
            wait_until(lambda r=result: r.state == "DEFERRED", what=f"{task_id} to park")
            holder.release()  # handed to the parked request, dispatched, adopted
            if not quiet:
                wait_until(lambda r=result: r.state in ("SUCCESS", "FAILURE"), 30, task_id)
            # Marked once Celery has stored the state (task_postrun).
            key = f"{P}defer:{task_id}"
            wait_until(lambda k=key: rs.hget(k, "state") == "done", 30, f"{task_id} done")
    assert seen == [("s1", "SUCCESS", "adopted"), ("s2", "FAILURE", "adopted")]
    assert tasks[0].AsyncResult("s1").result == "x"
    assert not rs.exists(f"{P}lock:res:x")


def test_a_grant_parked_by_an_earlier_release_is_adopted_under_its_old_owner_name(
    managers: Managers, rs: redis.Redis
) -> None:
    """An earlier release named a park record's task owner task:<id>: the
    record's token says so, and the adopting child takes that owner."""
    from celery_redislock.worker.defer import _attempt_as_task, deferred_key, record_key

    mgr, child = managers(), managers()
    holder = mgr.acquire("a")
    token = "task:t1|task:t1"
    rs.hset(
        record_key(mgr, "t1"),
        mapping={"state": "parked", "life": "0", "token": token, "modes": "x", "res": "a"},
    )
    rs.hset(record_key(mgr, "t1"), mapping={"msg": "{}", "gttl": "60000"})
    rs.zadd(deferred_key(mgr), {"t1": 1})
    got = _attempt_as_task(mgr, token, mgr.request(["a"], []), liveness_ms="600000", register="x")
    assert int(got[0]) == 0
    holder.release()
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    outcome, leases = adopt(child, "t1", 0)
    assert outcome == "adopted" and [x.resources for x in leases] == [("a",)]
    assert rs.hget(f"{P}defer:t1", "state") == "adopted"
    leases[0].release()


def test_the_grant_header_is_taken_off_the_request_so_a_retry_does_not_carry_it() -> None:
    """Celery's self.retry() sends the request's custom headers again: a
    retry of an adopted run must arrive as a new life, not as a copy of the
    grant's message."""
    from celery.app.task import Context

    from celery_redislock.integration.deferred import grant_header

    request = Context({"id": "t1", "task": "t.task", "retries": 0, "redislock_defer": "0:7"})
    assert request.as_execution_options()["headers"] == {"redislock_defer": "0:7"}
    assert grant_header(request) == (0, 7)
    assert request.as_execution_options()["headers"] == {}  # what a retry sends
    assert request.redislock_defer == "0:7"  # the body may still read it


# -- waiting tasks behind a grant in transit (docs/defer.md, T1-T4, M1-M7) ------


def _enqueue(
    mgr: LockManager, exclusive: tuple[str, ...] = (), shared: tuple[str, ...] = ()
) -> Any:
    """Queue one request of ``mgr`` (one acquire.lua run, no wait): (token, reply)."""
    req = mgr.request(list(exclusive), list(shared))
    ident = mgr.liveness.identity.current()
    token = f"{ident.owner_id}|{new_request_id()}"
    return token, mgr.acquirer.attempt(ident, token, req, True, False)


def _message(*res: str) -> dict[str, Any]:
    return {"name": "t.task", "args": [], "kwargs": {}, "options": {}, "resources": list(res)}


def _take_over(
    mgr: LockManager, task_id: str, req: Any, waiting: str, *res: str, **extra: Any
) -> defer.ParkResult:
    """Park ``task_id`` in the place of the queued request ``waiting``."""
    return defer.park(
        mgr, task_id, req, _message(*res), park_ttl=600, grant_ttl=60, waiting=waiting, **extra
    )


def _in_transit(managers: Managers, rs: redis.Redis, task_id: str, *res: str) -> LockManager:
    """Park ``task_id`` behind a holder, then release: its grant is in transit."""
    mgr = managers()
    holder = mgr.acquire(list(res))
    assert _park(mgr, task_id, *res) == "parked"
    holder.release()
    assert rs.hget(f"{P}defer:{task_id}", "state") == "granted"
    return mgr


def test_a_blocked_reply_names_the_grant_in_transit_that_blocks_it(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    _park(mgr, "t1", "a")
    _, reply = _enqueue(managers(), ("a",))
    assert int(reply[0]) == 0 and reply[4] == ""  # a process holds: no grant in transit
    holder.release()  # handed to t1 (in transit); the waiter is next
    _, reply = _enqueue(managers(), ("a",))
    assert int(reply[0]) == 0 and reply[4] == "t1"
    _, reply = _enqueue(managers(), (), ("a",))  # shared behind it too
    assert int(reply[0]) == 0 and reply[4] == "t1"
    _, leases = adopt(managers(), "t1", 0)  # adopted: a process holds it now
    _, reply = _enqueue(managers(), ("a",))
    assert int(reply[0]) == 0 and reply[4] == ""
    leases[0].release()


def test_the_nudge_tells_the_waiting_processes_that_wait_for_a_grant_in_transit(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, other = managers(), managers()
    holder, b = mgr.acquire("a"), other.acquire("b")
    req = mgr.request([], ["a"])  # t1 asks for 'a' shared
    assert park(mgr, "t1", req, _message("a"), park_ttl=600, grant_ttl=60).outcome == "parked"
    # 's1' waits shared on 'a' and exclusive on 'b' (blocked by 'b' only);
    # 'x1' exclusive on 'a'; then a parked request; then 's2' shared.
    s1, _ = _enqueue(managers(), ("b",), ("a",))
    x1, _ = _enqueue(managers(), ("a",))
    assert _park(mgr, "t2", "a") == "parked"
    s2, _ = _enqueue(managers(), (), ("a",))
    holder.release()
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    for token in (s1, x1, s2):
        rs.delete(f"{P}wake:{token}")  # the release's own wake-ups
    dispatcher, sent = _dispatcher(mgr)
    dispatcher.handle("t1")
    fence = int(rs.hget(f"{P}defer:t1", "fence") or 0)
    assert sent.sent == [("t1", f"0:{fence}")]
    told = {t for t in (s1, x1, s2) if rs.lrange(f"{P}wake:{t}", 0, -1) == ["t"]}
    # s1 is ahead of every exclusive entry on 'a', which t1 holds shared: it
    # does not wait for t1. The parked t2 holds no pool slot: not told.
    assert told == {x1, s2}
    assert not rs.exists(f"{P}wake:defer:t2|task:t2")
    assert rs.lrange(f"{P}dispatch", 0, -1) == ["t1"]  # (handle() pops nothing)
    # Adopted: nobody is told any more.
    for token in told:
        rs.delete(f"{P}wake:{token}")
    _, leases = adopt(managers(), "t1", 0)
    assert dispatcher.nudge("t1", fence) == 0
    assert not any(rs.exists(f"{P}wake:{t}") for t in (x1, s2))
    for lease in leases:
        lease.release()
    b.release()


def test_a_waiting_request_taken_over_keeps_its_place_and_its_arrival_number(
    managers: Managers, rs: redis.Redis
) -> None:
    _in_transit(managers, rs, "t1", "a", "b")
    waiter = managers()
    token, reply = _enqueue(waiter, ("a",), ("b",))
    assert reply[4] == "t1"
    after, _ = _enqueue(managers(), ("a",))
    score = rs.zscore(f"{P}q:a", "x" + token)
    req = waiter.request(["a"], ["b"])
    # Not queued (a made-up token): nothing is written.
    assert _take_over(waiter, "w1", req, f"{waiter.owner_id}|nope", "a", "b").outcome == (
        "not-queued"
    )
    assert not rs.exists(f"{P}defer:w1")

    result = _take_over(waiter, "w1", req, token, "a", "b", holder="t.task\nw1\nnode")
    assert result.outcome == "parked"
    new = "defer:w1|task:w1"
    assert rs.zrange(f"{P}q:a", 0, -1, withscores=True) == [
        ("x" + new, score),
        ("x" + after, rs.zscore(f"{P}q:a", "x" + after)),
    ]
    assert rs.zrange(f"{P}q:b", 0, -1, withscores=True) == [("s" + new, score)]
    assert not rs.exists(f"{P}req:{token}") and not rs.hexists(f"{P}waits:{waiter.owner_id}", token)
    assert rs.hget(f"{P}waits:defer:w1", new) == "xs\na\nb"
    state = rs.hgetall(f"{P}req:{new}")
    assert (state["state"], float(state["seq"]), state["nested"]) == ("q", score, "0")
    assert state["holder"] == "task:w1\nt.task\nw1\nnode"
    assert 0 < rs.pttl(f"{P}alive:defer:w1") <= 600_000
    assert rs.hget(f"{P}defer:w1", "state") == "parked"
    # A second take-over (a copy of the message): the record holds the task.
    again, _ = _enqueue(managers(), ("a",), ("b",))
    dup = _take_over(managers(), "w1", req, again, "a", "b")
    assert (dup.outcome, dup.state) == ("duplicate", "parked")

    # FIFO: t1 runs, then the parked w1 (dispatched), then the waiter after it.
    _, leases = adopt(managers(), "t1", 0)
    for lease in leases:
        lease.release()
    assert rs.hget(f"{P}defer:w1", "state") == "granted"
    assert rs.lindex(f"{P}dispatch", 0) == "w1"
    _, leases = adopt(managers(), "w1", 0)
    assert len(leases) == 1 and set(leases[0].resources) == {"a", "b"}
    for lease in leases:
        lease.release()
    assert rs.hkeys(f"{P}lock:a") == [after]


def test_a_waiting_task_behind_a_grant_in_transit_parks_in_its_place_and_a_plain_waiter_keeps_waiting(
    managers: Managers, rs: redis.Redis
) -> None:
    mgr, holder = _holding(managers, "a")
    assert _park(mgr, "t1", "a") == "parked"
    outcomes: dict[str, Any] = {}

    def wait_as_task(name: str) -> None:
        # A long owner_ttl and socket timeout: its wait re-runs its script
        # only when its blocker's liveness could run out (~30 s), so only
        # the nudge makes it look again meanwhile.
        m = managers(f"{managers.url}?socket_timeout=90", owner_ttl=600)
        parked: list[Any] = []

        def hook(token: str, req: Any) -> bool:
            result = _take_over(m, name, req, token, "a")
            parked.append(result)
            return result.outcome in ("parked", "granted")

        try:
            with m.context.using(take_over=hook):
                outcomes[name] = m.acquire("a", timeout=60)
        except RequestMoved as exc:
            outcomes[name] = (exc.behind, parked[0].outcome)

    def wait_directly() -> None:
        outcomes["plain"] = managers().acquire("a", timeout=30)

    w1 = threading.Thread(target=wait_as_task, args=("w1",))
    w1.start()
    wait_until(lambda: rs.zcard(f"{P}q:a") == 2, what="w1 queued")
    plain = threading.Thread(target=wait_directly)
    plain.start()
    wait_until(lambda: rs.zcard(f"{P}q:a") == 3, what="the plain waiter queued")
    holder.release()  # to t1: in transit; both wait in their BLPOP
    assert rs.hget(f"{P}defer:t1", "state") == "granted"
    dispatcher, _ = _dispatcher(mgr)
    dispatcher.step()  # publish t1, then the nudge
    wait_until(lambda: "w1" in outcomes, timeout=10, what="w1 told, and parked")
    assert outcomes["w1"] == ("t1", "parked")
    # A task arriving now sees the grant in its first reply: parked at once.
    w2 = threading.Thread(target=wait_as_task, args=("w2",))
    w2.start()
    w2.join(20)
    assert outcomes["w2"] == ("t1", "parked")
    queue = rs.zrange(f"{P}q:a", 0, -1)
    assert queue[0] == "xdefer:w1|task:w1" and queue[2] == "xdefer:w2|task:w2"
    assert not queue[1].startswith("xdefer") and "plain" not in outcomes  # still waiting

    for task_id in ("t1", "w1"):
        _, leases = adopt(managers(), task_id, 0)
        assert leases, task_id
        leases[0].release()
    plain.join(20)
    outcomes["plain"].release()
    assert rs.hget(f"{P}defer:w2", "state") == "granted"
