"""``@locked(limited={template: N})``: the Celery face of limited resources.

In process, against the real redis-server: the decoration-time checks of
``limited=`` (each naming the function), the templates formatted from a
call's arguments, a name formatted both limited and exclusive (refused at
call time), the ``on_busy`` modes that try once or wait, a resource held in
the other kind, ``UniqueTask`` over a deferred limited task in Celery's
threads worker, and, without Celery, the park record and the dispatcher
keeping each parked task's limit (a re-park, a re-attempt refused for a
resource of the other kind). tests/e2e/test_limited_e2e.py runs it with
``celery worker -P prefork``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_helpers import QUICK_NS as NS
from celery_helpers import QUICK_PREFIX as PREFIX
from celery_redislock import (
    ConfigurationError,
    InvalidResource,
    LockManager,
    LockTimeout,
    RedisLock,
    TemplateError,
    UniqueTask,
    current_lease,
    locked,
)
from celery_redislock.integration.bootsteps import _record_withdrawn
from celery_redislock.protocol.request import MAX_LIMIT
from celery_redislock.worker import defer
from celery_redislock.worker.defer import Dispatcher
from engine_helpers import wait_until


@pytest.fixture
def app(quick_apps: Callable[..., Celery]) -> Celery:
    return quick_apps("lim")


@pytest.fixture
def other(redis_url: str) -> Iterator[LockManager]:
    """Another lock user (its own owner and heartbeat)."""
    mgr = LockManager(redis_url, NS, owner_ttl=30)
    yield mgr
    mgr.close()


@pytest.fixture
def third(redis_url: str) -> Iterator[LockManager]:
    """A third lock user: one thread of one owner holds one slot of a
    resource (asking again re-enters it), so two slots take two users."""
    mgr = LockManager(redis_url, NS, owner_ttl=30)
    yield mgr
    mgr.close()


# -- decoration time ---------------------------------------------------------


def _decorate(**options: Any) -> Any:
    def call_partner(repo_id: int, partner: str) -> None: ...

    return locked("repo:{repo_id}", **options)(call_partner)


@pytest.mark.parametrize(
    "limited,words",
    [
        (["api:{partner}"], "must be a dict of resource template to its limit"),
        ({"api:{partner}": 0}, "must be an int from 1 to"),
        ({"api:{partner}": MAX_LIMIT + 1}, f"from 1 to {MAX_LIMIT}"),
        ({"api:{partner}": True}, "not True"),
        ({"api:{partner}": 2.0}, "not 2.0"),
        ({"api:{partner}": "5"}, "not '5'"),
        ({"": 5}, "non-empty str"),
        ({"api:{partner": 5}, "malformed"),
        ({"repo:{repo_id}": 5}, "is also exclusive"),
    ],
)
def test_a_bad_limited_option_is_refused_when_it_decorates_naming_the_function(
    limited: Any, words: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        _decorate(limited=limited)
    assert info.value.setting == "locked(limited=) of _decorate.<locals>.call_partner"
    assert words in str(info.value)


def test_limited_templates_name_parameters_and_may_be_a_tasks_only_resources() -> None:
    with pytest.raises(ConfigurationError, match="is also shared"):
        locked(shared=["api:{p}"], limited={"api:{p}": 2})(lambda p: None)
    with pytest.raises(TemplateError, match="'partner'"):
        locked(limited={"api:{partner}": 2})(lambda p: None)
    wrapped = locked(limited={"api:{p}": 2, "quota:{p}": 9})(lambda p: None)
    assert wrapped.__redislock__["limited"] == {"api:{p}": 2, "quota:{p}": 9}
    assert wrapped.__redislock__["exclusive"] == () and wrapped.__redislock__["shared"] == ()
    with pytest.raises(ConfigurationError, match="at least one resource"):
        locked(limited={})


# -- call time ---------------------------------------------------------------


def test_limited_templates_are_formatted_from_the_call_and_take_one_slot_each(
    app: Celery, r: redis.Redis
) -> None:
    seen: dict[str, Any] = {}

    @app.task(shared=False, bind=True)
    @locked("repo:{repo_id}", shared="cfg", limited={"api:{partner}": 5, "cpu": 2})
    def sync(self: Any, repo_id: int, partner: str = "github") -> int:
        lease = current_lease()
        assert lease is not None
        seen["limited"] = lease.limited
        seen["resources"] = lease.resources
        seen["slot"] = r.hget(PREFIX + "lock:api:github", lease.token)
        return lease.fencing_token

    fence = sync.apply(args=(1,), throw=True).get()
    assert seen["limited"] == {"api:github": 5, "cpu": 2}
    assert seen["resources"] == ("repo:1", "cfg", "api:github", "cpu")
    assert seen["slot"] == f"l{fence}:5".encode()  # mode, fence, the request's limit
    assert not r.keys(PREFIX + "lock:*")


def test_a_name_formatted_limited_and_exclusive_by_one_call_is_refused_before_locking(
    app: Celery, r: redis.Redis
) -> None:
    @app.task(shared=False)
    @locked("api:{a}", limited={"api:{b}": 2})
    def mixed(a: str, b: str) -> str:
        return "ran"

    @app.task(shared=False)
    @locked(limited={"api:{a}": 2, "api:{b}": 3})
    def two_limits(a: str, b: str) -> str:
        return "ran"

    assert mixed.apply(args=("x", "y"), throw=True).get() == "ran"
    with pytest.raises(
        InvalidResource, match="mixed: limited template 'api:{b}' formats to 'api:x'.*never both"
    ) as info:
        mixed.apply(args=("x", "x"), throw=True)
    assert info.value.resource == "api:x"
    with pytest.raises(InvalidResource, match=r"two limits \(2 and 3\)"):
        two_limits.apply(args=("x", "x"), throw=True)
    assert not r.keys(PREFIX + "lock:*") and not r.keys(PREFIX + "q:*")


@pytest.mark.parametrize("mode", ["raise", "skip", "wait"])
def test_a_full_limited_resource_is_busy_for_every_mode_and_a_free_slot_is_granted(
    app: Celery, other: LockManager, third: LockManager, mode: str
) -> None:
    ran: list[str] = []
    options: dict[str, Any] = {"timeout": 0.2} if mode == "wait" else {}

    @app.task(shared=False)
    @locked(limited={"api:{p}": 2}, on_busy=mode, **options)
    def call(p: str) -> str:
        ran.append(p)
        return "ran"

    first = other.acquire(limited={"api:x": 2})
    second = third.acquire(limited={"api:x": 2})
    if mode == "skip":
        assert call.apply(args=("x",), throw=True).get() is None
    else:
        with pytest.raises(LockTimeout):
            call.apply(args=("x",), throw=True)
    assert ran == []
    second.release()  # one slot free
    assert call.apply(args=("x",), throw=True).get() == "ran"
    first.release()


def test_a_limited_task_meeting_its_resource_held_exclusive_fails_with_invalid_resource(
    app: Celery, other: LockManager
) -> None:
    @app.task(shared=False)
    @locked(limited={"api:{p}": 2}, on_busy="wait", timeout=1)
    def call(p: str) -> str:
        return "ran"

    with other.lock("api:x"), pytest.raises(InvalidResource, match="only ever taken limited"):
        call.apply(args=("x",), throw=True)


def test_a_deferred_limited_unique_task_parks_keeping_its_key_and_runs_in_a_freed_slot(
    app: Celery, other: LockManager, r: redis.Redis
) -> None:
    seen: dict[str, Any] = {}

    @app.task(base=UniqueTask, bind=True, unique_key="lim:{p}", name="lim.udefer")
    @locked(limited={"api:{p}": 1}, on_busy="defer")
    def udefer(self: Any, p: str) -> str:
        lease = current_lease()
        seen["limited"] = lease.limited if lease is not None else None
        seen["key"] = self.unique_lease is not None
        return str(self.request.id)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        blocker = other.acquire(limited={"api:x": 1})
        res = udefer.delay("x")
        wait_until(lambda: res.state == "DEFERRED", what="parked")
        record = r.hgetall(PREFIX + f"defer:{res.id}")
        assert record[b"modes"] == b"l:1" and record[b"res"] == b"api:x"
        assert json.loads(record[b"msg"])["modes"] == "l:1"
        assert udefer.delay("x").id == res.id  # the key stays while parked
        blocker.release()
        assert res.get(timeout=20) == res.id
    assert seen == {"limited": {"api:x": 1}, "key": True}
    assert not r.keys(PREFIX + "lock:*")


# -- the park record and the dispatcher (no Celery worker) -------------------


def _park_limited(mgr: LockManager, task_id: str, limit: int) -> defer.ParkResult:
    req = mgr.request(None, None, {"api:x": limit})
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    message.update(modes=req.spec, resources=list(req.resources))
    return defer.park(mgr, task_id, req, message, park_ttl=600, grant_ttl=0.3)


def test_a_parked_limited_task_keeps_its_limit_through_a_re_park_and_its_grant(
    other: LockManager, third: LockManager, redis_url: str, r: redis.Redis
) -> None:
    mgr = LockManager(redis_url, NS, owner_ttl=30)
    try:
        holders = [m.acquire(limited={"api:x": 2}) for m in (other, third)]
        assert _park_limited(mgr, "t1", 2).outcome == "parked"
        assert r.hget(PREFIX + "defer:t1", "modes") == b"l:2"
        holders[0].release()  # one slot: handed to the parked task
        assert r.hget(PREFIX + "defer:t1", "state") == b"granted"
        # Nobody adopts it: the upkeep parks it again, its limit kept.
        wait_until(lambda: not r.exists(PREFIX + "alive:defer:t1"), what="grant TTL ran out")
        dispatcher = Dispatcher(mgr, "inc1", publish=lambda *a: None, on_withdrawn=lambda *a: None)
        dispatcher.due("t1")
        record = r.hgetall(PREFIX + "defer:t1")
        assert record[b"life"] == b"1" and record[b"modes"] == b"l:2"
        assert record[b"state"] == b"granted"  # a slot was free: granted at once again
        outcome, leases = defer.adopt(mgr, "t1", 1)
        assert outcome == "adopted" and [x.resources for x in leases] == [("api:x",)]
        for lease in [*leases, holders[1]]:
            lease.release()
    finally:
        mgr.close()
    assert not r.keys(PREFIX + "lock:*")


def test_an_adopted_grant_of_exclusive_and_two_limited_resources_keeps_each_limit(
    other: LockManager, third: LockManager, redis_url: str, r: redis.Redis
) -> None:
    """A parked task asks for ``db`` exclusive and slots of ``api:x``
    (N = 2, full) and ``api:y`` (N = 5); a slot freed hands it all three,
    and the lease its adoption makes has each limit in its place."""
    mgr = LockManager(redis_url, NS, owner_ttl=30)
    try:
        holders = [m.acquire(limited={"api:x": 2}) for m in (other, third)]
        req = mgr.request("db", None, {"api:x": 2, "api:y": 5})
        message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
        message.update(modes=req.spec, resources=list(req.resources))
        parked = defer.park(mgr, "t2", req, message, park_ttl=600, grant_ttl=30)
        assert parked.outcome == "parked"
        assert r.hget(PREFIX + "defer:t2", "modes") == b"xll:2,5"
        holders[0].release()
        assert r.hget(PREFIX + "defer:t2", "state") == b"granted"
        outcome, leases = defer.adopt(mgr, "t2", 0)
        assert outcome == "adopted" and len(leases) == 1
        assert leases[0].exclusive == ("db",)
        assert leases[0].limited == {"api:x": 2, "api:y": 5}
        for lease in [*leases, holders[1]]:
            lease.release()
    finally:
        mgr.close()
    assert not r.keys(PREFIX + "lock:*")


def test_a_re_attempt_refused_for_a_resource_of_the_other_kind_fails_the_task_once(
    app: Celery, other: LockManager, redis_url: str, r: redis.Redis
) -> None:
    """A parked limited task whose resource is then held shared, as a process
    of a release without limited resources would hold it (it reads an ``l``
    holder as shared): the re-attempt's ``{-2, ...}`` withdraws the task and
    fails it with InvalidResource, once, instead of trying it again at every
    interval."""
    mgr = LockManager(redis_url, NS, owner_ttl=30)
    withdrawn: list[tuple[str, str, dict[str, Any]]] = []
    try:
        holder = other.acquire(limited={"api:x": 1})
        assert _park_limited(mgr, "t1", 1).outcome == "parked"
        # The slot's holder becomes a shared one (an older release's grant).
        r.hset(PREFIX + "lock:api:x", holder.token, f"s{holder.fencing_token}")
        dispatcher = Dispatcher(
            mgr,
            "inc1",
            publish=lambda *a: None,
            on_withdrawn=lambda tid, why, msg: withdrawn.append((tid, why, msg)),
        )
        dispatcher.handle("t1")
        [(task_id, why, message)] = withdrawn
        assert (task_id, why) == ("t1", "refused")
        assert "only ever taken limited" in message["refused"]
        assert not r.exists(PREFIX + "defer:t1") and not r.zscore(PREFIX + "deferred", "t1")
        assert r.zcard(PREFIX + "q:api:x") == 0
        dispatcher.handle("t1")  # nothing left to re-attempt
        assert len(withdrawn) == 1
        # What the worker's hook stores: FAILURE with InvalidResource.
        _record_withdrawn(app, "t1", why, message)
        result = app.AsyncResult("t1")
        assert result.state == "FAILURE" and isinstance(result.result, InvalidResource)
        assert "only ever taken limited" in str(result.result)
        holder.release()
    finally:
        mgr.close()


def test_the_locks_context_manager_takes_limited_resources_too(app: Celery) -> None:
    locks = RedisLock.of(app)
    assert locks is not None
    with locks.manager.lock(limited={"api:y": 3}) as lease:
        assert lease.limited == {"api:y": 3}
