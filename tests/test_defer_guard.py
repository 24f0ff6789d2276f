"""Guards of parked deferred tasks (docs/defer.md, "Guards" and D12), in process.

A real redis-server is the broker, the result backend and the lock store; a
Celery app (no worker) runs the guard's check directly, and the messages it
publishes are read from the broker's queue list. Pinned here:

- one guard per park record goes on (``defer_guard.lua``): a second delivery
  of a handled guard message ends, another guard's live claim ends the
  newcomer, a claim that ran out is taken over;
- a guard ends when the record is adopted or done;
- a guard watches one attempt (its message's retry number): a record of a
  later attempt ends it, and so does an adoption marker of a later attempt;
- with no record (the lock Redis lost it) the guard looks once more, then
  parks the task again itself, in a life above its own, and goes on (it
  publishes nothing but its own next message), unless the result is ready
  or the adoption marker says the body of this attempt's life (or a later
  one) started;
- a copy of the message that finds no record is dropped when the result is
  ready or the marker says a later life (or attempt) started;
- with no result either (the result backend lost it too) the task fails
  with ``LockLost`` instead of running twice; another state (``STARTED``)
  makes it look again later;
- a lock Redis it cannot reach: the same guard message is sent again;
- the namespace's guard budget (``redislock_defer_guard_rate``): however
  many tasks are parked, the guards' checks booked in any one interval stay
  within the budget (each guard's interval stretches), and every parked
  task is still checked.

tests/e2e/test_loss_e2e.py runs the whole path with a real worker and a
lock Redis that restarts empty.
"""

from __future__ import annotations

import base64
import datetime
import heapq
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_helpers import close_app, quick_app
from celery_redislock import LockLost, LockManager, RedisLock
from celery_redislock.exceptions import CAUSE_REDIS_LOST, ConfigurationError
from celery_redislock.integration.guard import (
    GUARD_TASK,
    check,
    copy_is_stale,
    enabled,
    mark_adopted,
)
from celery_redislock.integration.settings import load_config
from celery_redislock.worker.defer import adopt, mark_done, park

NS = "tg"
P = "{tg}:"
MESSAGE: dict[str, Any] = {
    "name": "t.task",
    "args": [1],
    "kwargs": {},
    "options": {},
    "resources": ["a"],
    "modes": "x",
    "park_ttl": 600,
    "grant_ttl": 60,
}


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    a = quick_app(redis_url, "guard-tests", NS, redislock_url=redis_url)
    RedisLock(a)
    yield a
    close_app(a)


@pytest.fixture
def rs(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def _locks(app: Celery) -> RedisLock:
    locks = RedisLock.of(app)
    assert locks is not None
    return locks


def _park(app: Celery, task_id: str, message: dict[str, Any] = MESSAGE) -> int:
    mgr = _locks(app).manager
    req = mgr.request(["a"], [])
    result = park(mgr, task_id, req, message, park_ttl=600, grant_ttl=60)
    assert result.outcome == "parked"
    return result.life


def _sent(app: Celery, rs: redis.Redis) -> list[dict[str, Any]]:
    """Messages published to the app's default queue, oldest first (and removed)."""
    queue = app.conf.task_default_queue
    out = []
    while (raw := rs.rpop(queue)) is not None:
        msg = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(msg["body"]))
        headers = msg["headers"]
        out.append({"task": headers["task"], "id": headers["id"], "args": args, "h": headers})
    return out


def _check(app: Celery, task_id: str, gid: str, seq: int, life: int = 0, **kw: Any) -> str:
    return check(
        _locks(app),
        task_id,
        kw.get("message", MESSAGE),
        gid,
        seq,
        life,
        kw.get("suspect", False),
        kw.get("interval", 60.0),
    )


def test_one_guard_per_record_goes_on_and_the_others_end(app: Celery, rs: redis.Redis) -> None:
    _locks(app).manager.acquire("a")  # keeps the task parked
    _park(app, "g1")
    assert _check(app, "g1", "G", 0) == "rearm"
    [guard] = _sent(app, rs)
    assert guard["task"] == GUARD_TASK and guard["h"]["eta"]
    assert guard["args"][:5] == ["g1", MESSAGE, "G", 1, 0]
    record = rs.hgetall(f"{P}defer:g1")
    assert (record["guard"], record["gseq"]) == ("G", "1")

    # The broker delivers the handled message again: it ends.
    assert _check(app, "g1", "G", 0) == "ended:stale"
    # A spare guard (a duplicate copy's) meets a live claim: it ends.
    assert _check(app, "g1", "SPARE", 0) == "ended:other"
    assert _sent(app, rs) == []
    # The claimant's next message goes on.
    assert _check(app, "g1", "G", 1) == "rearm"
    assert [m["args"][3] for m in _sent(app, rs)] == [2]
    # A claim nobody renewed in time (its message is held by a dead worker)
    # is taken over; the old claimant ends when it comes back.
    rs.hset(f"{P}defer:g1", "gdue", "0")
    assert _check(app, "g1", "SPARE", 0) == "rearm"
    assert _check(app, "g1", "G", 2) == "ended:other"
    assert len(_sent(app, rs)) == 1


def test_a_guard_ends_once_its_task_is_adopted_or_done(app: Celery, rs: redis.Redis) -> None:
    locks = _locks(app)
    mgr = locks.manager
    holder = mgr.acquire("a")
    life = _park(app, "g2")
    assert _check(app, "g2", "G", 0) == "rearm"
    holder.release()  # handed to the parked request
    assert rs.hget(f"{P}defer:g2", "state") == "granted"
    assert _check(app, "g2", "G", 1) == "rearm"
    outcome, leases = adopt(mgr, "g2", life)
    assert outcome == "adopted"
    assert _check(app, "g2", "G", 2) == "ended:adopted"
    leases[0].release()
    mark_done(mgr, "g2", leases[0].owner_id)
    assert _check(app, "g2", "G", 2) == "ended:done"
    assert len(_sent(app, rs)) == 2  # the two re-arms


def test_a_guard_recovers_a_parked_task_the_lock_redis_lost(app: Celery, rs: redis.Redis) -> None:
    _locks(app).manager.acquire("a")
    _park(app, "g3")
    app.backend.store_result("g3", {"resources": ["res:a"]}, "DEFERRED")
    assert _check(app, "g3", "G", 0) == "rearm"
    _sent(app, rs)
    for key in rs.keys(f"{P}*"):  # the lock Redis loses its data
        rs.delete(key)
    other = LockManager(redis.Redis.from_url(app.conf.redislock_url), NS)
    other.acquire("a")  # busy again after the loss (another process holds it)

    # First look: no record, not started: look once more.
    assert _check(app, "g3", "G", 1) == "suspect"
    [again] = _sent(app, rs)
    assert again["task"] == GUARD_TASK and again["args"][3:6] == [1, 0, True]
    # Second look: recover (parked again here, record-first, in a life above
    # the guard's: nothing but the guard's next message goes to the broker)
    # and go on guarding that life.
    assert _check(app, "g3", "G", 1, suspect=True) == "recovered"
    [guard] = _sent(app, rs)
    assert guard["task"] == GUARD_TASK and guard["args"][3:6] == [1, 1, False]
    record = rs.hgetall(f"{P}defer:g3")
    assert (record["state"], record["life"]) == ("parked", "1")
    assert rs.zscore(f"{P}q:a", "xdefer+1:g3|task:g3") is not None
    # Another guard of the task (a spare one) finds the record: nothing more
    # is parked; one of the two guards goes on.
    assert _check(app, "g3", "SPARE", 0, suspect=True) == "rearm"
    assert rs.zcard(f"{P}q:a") == 1
    assert _check(app, "g3", "G", 1, life=1) == "ended:other"
    other.close()


def test_a_guard_never_recovers_a_task_that_started_or_ended(app: Celery, rs: redis.Redis) -> None:
    # No record at all (lost), state DEFERRED.
    app.backend.store_result("g4", {"resources": ["res:a"]}, "DEFERRED")
    # An adoption of an earlier life does not count: it was parked again since.
    mark_adopted(app, "g4", 0)
    assert _check(app, "g4", "G", 0, life=1, suspect=True).startswith("recovered")
    _sent(app, rs)
    rs.delete(f"{P}defer:g4")  # lost again
    # The body of this life started: the running message is in charge.
    mark_adopted(app, "g4", 1)
    assert _check(app, "g4", "G", 0, life=1, suspect=True) == "ended:adopted"
    # A ready result ends it whatever the marker says.
    app.backend.store_result("g5", None, "SUCCESS")
    assert _check(app, "g5", "G", 0, suspect=True) == "ended:SUCCESS"
    app.backend.store_result("g6", None, "REVOKED")
    assert _check(app, "g6", "G", 0) == "ended:REVOKED"
    assert _sent(app, rs) == []


def test_a_guard_outlives_a_lock_redis_it_cannot_reach(
    redis_url: str, rs: redis.Redis, free_port: Any
) -> None:
    # The lock Redis is down (restarting, say): the guard is sent again, the
    # same sequence number, for the next interval; it is never lost.
    a = quick_app(redis_url, "guard-down", NS, redislock_url=f"redis://127.0.0.1:{free_port()}/0")
    RedisLock(a)
    try:
        assert _check(a, "g7", "G", 4, life=2, suspect=True) == "retry"
        [again] = _sent(a, rs)
        assert again["task"] == GUARD_TASK and again["args"][:6] == ["g7", MESSAGE, "G", 4, 2, True]
    finally:
        close_app(a)


def test_a_task_both_stores_lost_fails_saying_why_instead_of_running_twice(
    app: Celery, rs: redis.Redis
) -> None:
    # No record and no result at all: the park wrote DEFERRED before it sent
    # the guard, so the result backend lost the task too; it may have run.
    assert _check(app, "g8", "G", 0) == "suspect"
    _sent(app, rs)
    assert _check(app, "g8", "G", 0, suspect=True) == "ended:lost"
    assert _sent(app, rs) == []  # neither a copy nor another guard
    meta = app.backend.get_task_meta("g8", cache=False)
    assert meta["status"] == "FAILURE"
    assert isinstance(meta["result"], LockLost) and meta["result"].cause == CAUSE_REDIS_LOST
    # A copy on its way (task_track_started wrote STARTED): look again later.
    app.backend.store_result("g9", {"pid": 1}, "STARTED")
    assert _check(app, "g9", "G", 3, suspect=True) == "wait:STARTED"
    [again] = _sent(app, rs)
    assert again["args"][3:6] == [3, 0, False]


def test_guards_are_on_by_default_only_with_a_lock_redis_of_its_own() -> None:
    broker = {"broker_url": "redis://broker:6379/0"}
    # The lock Redis is the broker's: its loss takes the guards with it.
    assert load_config(broker).defer_guard_interval is None
    own = {**broker, "redislock_url": "redis://locks:6379/0"}
    assert load_config(own).defer_guard_interval == 300.0
    assert load_config({**broker, "redislock_defer_guard_interval": 30}).defer_guard_interval == 30
    for off in (None, 0):
        assert (
            load_config({**own, "redislock_defer_guard_interval": off}).defer_guard_interval is None
        )
    with pytest.raises(ConfigurationError, match="redislock_defer_guard_interval"):
        load_config({**own, "redislock_defer_guard_interval": 0.5})


def test_guards_need_a_result_backend_a_worker_can_read(redis_url: str) -> None:
    readable = quick_app(redis_url, "guard-backend", NS)
    try:
        assert enabled(readable, 300.0) and not enabled(readable, None)
    finally:
        close_app(readable)
    for backend in (None, "rpc://"):
        a = Celery("guard-nobackend", broker=redis_url, backend=backend, set_as_current=False)
        try:
            assert not enabled(a, 300.0)
        finally:
            a.close()


RETRY: dict[str, Any] = {**MESSAGE, "options": {"retries": 1}}


def test_a_guard_of_one_attempt_ends_at_the_record_of_the_retry(
    app: Celery, rs: redis.Redis
) -> None:
    # Attempt 0 parked and sent its guard, was adopted, ran and retried; the
    # retry parked (a new life, retries 1) and sent a guard of its own. The
    # first guard must not take the retry's record over: recovered from its
    # message after a loss, the task would run attempt 0 again.
    _locks(app).manager.acquire("a")
    life0 = _park(app, "g10")
    rs.hset(f"{P}defer:g10", mapping={"state": "done"})
    life1 = _park(app, "g10", RETRY)
    assert life1 > life0 and rs.hget(f"{P}defer:g10", "retries") == "1"
    assert _check(app, "g10", "G0", 0, life=life0) == "ended:superseded"
    assert _check(app, "g10", "G1", 0, life=life1, message=RETRY) == "rearm"
    assert rs.hget(f"{P}defer:g10", "guard") == "G1"


def test_an_adoption_of_an_earlier_attempt_does_not_end_the_retrys_guard(
    app: Celery, rs: redis.Redis
) -> None:
    # The lock Redis lost the retry's record (attempt 1, life 0 after an
    # earlier loss): the marker of attempt 0's adoption (life 0) must not
    # count as the retry having started.
    _locks(app).manager.acquire("a")
    app.backend.store_result("g11", {"resources": ["a"]}, "DEFERRED")
    mark_adopted(app, "g11", 0, 0)
    assert _check(app, "g11", "G", 3, life=0, message=RETRY, suspect=True).startswith("recovered")
    assert rs.hget(f"{P}defer:g11", "retries") == "1"
    rs.delete(f"{P}defer:g11")
    # The retry's own adoption, or a later attempt's, does end it.
    mark_adopted(app, "g11", 1, 1)
    assert _check(app, "g11", "G", 3, life=1, message=RETRY, suspect=True) == "ended:adopted"
    mark_adopted(app, "g11", 0, 2)
    assert _check(app, "g11", "G", 3, life=5, message=RETRY, suspect=True) == "ended:adopted"


def test_a_copy_finding_no_record_of_a_task_that_ran_is_stale(app: Celery, rs: redis.Redis) -> None:
    locks = _locks(app)
    # No record, no marker: the copy parks (the task never started).
    assert copy_is_stale(locks, "g12", 0, 0, False) is None
    # The grant of life 1 (a regrant) was adopted: a copy of the grant of
    # life 0 is stale, redelivered or not (R3); so is a redelivered
    # original message (no grant).
    mark_adopted(app, "g12", 1, 0, via=1)
    assert copy_is_stale(locks, "g12", 0, 0, False) == "adopted"
    assert copy_is_stale(locks, "g12", 0, 0, True) == "adopted"
    assert copy_is_stale(locks, "g12", 0, None, True) == "adopted"
    # The copy's own grant: a second publish of it (not redelivered) is
    # stale; the redelivered message whose body was cut short runs again.
    assert copy_is_stale(locks, "g12", 0, 1, False) == "adopted"
    assert copy_is_stale(locks, "g12", 0, 1, True) is None
    # The message of the grant of life 0 parked itself again and adopted
    # life 1 at once (its first grant had gone): redelivered after a kill,
    # it runs again.
    mark_adopted(app, "g12", 1, 0, via=0)
    assert copy_is_stale(locks, "g12", 0, 0, True) is None
    # A grant of a later life than the marker's is the current one.
    assert copy_is_stale(locks, "g12", 0, 2, False) is None
    # A retry (attempt 1) is not stale because attempt 0 started.
    assert copy_is_stale(locks, "g12", 1, None, True) is None
    # A ready result drops any copy; a record lets the record decide.
    app.backend.store_result("g12", "ok", "SUCCESS")
    assert copy_is_stale(locks, "g12", 1, None, True) == "SUCCESS"
    locks.manager.acquire("a")
    _park(app, "g12")
    assert copy_is_stale(locks, "g12", 0, 0, False) is None


def _eta(msg: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(msg["h"]["eta"]).timestamp()


def test_the_guard_budget_bounds_the_checks_per_interval_however_many_tasks_are_parked(
    redis_url: str, rs: redis.Redis
) -> None:
    interval, rate = 0.2, 50.0  # the budget: 10 checks per interval
    bound = int(rate * interval) + 1  # + 1: a slot on an interval's edge
    app = quick_app(
        redis_url, "guard-budget", NS, redislock_url=redis_url, redislock_defer_guard_rate=rate
    )
    RedisLock(app)
    try:
        locks = _locks(app)
        assert locks.config.defer_guard_rate == rate
        locks.manager.acquire("a")  # keeps every task parked
        # The broker's countdown queue: (due, order, the guard message's args).
        due: list[tuple[float, int, list[Any]]] = []
        parked = 0
        for n in (5, 20, 80):
            while parked < n:
                tid = f"b{parked}"
                _park(app, tid)
                args = [tid, MESSAGE, f"G-{tid}", 0, 0, False, interval, interval]
                heapq.heappush(due, (time.time() + interval, parked, args))  # the park's guard
                parked += 1
            booked: Counter[int] = Counter()  # checks booked, per interval of their due time
            checked = set()
            end = time.time() + 2 * max(interval, n / rate) + 2 * interval
            while due[0][0] < end:
                at, order, args = heapq.heappop(due)
                time.sleep(max(0.0, at - time.time()))  # delivered when due, as the broker does
                assert check(locks, *args) == "rearm"
                checked.add(args[0])
                [msg] = _sent(app, rs)
                assert msg["task"] == GUARD_TASK
                heapq.heappush(due, (_eta(msg), order, msg["args"]))
                booked[int(_eta(msg) // interval)] += 1
            assert len(checked) == n  # every parked task is still checked
            # n guard checks per interval without a budget; at most the budget with it.
            assert max(booked.values()) <= min(n, bound), (n, sorted(booked.items()))
            if n > bound:  # stretched: each guard's next check about n / rate seconds on
                every = max(float(a[7]) for _, _, a in due)
                assert n / rate * 0.8 <= every <= n / rate + interval
    finally:
        close_app(app)
