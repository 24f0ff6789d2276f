"""UniqueTask with a real Redis broker and Celery's in-process test worker.

Real-subprocess tests (prefork children SIGKILLed, a worker SIGKILLed)
live in tests/e2e/test_unique_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery, chain, group, signals
from celery.contrib.testing.worker import start_worker

from celery_helpers import QUICK_NS as NS
from celery_helpers import QUICK_PREFIX as PREFIX
from celery_helpers import close_app, quick_app
from celery_redislock import (
    ConfigurationError,
    DuplicateTask,
    LockManager,
    RedisLock,
    TemplateError,
    UniqueTask,
    current_lease,
    locked,
)
from celery_redislock.integration.settings import load_config
from engine_helpers import wait_until


def make_app(redis_url: str, **conf: Any) -> Celery:
    app = quick_app(redis_url, "uq", NS, **conf)
    RedisLock(app)
    return app


@pytest.fixture
def app(quick_apps: Callable[..., Celery]) -> Celery:
    return quick_apps("uq")


def _make_unique_task(app: Celery, fun: Callable[..., None], **options: Any) -> None:
    """Make ``fun`` a UniqueTask of ``app`` (not shared with other apps) with
    ``options``, at once: a task is a lazy proxy until first used, and what
    its definition raises is raised here."""
    task = app.task(base=UniqueTask, shared=False, **options)(fun)
    _ = task.name


def holders(r: redis.Redis, key: str) -> list[str]:
    return [t.decode() for t in r.hkeys(PREFIX + "lock:unique:" + key)]


def test_default_key_normalises_the_arguments(app: Celery) -> None:
    @app.task(base=UniqueTask, name="uq.add")
    def add(x: int, y: int = 2, *rest: int, **kw: Any) -> int:
        return x + y

    k = add.unique_key_for
    assert k((1,)) == k((), {"x": 1}) == k((1, 2)) == k((), {"y": 2, "x": 1})
    assert k((1,)) != k((1, 3))
    assert k((1,), {"b": 1, "a": 2}) == k((1,), {"a": 2, "b": 1})
    assert k((1,)).startswith("uq.add:")
    long = k(("x" * 500,))
    assert long.startswith("uq.add:sha256:") and len(long) < 100
    with pytest.raises(TypeError, match="uq.add"):
        k((), {"nope": 1})


_KEY_SCRIPT = """
import json, sys
from celery import Celery
from celery_redislock import UniqueTask

app = Celery("keys", set_as_current=False)

@app.task(base=UniqueTask, name="uq.keyed", shared=False)
def keyed(x, y=None):
    pass

calls = [
    ({"b", "a", "c", "dd", "ee"},),
    (frozenset({"x", ("t", 1)}), [{"s", "t"}]),
    ({1: "a", "b": 2},),
    ({("k", 1): {"z", "y"}, None: 1},),
]
print(json.dumps([keyed.unique_key_for(c) for c in calls]))
"""


def test_default_key_is_the_same_in_every_process_whatever_the_hash_seed() -> None:
    """Sets (whose order follows the hash seed) and dicts whose keys JSON
    cannot sort give one key for equal arguments in every producer."""
    import subprocess
    import sys

    keys = set()
    for seed in ("1", "2", "3", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _KEY_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        keys.add(out.stdout)
    assert len(keys) == 1, keys
    [text] = keys
    assert len(json.loads(text)) == 4


def test_default_key_of_json_arguments_is_what_earlier_releases_computed(app: Celery) -> None:
    """Producers of two releases during an upgrade must agree on the key."""

    @app.task(base=UniqueTask, name="uq.compat")
    def compat(a: Any, b: Any = None) -> None:
        pass

    args = ({"z": [1, 2.5, None, True], "a": {"n": "x"}}, {3: "c", 1: "a"})
    old = json.dumps(
        {"a": args[0], "b": args[1]}, sort_keys=True, separators=(",", ":"), default=repr
    )
    assert compat.unique_key_for(args) == f"uq.compat:{old}"


def test_a_key_encoder_gives_uuid_decimal_and_datetime_the_key_of_their_text(
    app: Celery, r: redis.Redis
) -> None:
    import uuid
    from datetime import date, datetime, timedelta, timezone
    from decimal import Decimal

    from celery_redislock import normalise_key_value

    u = uuid.UUID("6f1c2a9e-3b7d-4e1a-9c55-0d2b8e4f7a10")
    at = datetime(2026, 5, 4, 3, 2, 1, tzinfo=timezone(timedelta(hours=2)))

    @app.task(base=UniqueTask, name="uq.plainenc")
    def plain(x: Any) -> None:
        pass

    # The default (no encoder) keeps the keys of earlier releases: the repr.
    assert plain.unique_key_for((u,)) == 'uq.plainenc:{"x":"' + repr(u) + '"}'
    assert plain.unique_key_for((u,)) != plain.unique_key_for((str(u),))

    @app.task(base=UniqueTask, unique_key_encoder=normalise_key_value, name="uq.enc")
    def enc(x: Any, y: Any = None) -> None:
        pass

    k = enc.unique_key_for
    assert k((u,)) == k((str(u),)) == k((), {"x": str(u)})
    assert k((Decimal("1.5"),)) == k(("1.5",)) != k((Decimal("1.50"),))
    assert k((at,)) == k((at.isoformat(),))
    assert k((date(2026, 5, 4),)) == k(("2026-05-04",))
    assert k(([u, {"d": Decimal("2")}],)) == k(([str(u), {"d": "2"}],))  # nested too
    assert k(({u},)) == k(({str(u)},))
    assert k((1, 2.5)) == 'uq.enc:{"x":1,"y":2.5}'  # JSON data: as without an encoder
    first = enc.delay(u)
    assert enc.delay(str(u)).id == first.id  # a duplicate through the broker path too

    class Unique(UniqueTask):  # a project's base: one encoder for its tasks
        abstract = True
        unique_key_encoder = staticmethod(normalise_key_value)

    @app.task(base=Unique, name="uq.baseenc")
    def baseenc(x: Any) -> None:
        pass

    assert baseenc.unique_key_for((u,)) == baseenc.unique_key_for((str(u),))

    class Encoder(json.JSONEncoder):  # celery-singleton's singleton_json_encoder_class
        def default(self, o: Any) -> Any:
            if isinstance(o, uuid.UUID):
                return o.hex
            return super().default(o)  # raises TypeError: the repr, as ever

    @app.task(base=UniqueTask, unique_key_encoder=Encoder, name="uq.jenc")
    def jenc(x: Any) -> None:
        pass

    assert jenc.unique_key_for((u,)) == jenc.unique_key_for((u.hex,))
    assert jenc.unique_key_for((Decimal("1"),)) == 'uq.jenc:{"x":"Decimal(\'1\')"}'

    def same(value: Any) -> Any:
        return value

    @app.task(base=UniqueTask, unique_key_encoder=same, name="uq.same")
    def bad(x: Any) -> None:
        pass

    with pytest.raises(TypeError, match="unique_key_encoder returned a UUID"):
        bad.unique_key_for((u,))
    other = Celery("bad", set_as_current=False)  # its refused task stays pending there

    def notenc(x: Any) -> None:
        pass

    with pytest.raises(ConfigurationError, match="uq.notenc.unique_key_encoder"):
        _make_unique_task(other, notenc, unique_key_encoder="json", name="uq.notenc")


def test_default_key_takes_mixed_dict_keys_and_refuses_a_value_only_a_memory_address_names(
    app: Celery, r: redis.Redis
) -> None:
    @app.task(base=UniqueTask, name="uq.mixed")
    def mixed(opts: Any) -> None:
        pass

    first = mixed.delay({1: "a", "b": 2})
    assert mixed.delay({"b": 2, 1: "a"}).id == first.id  # the same key: a duplicate
    assert mixed.delay({1: "a", "b": 3}).id != first.id
    assert mixed.unique_key_for(({"s", "t"},)) == mixed.unique_key_for(({"t", "s"},))

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"argument 'opts'\[0\] is a .*Opaque.*unique_key") as info:
        mixed.delay([Opaque()])
    assert "uq.mixed" in str(info.value)
    assert r.llen(app.conf.task_default_queue) == 2  # nothing sent for the refused call


def test_template_key_and_options_are_checked_at_import(app: Celery) -> None:
    @app.task(base=UniqueTask, unique_key="report:{user_id}", name="uq.report")
    def report(user_id: int, fmt: str = "pdf") -> None:
        pass

    assert report.unique_key_for((7,), {"fmt": "csv"}) == "report:7"
    app = Celery("bad", set_as_current=False)  # its refused tasks stay pending there

    def bad1(user_id: int) -> None:
        pass

    def bad2() -> None:
        pass

    with pytest.raises(TemplateError, match="^unique_key template 'r:{nope}'.*nope"):
        _make_unique_task(app, bad1, unique_key="r:{nope}", name="uq.bad1")
    with pytest.raises(ConfigurationError, match="unique_on_duplicate"):
        _make_unique_task(app, bad2, unique_on_duplicate="ignore", name="uq.bad2")
    with pytest.raises(ConfigurationError, match="unique_ttl"):
        _make_unique_task(app, bad2, unique_ttl=-1, name="uq.bad3")


@pytest.mark.parametrize("value", [-1, 0, "soon", 10**9])
def test_bad_unique_ttl_setting_is_refused(redis_url: str, value: object) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_config({"broker_url": redis_url, "redislock_unique_ttl": value})
    assert info.value.setting == "redislock_unique_ttl"
    assert load_config({"broker_url": redis_url}).unique_ttl == 3600.0
    assert load_config({"broker_url": redis_url, "redislock_unique_ttl": "5"}).unique_ttl == 5.0


def test_a_duplicate_while_queued_returns_the_queued_task_or_raises(
    app: Celery, r: redis.Redis
) -> None:
    @app.task(base=UniqueTask, unique_key="rep:{n}", name="uq.rep")
    def rep(n: int) -> int:
        return n

    @app.task(base=UniqueTask, unique_key="rep:{n}", unique_on_duplicate="raise", name="uq.rep2")
    def rep2(n: int) -> int:
        return n

    first = rep.delay(1)
    assert rep.delay(1).id == first.id
    assert rep.apply_async((1,)).id == first.id
    assert rep.s(1).delay().id == first.id
    assert rep.delay(2).id != first.id  # another key
    # The same task id sent twice (celery-once's QueueOnceId) is one task.
    named = rep.apply_async((3,), task_id="report-3")
    assert named.id == "report-3"
    assert rep.apply_async((3,), task_id="report-3").id == "report-3"
    with pytest.raises(DuplicateTask):
        rep2.apply_async((3,), task_id="report-3")
    # Sent: rep(1), rep(2), rep(3) once; no duplicate reached the broker.
    assert r.llen(app.conf.task_default_queue) == 3
    with pytest.raises(DuplicateTask) as info:
        rep2.delay(1)  # same key, another task: still a duplicate
    assert info.value.task_id == first.id and info.value.key == "rep:1"
    assert holders(r, "rep:1") == [f"task:{first.id}|task:{first.id}"]
    ttl = r.pttl(PREFIX + f"alive:task:{first.id}")
    assert 3_500_000 < ttl <= 3_600_000  # redislock_unique_ttl's default


def test_a_duplicate_says_when_the_key_of_a_queued_task_frees(
    app: Celery, r: redis.Redis, redis_url: str
) -> None:
    @app.task(base=UniqueTask, unique_key="cd", unique_ttl=100, name="uq.cd")
    def cd() -> None:
        pass

    @app.task(base=UniqueTask, unique_key="cd", unique_on_duplicate="raise", name="uq.cd2")
    def cd2() -> None:
        pass

    first = cd.apply_async(countdown=50)
    with pytest.raises(DuplicateTask) as info:
        cd2.delay()
    exc = info.value
    assert exc.task_id == first.id
    assert exc.countdown is not None and 140 < exc.countdown <= 150  # unique_ttl + countdown
    assert "frees in" in str(exc) and "countdown" in str(exc)
    # Once a process runs the task (adopts the key), the key lives as long as
    # that process: no fixed time is known.
    worker = LockManager(redis_url, NS, owner_ttl=30)
    try:
        adoption = worker.adopt(first.id)
        assert adoption.adopted
        with pytest.raises(DuplicateTask) as info:
            cd2.delay()
        assert info.value.task_id == first.id and info.value.countdown is None
        assert "when that task ends" in str(info.value)
        for lease in adoption.leases:
            lease.release()
    finally:
        worker.close()


def test_per_call_options_override_the_task_attributes_for_that_call_only(
    app: Celery, r: redis.Redis
) -> None:
    @app.task(base=UniqueTask, unique_key="pc:{n}", unique_ttl=100, name="uq.pc")
    def pc(n: int) -> None:
        pass

    first = pc.apply_async((1,), unique_ttl=30)
    assert 25_000 < r.pttl(PREFIX + f"alive:task:{first.id}") <= 30_000
    assert pc.delay(1).id == first.id  # the attribute: "return"
    with pytest.raises(DuplicateTask) as info:
        pc.apply_async((1,), unique_on_duplicate="raise")
    assert info.value.task_id == first.id
    assert pc.s(1).set(unique_on_duplicate="return").delay().id == first.id
    with pytest.raises(DuplicateTask):
        pc.s(1).apply_async(unique_on_duplicate="raise")  # a signature call
    second = pc.apply_async((2,), unique_ttl=None, unique_on_duplicate=None)  # the task's
    assert 95_000 < r.pttl(PREFIX + f"alive:task:{second.id}") <= 100_000
    third = pc.apply_async((3,), countdown=50, unique_ttl=10)  # a countdown is added
    assert 55_000 < r.pttl(PREFIX + f"alive:task:{third.id}") <= 60_000
    # Celery never saw the options: not in any message sent.
    messages = r.lrange(app.conf.task_default_queue, 0, -1)
    assert len(messages) == 3 and not any(b"unique_" in m for m in messages)


def test_bad_per_call_options_are_refused_before_any_redis_call() -> None:
    down = make_app("redis://127.0.0.1:1/0")  # nothing listens: any call would fail
    try:

        @down.task(base=UniqueTask, unique_key="bad", name="uq.badcall")
        def bad() -> None:
            pass

        with pytest.raises(ConfigurationError, match="unique_key.*per call"):
            bad.apply_async(unique_key="other")
        with pytest.raises(ConfigurationError, match="unique_tll.*unique_on_duplicate, unique_ttl"):
            bad.apply_async(unique_tll=5)
        with pytest.raises(ConfigurationError, match="unique_on_duplicate.*'ignore'"):
            bad.apply_async(unique_on_duplicate="ignore")
        with pytest.raises(ConfigurationError, match="unique_ttl"):
            bad.apply_async(unique_ttl=-1)
        with pytest.raises(ConfigurationError, match="unique_ttl"):
            bad.s().apply_async(unique_ttl=10**9)
    finally:
        close_app(down)


def test_a_failed_send_releases_the_key(app: Celery, r: redis.Redis) -> None:
    @app.task(base=UniqueTask, unique_key="k", name="uq.send")
    def send() -> None:
        pass

    from kombu.exceptions import SerializerNotInstalled

    with pytest.raises(SerializerNotInstalled):
        send.apply_async(serializer="no-such-serializer", task_id="never-sent")
    assert holders(r, "k") == []
    sent = send.delay()  # not a duplicate of the message never sent: sent, under a new id
    assert sent.id != "never-sent"
    assert holders(r, "k") == [f"task:{sent.id}|task:{sent.id}"]
    assert r.llen(app.conf.task_default_queue) == 1


def test_a_message_never_run_frees_its_key_after_unique_ttl(app: Celery, r: redis.Redis) -> None:
    @app.task(base=UniqueTask, unique_key="k", unique_ttl=0.3, name="uq.lost")
    def lost() -> None:
        pass

    first = lost.delay()
    wait_until(lambda: not r.exists(PREFIX + f"alive:task:{first.id}"), what="unique_ttl")
    second = lost.delay()
    assert second.id != first.id
    assert holders(r, "k") == [f"task:{second.id}|task:{second.id}"]


def test_countdown_extends_the_key_ttl(app: Celery, r: redis.Redis) -> None:
    @app.task(base=UniqueTask, unique_key="k", unique_ttl=10, name="uq.later")
    def later() -> None:
        pass

    res = later.apply_async(countdown=100)
    assert r.pttl(PREFIX + f"alive:task:{res.id}") > 100_000


def test_an_eta_extends_the_key_ttl_past_the_eta(app: Celery, r: redis.Redis) -> None:
    from datetime import datetime, timedelta, timezone

    @app.task(base=UniqueTask, unique_key="k", unique_ttl=10, name="uq.eta")
    def at() -> None:
        pass

    res = at.apply_async(eta=datetime.now(timezone.utc) + timedelta(seconds=100))
    assert 100_000 < r.pttl(PREFIX + f"alive:task:{res.id}") <= 110_000
    other = at.apply_async(  # a naive eta is UTC, as Celery reads it
        eta=datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=200),
        task_id="eta-2",
        queue="uq.nobody",
    )
    assert other.id == res.id  # a duplicate: nothing sent
    assert r.llen(app.conf.task_default_queue) == 1


def test_a_key_held_by_a_plain_lock_is_a_duplicate_not_a_handle_of_no_task(
    app: Celery, r: redis.Redis, redis_url: str
) -> None:
    @app.task(base=UniqueTask, unique_key="plain", name="uq.plainlock")
    def plain() -> None:
        pass

    other = LockManager(redis_url, NS, owner_ttl=30)
    try:
        lease = other.acquire("unique:plain")
        with pytest.raises(DuplicateTask) as info:
            plain.delay()  # unique_on_duplicate="return": there is no task to return
        assert info.value.task_id is None and info.value.key == "plain"
        assert info.value.countdown is None
        assert r.llen(app.conf.task_default_queue) == 0
        lease.release()
        sent = plain.delay()
        assert holders(r, "plain") == [f"task:{sent.id}|task:{sent.id}"]
    finally:
        other.close()


def test_a_revoked_retry_message_frees_the_key_of_its_attempt(app: Celery, r: redis.Redis) -> None:
    """A retry's message (attempt 1, its own task owner task+1:<id>) revoked
    before it runs: the worker discards it and frees that attempt's key."""
    from celery.worker import state

    @app.task(base=UniqueTask, unique_key="rv1", name="uq.rv1")
    def rv1() -> None:
        pass

    res = rv1.apply_async(retries=1)  # as self.retry() sends it
    assert holders(r, "rv1") == [f"task+1:{res.id}|task:{res.id}"]
    state.revoked.add(res.id)
    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            wait_until(lambda: res.state == "REVOKED", what="revoked")
            wait_until(lambda: holders(r, "rv1") == [], what="the attempt's key freed")
    finally:
        state.revoked.discard(res.id)


def test_worker_adopts_the_key_runs_once_and_frees_it(app: Celery, r: redis.Redis) -> None:
    seen: dict[str, Any] = {}
    gate: list[bool] = []

    @app.task(base=UniqueTask, bind=True, unique_key="job:{n}", name="uq.job")
    def job(self: Any, n: int) -> str:
        seen["holders"] = holders(r, f"job:{n}")
        lease = self.unique_lease
        seen["lease"] = (lease.token, lease.fencing_token, lease.lost) if lease else None
        seen["dup"] = job.delay(n).id  # a duplicate while running
        wait_until(lambda: gate, what="the test lets the task finish")
        return self.request.id

    @app.task(base=UniqueTask, unique_key="bad", name="uq.boom")
    def boom() -> None:
        raise RuntimeError("boom")

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        res = job.delay(1)
        wait_until(lambda: "dup" in seen, what="task running")
        assert seen["dup"] == res.id
        [token] = seen["holders"]
        owner, rid = token.split("|")
        assert rid == f"task:{res.id}" and not owner.startswith("task")  # adopted
        assert seen["lease"] is not None and seen["lease"][0] == token and not seen["lease"][2]
        assert job.unique_lease is None  # outside the body
        assert job.delay(1).id == res.id  # while running, from outside
        gate.append(True)
        assert res.get(timeout=20) == res.id
        assert holders(r, "job:1") == []
        assert not r.exists(PREFIX + f"alive:task:{res.id}")
        assert r.exists(PREFIX + f"dead:task:{res.id}")
        again = job.delay(1)
        assert again.id != res.id
        gate.append(True)
        again.get(timeout=20)
        failed = boom.delay()
        with pytest.raises(RuntimeError):
            failed.get(timeout=20, propagate=True)
        assert holders(r, "bad") == []
    assert not r.keys(PREFIX + "lock:*")


def test_a_retry_keeps_the_key_until_the_last_attempt(app: Celery, r: redis.Redis) -> None:
    attempts: list[int] = []
    during: list[list[str]] = []

    @app.task(base=UniqueTask, bind=True, unique_key="flaky", max_retries=3, name="uq.flaky")
    def flaky(self: Any) -> int:
        attempts.append(self.request.retries)
        during.append(holders(r, "flaky"))
        if self.request.retries < 2:
            raise self.retry(countdown=0.2)
        return self.request.retries

    @app.task(base=UniqueTask, bind=True, unique_key="doomed", max_retries=1, name="uq.doomed")
    def doomed(self: Any) -> None:
        raise self.retry(countdown=0, exc=ValueError("no"))

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        res = flaky.delay()
        # Between attempts the key is the retry's task owner's: a duplicate
        # still gets the same task.
        wait_until(
            lambda: any(h.startswith("task+") for h in holders(r, "flaky")),
            what="the retry's message holds the key",
        )
        assert flaky.delay().id == res.id
        assert res.get(timeout=20) == 2
        assert attempts == [0, 1, 2]
        assert all(len(h) == 1 and h[0].endswith(f"|task:{res.id}") for h in during)
        assert holders(r, "flaky") == []
        d = doomed.delay()
        with pytest.raises(ValueError):
            d.get(timeout=20)
        assert holders(r, "doomed") == []  # retries exhausted: freed


def test_an_expired_message_frees_its_key_when_the_worker_discards_it(
    app: Celery, r: redis.Redis
) -> None:
    ran: list[int] = []

    @app.task(base=UniqueTask, unique_key="exp", name="uq.exp")
    def exp() -> None:
        ran.append(1)

    res = exp.apply_async(expires=0.3)
    deadline = time.time() + 0.3
    wait_until(lambda: time.time() > deadline + 0.05, what="the message expired")
    assert holders(r, "exp") == [f"task:{res.id}|task:{res.id}"]
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        wait_until(lambda: holders(r, "exp") == [], what="task_revoked freed the key")
    assert ran == []


def test_a_revoked_queued_message_frees_its_key_when_the_worker_discards_it(
    app: Celery, r: redis.Redis
) -> None:
    """Revoke of a queued message: the worker discards it and frees its key.

    The in-process worker takes no broadcast here: the id goes straight into
    its revoked set, as the revoke command does (e2e sends a real revoke).
    """
    from celery.worker import state

    @app.task(base=UniqueTask, unique_key="rv", name="uq.rv")
    def rv() -> None:
        pass

    res = rv.delay()
    state.revoked.add(res.id)  # before the worker receives the message
    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            wait_until(lambda: holders(r, "rv") == [], what="the revoked message's key freed")
            wait_until(lambda: res.state == "REVOKED", what="revoked")
    finally:
        state.revoked.discard(res.id)


def test_eager_mode_behaves_the_same(redis_url: str, r: redis.Redis) -> None:
    app = make_app(redis_url, task_always_eager=True)
    try:
        inner: list[str] = []

        @app.task(base=UniqueTask, bind=True, unique_key="er", max_retries=2, name="uq.eretry")
        def eretry(self: Any) -> int:
            inner.extend(holders(r, "er"))
            if self.request.retries < 1:
                raise self.retry(countdown=0)
            return self.request.retries

        @app.task(base=UniqueTask, bind=True, unique_key="e:{n}", name="uq.eager")
        def eager(self: Any, n: int) -> str:
            inner.append(eager.delay(n).id)  # a duplicate while it runs
            inner.extend(holders(r, f"e:{n}"))
            return self.request.id

        res = eager.delay(1)
        assert res.get() == res.id
        assert inner[0] == res.id and inner[1].endswith(f"|task:{res.id}")
        assert holders(r, "e:1") == []
        assert eager.delay(1).id != res.id
        inner.clear()
        retried = eretry.delay()
        assert retried.get() == 1
        assert len(inner) == 2 and all(t.endswith(f"|task:{retried.id}") for t in inner)
        assert holders(r, "er") == []
    finally:
        close_app(app)


def test_chain_and_group(app: Celery, r: redis.Redis) -> None:
    @app.task(base=UniqueTask, name="uq.step")
    def step(n: int) -> int:
        return n + 1

    @app.task(name="uq.plain")
    def plain(n: int) -> int:
        return n * 10

    # Without a worker: a group sends each member through apply_async, so
    # identical members are one message; the chain's first task holds its key.
    g = group(step.s(1), step.s(1), step.s(2)).apply_async()
    ids = [x.id for x in g.results]
    assert len(holders(r, step.unique_key_for((1,)))) == 1
    assert holders(r, step.unique_key_for((1,)))[0] == f"task:{ids[0]}|task:{ids[0]}"
    assert holders(r, step.unique_key_for((2,)))[0] == f"task:{ids[2]}|task:{ids[2]}"
    c = chain(step.s(5), plain.s()).apply_async()
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert c.get(timeout=20) == 60
        assert g.results[0].get(timeout=20) == 2 and g.results[2].get(timeout=20) == 3
        # A chain whose later step is unique: sent by the worker, same rules.
        assert chain(plain.s(1), step.s()).apply_async().get(timeout=20) == 11
    assert not r.keys(PREFIX + "lock:*")


def test_unique_task_with_locked_body(app: Celery, r: redis.Redis) -> None:
    @app.task(base=UniqueTask, bind=True, unique_key="u:{n}", name="uq.both")
    @locked("res:{n}")
    def both(self: Any, n: int) -> list[str]:
        lease = current_lease()
        assert lease is not None
        return sorted(holders(r, f"u:{n}") + [t.decode() for t in r.hkeys(PREFIX + "lock:res:1")])

    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        out = both.delay(1).get(timeout=20)
    assert len(out) == 2 and len({t.split("|")[0] for t in out}) == 1  # one process holds both
    assert not r.keys(PREFIX + "lock:*")


def test_a_redelivered_message_whose_key_was_freed_takes_it_again(
    app: Celery, r: redis.Redis, redis_url: str
) -> None:
    """A message whose task owner is gone (adopted by a process that died,
    then freed) still runs, and takes its key again for the run."""
    seen: list[list[str]] = []

    @app.task(base=UniqueTask, unique_key="rd", name="uq.rd")
    def rd() -> None:
        seen.append(holders(r, "rd"))

    res = rd.delay()
    dead = LockManager(redis_url, NS, owner_ttl=30)
    assert dead.adopt(res.id).adopted  # a process adopted it ...
    dead.cleanup_owner(dead.owner_id, force=True)  # ... and died; its locks freed
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        res.get(timeout=20)
    assert len(seen[0]) == 1 and seen[0][0].endswith(f"|task:{res.id}")
    assert holders(r, "rd") == []
    dead.close()


def test_a_redelivered_message_frees_the_key_a_dead_pool_sibling_adopted(
    app: Celery, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool child adopted the key and was SIGKILLed; its message comes back
    to another process of the same worker before the node's clean-up of the
    dead child. The key's holder is provably dead (a process of this
    worker's group that no longer runs): the redelivered run frees it and
    takes the key, instead of running without it."""
    seen: list[str] = []

    @app.task(base=UniqueTask, unique_key="sib", name="uq.sib")
    def sib() -> None:
        seen.extend(holders(r, "sib"))

    res = sib.apply_async(queue="uq.nobody")  # queued; nobody consumes it
    locks = RedisLock.of(app)
    assert locks is not None
    mgr = locks.enter_worker("fedcba9876543210")
    try:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - reports through the pipe, then is killed
            code = 1
            try:
                signals.worker_process_init.send(sender=None)  # a pool child
                child = locks.manager
                status = child.adopt(res.id).status
                os.write(write_fd, json.dumps([status, child.owner_id]).encode())
                code = 0
                time.sleep(600)  # until killed
            finally:
                os._exit(code)
        os.close(write_fd)
        status, child_owner = json.loads(os.read(read_fd, 4096) or b'["", ""]')
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_fd)
        assert status == "adopted"
        assert holders(r, "sib") == [f"{child_owner}|task:{res.id}"]
        with caplog.at_level(logging.INFO, logger="celery_redislock"):
            sib.apply(task_id=res.id)  # the redelivery, run by this process
        assert seen == [f"{mgr.owner_id}|task:{res.id}"], caplog.text
        assert "unique.key-retaken" in caplog.text
        assert f"owner={child_owner}" in caplog.text  # the dead sibling's clean-up is logged
        assert holders(r, "sib") == []
    finally:
        locks.leave_worker()
        mgr.close()


def test_an_adopt_interrupted_after_redis_moved_the_key_releases_it(
    redis_url: str, r: redis.Redis
) -> None:
    """A soft time limit striking just after adopt.lua ran (its reply lost
    to the interrupt): the key must not stay with this long-lived process."""
    from celery.exceptions import SoftTimeLimitExceeded

    app = make_app(redis_url, task_always_eager=True)
    try:

        @app.task(base=UniqueTask, unique_key="cut", name="uq.cut")
        def cut() -> None:
            pass

        mgr = RedisLock.of(app).manager  # type: ignore[union-attr]
        real = mgr.tasks.run_adopt
        calls: list[int] = []

        def interrupted(*args: Any) -> Any:
            reply = real(*args)
            calls.append(1)
            if len(calls) == 1:
                raise SoftTimeLimitExceeded()
            return reply

        mgr.tasks.run_adopt = interrupted  # type: ignore[method-assign]
        res = cut.delay()
        with pytest.raises(SoftTimeLimitExceeded):
            res.get()
        assert holders(r, "cut") == []
        assert len(calls) == 2  # adopted again, and released
    finally:
        close_app(app)


def test_a_deferred_unique_task_keeps_its_key_while_parked_and_runs_when_handed_the_lock(
    app: Celery, r: redis.Redis, redis_url: str
) -> None:
    """UniqueTask over @locked(on_busy="defer"), in-process worker: parked,
    the key stays with the message's task owner (a duplicate gets the parked
    task); handed the lock, the re-dispatched copy adopts its grant and the
    key, and runs. tests/e2e/test_defer_e2e.py runs it with prefork too."""
    seen: dict[str, Any] = {}

    @app.task(base=UniqueTask, bind=True, unique_key="ud", name="uq.udefer")
    @locked("res:ud", on_busy="defer")
    def udefer(self: Any) -> str:
        lease = self.unique_lease
        seen["key"] = lease.token if lease is not None else None
        seen["holders"] = holders(r, "ud")
        return str(self.request.id)

    other = LockManager(redis_url, NS, owner_ttl=30)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
            blocker = other.acquire("res:ud")
            res = udefer.delay()
            wait_until(lambda: res.state == "DEFERRED", what="parked")
            assert holders(r, "ud") == [f"task:{res.id}|task:{res.id}"]
            assert r.pttl(PREFIX + f"alive:task:{res.id}") > 3_600_000  # covers the park
            assert udefer.delay().id == res.id
            blocker.release()
            assert res.get(timeout=20) == res.id
        assert seen["holders"] == [seen["key"]] and seen["key"].endswith(f"|task:{res.id}")
        assert not seen["key"].startswith("task")  # taken over by the process
        assert holders(r, "ud") == []
    finally:
        other.close()
