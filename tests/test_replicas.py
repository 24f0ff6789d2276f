"""``wait_replicas``: a grant is on N replicas before ``acquire`` returns.

A real master and one real replica (``--replicaof``) for the module. The
replica is read directly to see what it has; SIGSTOP pauses it so that the
master's ``WAIT`` gets no acknowledgement (SIGCONT in teardown). What a user
relies on:

- with a healthy replica, acquire returns only once the replica holds the
  grant, on the script path and on the hand-off path;
- with the replica paused, the grant is released and the acquire fails with
  ReplicationTimeout (``wait_policy="fail"``) or asks again until its own
  timeout (``"retry"``); nothing stays held on the master (lock hash,
  registry, queue);
- ``wait_replicas=0`` (the default) sends no ``WAIT``; ``wait_replicas=1``
  sends one per acquire attempt, in the attempt's own pipeline;
- ``redislock_wait_*`` settings reach the manager of ``RedisLock(app)``,
  and bad values are refused with the setting's name.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_redislock import (
    ConfigurationError,
    LockManager,
    LockTimeout,
    PermissionDenied,
    RedisLock,
    ReplicationTimeout,
    ShuttingDown,
)
from celery_redislock.integration.settings import load_config
from celery_redislock.worker.node import halt_key, new_incarnation
from engine_helpers import (
    Managers,
    assert_registry_truth,
    command_delta,
    commandstats,
    kinds,
    lock_holders,
    namespace_keys,
    wait_until,
)
from redis_server import LOOPBACK
from replica_helpers import Pair

NS = "t"
LOCK = "{t}:lock:res"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("replicas"))
    try:
        wait_until(p.in_sync, what="the replica to sync with the master")
        yield p
    finally:
        p.close()


@pytest.fixture
def fresh(pair: Pair) -> Iterator[Pair]:
    """The pair with an empty master (and replica), resumed after the test."""
    pair.m.flushall()
    wait_until(lambda: pair.in_sync() and not pair.r.dbsize(), what="the replica to empty")
    try:
        yield pair
    finally:
        pair.resume_replica()
        wait_until(pair.in_sync, what="the replica to come back")


def _wait_replicas_app(fresh: Pair, main: str) -> Celery:
    """A quick Celery app with locks on ``fresh``'s master, waiting for 1
    replica (0.2 s at most) after each write."""
    from celery_helpers import quick_app

    app = quick_app(
        fresh.master.url, main, NS, redislock_wait_replicas=1, redislock_wait_timeout=0.2
    )
    RedisLock(app)
    return app


@pytest.fixture
def managers(fresh: Pair) -> Iterator[Managers]:
    made = Managers(fresh.master.url, namespace=NS)
    yield made
    made.close_all()


def assert_nothing_held(p: Pair) -> None:
    """No lock hash, registry, queue or request state left on the master."""
    left = kinds(namespace_keys(p.m, NS), NS)
    assert not left & {"lock", "held", "q", "req", "wake"}, sorted(namespace_keys(p.m, NS))
    assert_registry_truth(p.m, NS)


def test_grant_is_on_the_replica_when_acquire_returns(fresh: Pair, managers: Managers) -> None:
    mgr = managers(wait_replicas=1, wait_timeout=2.0)
    lease = mgr.acquire("res", timeout=5)
    # Read straight from the replica, with no wait: WAIT already confirmed it.
    on_replica = {k.decode(): v for k, v in fresh.r.hgetall(LOCK).items()}
    assert lease.token in on_replica
    lease.release()


def test_handed_off_grant_is_on_the_replica_when_acquire_returns(
    fresh: Pair, managers: Managers
) -> None:
    holder_mgr = managers()
    holder_mgr.acquire("warm").release()  # scripts loaded: no NOSCRIPT below
    holder = holder_mgr.acquire("res")
    waiter = managers(wait_replicas=1, wait_timeout=2.0)
    got: dict[str, Any] = {}

    def wait() -> None:
        lease = waiter.acquire("res", timeout=20)
        got["token"] = lease.token
        got["on_replica"] = {k.decode() for k in fresh.r.hgetall(LOCK)}
        got["lease"] = lease

    t = threading.Thread(target=wait)
    t.start()
    wait_until(lambda: fresh.m.zcard("{t}:q:res") == 1, what="the waiter to queue")
    before = commandstats(fresh.m)
    holder.release()
    t.join(20)
    assert not t.is_alive()
    delta = command_delta(before, commandstats(fresh.m))
    assert got["token"] in got["on_replica"]
    # Handed over by the release (no second acquire script), then one WAIT.
    assert delta.get("evalsha") == 1 and delta.get("wait") == 1, delta
    got["lease"].release()


def test_paused_replica_fails_the_acquire_and_leaves_nothing_held(
    fresh: Pair, managers: Managers
) -> None:
    mgr = managers(wait_replicas=1, wait_timeout=0.2)
    fresh.pause_replica()
    with pytest.raises(ReplicationTimeout) as err:
        mgr.acquire("res", timeout=5)
    assert err.value.wanted == 1 and err.value.acknowledged == 0
    assert isinstance(err.value, LockTimeout)
    assert "0 of 1 replicas" in str(err.value)
    assert_nothing_held(fresh)
    # Another owner without wait_replicas gets the lock at once.
    managers().acquire("res", timeout=0).release()


def test_paused_replica_retry_policy_asks_again_until_the_timeout(
    fresh: Pair, managers: Managers
) -> None:
    mgr = managers(wait_replicas=1, wait_timeout=0.1, wait_policy="retry")
    fresh.pause_replica()
    before = commandstats(fresh.m)
    with pytest.raises(ReplicationTimeout) as err:
        mgr.acquire("res", timeout=0.5)
    delta = command_delta(before, commandstats(fresh.m))
    assert err.value.acknowledged == 0
    assert delta.get("wait", 0) >= 2, delta  # granted, released and asked again
    assert_nothing_held(fresh)


def test_retry_policy_without_timeout_gives_way_to_a_worker_shutdown(
    fresh: Pair, managers: Managers
) -> None:
    # @locked's wait in a worker (halt_ok) with timeout=None and the replica
    # down: a warm shutdown (the halt list) must still end it.
    mgr = managers(wait_replicas=1, wait_timeout=0.05, wait_policy="retry")
    mgr.acquirer.halt_key = halt_key("{t}:", new_incarnation())
    fresh.pause_replica()
    out: list[BaseException] = []

    def wait() -> None:
        try:
            with mgr.context.using(haltable=True):
                mgr.acquire("res", timeout=None)
        except BaseException as exc:
            out.append(exc)

    before = commandstats(fresh.m)
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    wait_until(
        lambda: command_delta(before, commandstats(fresh.m)).get("wait", 0) >= 2,
        what="the acquire to be refused by the replicas twice",
    )
    fresh.m.rpush(mgr.acquirer.halt_key, "halt")
    t.join(20)
    assert not t.is_alive()
    assert len(out) == 1 and isinstance(out[0], ShuttingDown), out
    assert_nothing_held(fresh)


def test_paused_replica_fails_a_handed_off_grant_and_leaves_nothing_held(
    fresh: Pair, managers: Managers
) -> None:
    holder = managers().acquire("res")
    waiter = managers(wait_replicas=1, wait_timeout=0.2)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.acquire("res", timeout=20)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    wait_until(lambda: fresh.m.zcard("{t}:q:res") == 1, what="the waiter to queue")
    wait_until(lambda: fresh.m.info("clients")["blocked_clients"] == 1, what="the waiter to block")
    # The replica has acknowledged everything up to now, the waiter's BLPOP
    # included: a WAIT that counted from the BLPOP's offset, not the grant's,
    # would wrongly report the paused replica.
    pipe = fresh.m.pipeline(transaction=False)
    pipe.ping()
    pipe.wait(1, 5000)
    assert pipe.execute()[1] == 1
    fresh.pause_replica()
    holder.release()
    t.join(20)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ReplicationTimeout), errors
    assert_nothing_held(fresh)


def test_replica_back_after_a_pause_grants_again(fresh: Pair, managers: Managers) -> None:
    # "retry": timeout=0 tries once; the acquire after the pause rides out a
    # WAIT that a loaded machine lets run out.
    mgr = managers(wait_replicas=1, wait_timeout=0.2, wait_policy="retry")
    fresh.pause_replica()
    with pytest.raises(ReplicationTimeout):
        mgr.acquire("res", timeout=0)
    fresh.resume_replica()
    wait_until(fresh.in_sync, what="the replica to come back")
    with mgr.lock("res", timeout=20) as lease:
        assert lease.token in {k.decode() for k in fresh.r.hgetall(LOCK)}


def test_an_acl_that_denies_wait_fails_the_acquire_and_leaves_nothing_held(
    fresh: Pair, managers: Managers
) -> None:
    # The namespace ACL of docs/operations.md (its +@connection allows WAIT),
    # with WAIT taken away.
    fresh.m.acl_setuser(
        "locks",
        enabled=True,
        passwords=["+secret"],
        keys=["{t}:*"],
        commands=["-@all", "+@read", "+@write", "+@scripting", "+@connection", "+blpop"]
        + ["+info", "+time", "-wait"],
    )
    try:
        url = f"redis://locks:secret@{LOOPBACK}:{fresh.master.port}/0"
        mgr = managers(url, wait_replicas=1, wait_timeout=1.0)
        with pytest.raises(PermissionDenied, match="WAIT"):
            mgr.acquire("res", timeout=5)
        assert_nothing_held(fresh)
    finally:
        fresh.m.acl_deluser("locks")


def test_no_wait_is_sent_without_wait_replicas(fresh: Pair, managers: Managers) -> None:
    mgr = managers()
    mgr.acquire("warm", timeout=0).release()  # registration and script load
    before = commandstats(fresh.m)
    mgr.acquire("res", timeout=0).release()
    delta = command_delta(before, commandstats(fresh.m))
    assert delta["evalsha"] == 2 and "wait" not in delta, delta


def test_one_wait_per_attempt_with_wait_replicas(fresh: Pair, managers: Managers) -> None:
    mgr = managers(wait_replicas=1, wait_timeout=2.0)
    mgr.acquire("warm", timeout=0).release()
    before = commandstats(fresh.m)
    mgr.acquire("res", timeout=0).release()
    delta = command_delta(before, commandstats(fresh.m))
    # One WAIT, in the acquire's pipeline; release does not WAIT.
    assert delta["evalsha"] == 2 and delta["wait"] == 1, delta


def test_wait_survives_script_flush(fresh: Pair, managers: Managers) -> None:
    mgr = managers(wait_replicas=1, wait_timeout=2.0)
    mgr.acquire("warm", timeout=0).release()
    fresh.m.script_flush()
    with mgr.lock("res", timeout=5) as lease:
        assert lease.token in {k.decode() for k in fresh.r.hgetall(LOCK)}
    assert lock_holders(fresh.m, NS) == {}


@pytest.mark.parametrize(
    ("kwargs", "setting", "text"),
    [
        ({"wait_replicas": -1}, "wait_replicas", "0..100"),
        ({"wait_replicas": True}, "wait_replicas", "non-negative int"),
        ({"wait_replicas": 1.0}, "wait_replicas", "non-negative int"),
        ({"wait_replicas": 101}, "wait_replicas", "0..100"),
        ({"wait_timeout": 0}, "wait_timeout", "0.001.."),
        ({"wait_timeout": float("inf")}, "wait_timeout", "0.001.."),
        ({"wait_timeout": float("nan")}, "wait_timeout", "0.001.."),
        ({"wait_replicas": 1, "wait_timeout": 30.0}, "wait_timeout", "socket timeout"),
        ({"wait_timeout": 61}, "wait_timeout", "0.001..60"),
        ({"wait_timeout": "1"}, "wait_timeout", "number of seconds"),
        ({"wait_policy": "later"}, "wait_policy", "fail, retry"),
    ],
)
def test_manager_refuses_bad_wait_options(kwargs: dict[str, Any], setting: str, text: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        LockManager("redis://127.0.0.1:1/0", **kwargs)
    assert err.value.setting == setting and text in str(err.value)


def test_settings_reach_the_manager_of_redislock_app(fresh: Pair) -> None:
    app = Celery("t", broker=fresh.master.url, set_as_current=False)
    app.conf.redislock_wait_replicas = 1
    app.conf.redislock_wait_timeout = "0.5"
    app.conf.redislock_wait_policy = "retry"
    locks = RedisLock(app)
    try:
        mgr = locks.manager
        assert (mgr.wait_replicas, mgr.wait_timeout, mgr.wait_policy) == (1, 0.5, "retry")
        with locks.lock("res", timeout=5) as lease:
            assert lease.token in {k.decode() for k in fresh.r.hgetall("{redislock}:lock:res")}
        worker_mgr = locks._make_manager(worker=True)  # a worker's main process and children
        try:
            assert (worker_mgr.wait_replicas, worker_mgr.wait_policy) == (1, "retry")
        finally:
            worker_mgr.close()
    finally:
        locks.close()


def test_reconcile_with_replicas_behind_is_skipped_and_says_why(
    fresh: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    app = Celery("t", broker=fresh.master.url, set_as_current=False)
    app.conf.redislock_wait_replicas = 1
    app.conf.redislock_wait_timeout = 0.1
    locks = RedisLock(app)
    try:
        fresh.pause_replica()
        with caplog.at_level("INFO", logger="celery_redislock.reconcile"):
            assert locks.reconcile() == {"skipped": True}
        assert "reconcile.skipped reason=replicas-behind" in caplog.text
        assert_nothing_held(fresh)
    finally:
        locks.close()


def test_settings_default_to_no_wait() -> None:
    cfg = load_config({"redislock_url": "redis://127.0.0.1:1/0"})
    assert (cfg.wait_replicas, cfg.wait_timeout, cfg.wait_policy) == (0, 1.0, "fail")


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("redislock_wait_replicas", -1, "0..100"),
        ("redislock_wait_replicas", "two", "non-negative int"),
        ("redislock_wait_replicas", True, "non-negative int"),
        ("redislock_wait_timeout", 0, "0.001..60"),
        ("redislock_wait_timeout", float("inf"), "0.001..60"),
        ("redislock_wait_timeout", "soon", "number of seconds"),
        ("redislock_wait_policy", "sometimes", "fail, retry"),
    ],
)
def test_settings_refuse_bad_wait_values(name: str, value: Any, text: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        load_config({"redislock_url": "redis://127.0.0.1:1/0", name: value})
    assert err.value.setting == name and text in str(err.value)


def test_a_wait_timeout_above_the_socket_timeout_is_refused_under_the_settings_name() -> None:
    app = Celery("t", broker="redis://127.0.0.1:1/0?socket_timeout=1", set_as_current=False)
    app.conf.redislock_wait_replicas = 1
    app.conf.redislock_wait_timeout = 2.0
    locks = RedisLock(app)
    with pytest.raises(ConfigurationError) as err:
        _ = locks.manager
    assert err.value.setting == "redislock_wait_timeout"
    assert "below the client's socket timeout" in str(err.value)


# -- grants a task acts on: a task owner's, an adopted one, a deferred task's --


def test_a_task_owners_grant_is_on_the_replica_or_refused_with_nothing_held(
    fresh: Pair, managers: Managers
) -> None:
    mgr = managers(wait_replicas=1, wait_timeout=0.2)
    grant = mgr.acquire_for_task("t1", "res", ttl=30)
    assert grant.granted and grant.token in {k.decode() for k in fresh.r.hgetall(LOCK)}
    mgr.release_task("t1")
    fresh.pause_replica()
    # Both policies: acquire_for_task never waits, so nothing to retry within.
    for policy in ("fail", "retry"):
        short = managers(wait_replicas=1, wait_timeout=0.2, wait_policy=policy)
        with pytest.raises(ReplicationTimeout) as err:
            short.acquire_for_task(f"t2-{policy}", "res", ttl=30)
        assert (err.value.wanted, err.value.acknowledged) == (1, 0)
        assert_nothing_held(fresh)
        assert not fresh.m.exists(f"{{t}}:alive:task:t2-{policy}")


def test_an_adoption_too_few_replicas_acknowledge_is_released_and_raises(
    fresh: Pair, managers: Managers
) -> None:
    sender = managers()
    assert sender.acquire_for_task("t1", "res", ttl=30).granted
    runner = managers(wait_replicas=1, wait_timeout=0.2)
    fresh.pause_replica()
    with pytest.raises(ReplicationTimeout) as err:
        runner.adopt("t1")
    assert err.value.resources == ("res",) and err.value.acknowledged == 0
    assert_nothing_held(fresh)
    assert runner.state.leases == {}
    fresh.resume_replica()
    wait_until(fresh.in_sync, what="the replica to come back")
    assert sender.acquire_for_task("t2", "res", ttl=30).granted
    adoption = runner.adopt("t2")
    assert adoption.adopted
    assert adoption.leases[0].token in {k.decode() for k in fresh.r.hgetall(LOCK)}
    adoption.leases[0].release()


def test_a_deferred_task_handed_the_lock_fails_without_running_when_the_replica_is_behind(
    fresh: Pair, managers: Managers
) -> None:
    from celery.contrib.testing.worker import start_worker

    from celery_helpers import close_app
    from celery_redislock import locked

    app = _wait_replicas_app(fresh, "replicas-defer")
    ran: list[str] = []

    @app.task(bind=True, name="rd.write", shared=False)
    @locked("res", on_busy="defer")
    def write(self: Any) -> None:
        ran.append(self.request.id)

    holder = managers().acquire("res")
    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            result = write.apply_async(task_id="d1")
            wait_until(lambda: result.state == "DEFERRED", what="the task to park")
            fresh.pause_replica()
            holder.release()  # handed to the parked task, dispatched, adopted
            with pytest.raises(ReplicationTimeout):
                result.get(timeout=30)
        assert ran == []
        assert fresh.m.hget("{t}:defer:d1", "state") == b"done"  # a stale copy is dropped
        assert_nothing_held(fresh)
    finally:
        close_app(app)


def test_unique_delay_is_refused_when_the_replica_does_not_acknowledge_the_key(
    fresh: Pair,
) -> None:
    from celery_helpers import close_app
    from celery_redislock import UniqueTask

    app = _wait_replicas_app(fresh, "replicas-unique")
    try:

        @app.task(base=UniqueTask, unique_key="k", name="ru.send", shared=False)
        def send() -> None:
            pass

        queue = app.conf.task_default_queue
        fresh.pause_replica()
        with pytest.raises(ReplicationTimeout):
            send.delay()
        assert fresh.m.llen(queue) == 0  # not sent
        assert_nothing_held(fresh)
        fresh.resume_replica()
        wait_until(fresh.in_sync, what="the replica to come back")
        sent = send.delay()
        assert fresh.m.llen(queue) == 1
        holders = {k.decode() for k in fresh.r.hgetall("{t}:lock:unique:k")}
        assert holders == {f"task:{sent.id}|task:{sent.id}"}
    finally:
        close_app(app)


def test_unique_retry_and_run_without_the_replica_go_on_without_the_key(fresh: Pair) -> None:
    from celery_helpers import close_app
    from celery_redislock import UniqueTask

    app = _wait_replicas_app(fresh, "replicas-unique-run")
    ran: list[str] = []
    try:

        @app.task(base=UniqueTask, unique_key="k", name="ru.run", shared=False, bind=True)
        def run(self: Any) -> None:
            ran.append(self.request.id)

        queue = app.conf.task_default_queue
        sent = run.delay()  # the key is on the replica
        fresh.pause_replica()
        # The worker runs it: adopting the key is not acknowledged, so the
        # key is released and the body runs without it (it was sent).
        run.apply(task_id=sent.id)
        assert ran == [sent.id]
        assert_nothing_held(fresh)
        # A retry (attempt 1) whose key is not acknowledged is still sent.
        before = fresh.m.llen(queue)
        run.apply_async(task_id=sent.id, retries=1)
        assert fresh.m.llen(queue) == before + 1
        assert_nothing_held(fresh)
    finally:
        close_app(app)


def test_a_deferred_grant_too_few_replicas_acknowledge_counts_as_an_error(
    fresh: Pair, managers: Managers
) -> None:
    from prometheus_client import CollectorRegistry

    from celery_redislock.ops.prometheus import PrometheusMetrics
    from celery_redislock.worker.defer import adopt, park

    registry = CollectorRegistry()
    holder, parker = managers(), managers()
    runner = managers(wait_replicas=1, wait_timeout=0.2, metrics=PrometheusMetrics(registry))
    lease = holder.acquire("res", timeout=5)
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    req = parker.request(["res"], [])
    assert park(parker, "d1", req, message, park_ttl=60, grant_ttl=60).outcome == "parked"
    lease.release()  # handed to the parked task
    fresh.pause_replica()
    with pytest.raises(ReplicationTimeout):
        adopt(runner, "d1", 0, parked_at=time.time() - 100)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("redislock_acquire_wait_seconds_count", outcome="error") == 1
    assert sample("redislock_acquire_wait_seconds_sum", outcome="error") >= 100  # type: ignore[operator]
    assert sample("redislock_grants_total") == 0


# -- the asyncio front-end -----------------------------------------------------


def test_async_grant_is_on_the_replica_when_acquire_returns_script_and_hand_off(
    fresh: Pair, managers: Managers
) -> None:
    from async_helpers import run, until
    from celery_redislock.asyncio import AsyncLockManager

    holder = managers()

    async def main() -> None:
        async with AsyncLockManager(
            fresh.master.url, NS, owner_ttl=5, wait_replicas=1, wait_timeout=2.0
        ) as mgr:
            before = commandstats(fresh.m)
            lease = await mgr.acquire("res", timeout=5)
            # read straight from the replica, with no wait: WAIT confirmed it
            assert lease.token in {k.decode() for k in fresh.r.hgetall(LOCK)}
            assert command_delta(before, commandstats(fresh.m)).get("wait") == 1
            await lease.release()
            held = holder.acquire("res")
            task = asyncio.create_task(mgr.acquire("res", timeout=20))
            await until(lambda: fresh.m.zcard("{t}:q:res") == 1, "the coroutine to queue")
            await asyncio.to_thread(held.release)  # handed over by push, then one WAIT
            lease = await task
            assert lease.token in {k.decode() for k in fresh.r.hgetall(LOCK)}
            await lease.release()

    run(main())
    assert_nothing_held(fresh)


@pytest.mark.parametrize("policy", ["fail", "retry"])
def test_async_paused_replica_fails_the_acquire_and_leaves_nothing_held(
    fresh: Pair, managers: Managers, policy: str
) -> None:
    from async_helpers import run
    from celery_redislock.asyncio import AsyncLockManager

    async def main() -> None:
        async with AsyncLockManager(
            fresh.master.url,
            NS,
            owner_ttl=5,
            wait_replicas=1,
            wait_timeout=0.1,
            wait_policy=policy,
        ) as mgr:
            fresh.pause_replica()
            before = commandstats(fresh.m)
            with pytest.raises(ReplicationTimeout) as err:
                await mgr.acquire("res", timeout=0.5)
            assert err.value.wanted == 1 and err.value.acknowledged == 0
            waits = command_delta(before, commandstats(fresh.m)).get("wait", 0)
            # "retry": granted, released and asked again until the timeout
            assert waits >= 2 if policy == "retry" else waits == 1
            assert_nothing_held(fresh)

    run(main())
    managers().acquire("res", timeout=0).release()


def test_async_manager_refuses_bad_wait_options() -> None:
    from celery_redislock.asyncio import AsyncLockManager

    with pytest.raises(ConfigurationError, match="wait_replicas"):
        AsyncLockManager("redis://127.0.0.1:1/0", NS, wait_replicas=-1)
    with pytest.raises(ConfigurationError, match="wait_policy"):
        AsyncLockManager("redis://127.0.0.1:1/0", NS, wait_policy="sometimes")
