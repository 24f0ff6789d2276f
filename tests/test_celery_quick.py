"""Fast Celery-integration tests: settings, @locked, reconcile, beat entry,
and the worker bootstep in Celery's in-process test worker (threads pool).

Real-subprocess worker tests (prefork, SIGKILL, restarts) live in tests/e2e/.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_helpers import QUICK_NS as NS
from celery_helpers import QUICK_PREFIX as PREFIX
from celery_helpers import fork_and_report, quick_app
from celery_redislock import (
    ConfigurationError,
    LockManager,
    LockTimeout,
    RedisLock,
    TemplateError,
    current_lease,
    locked,
)
from celery_redislock.integration.settings import SETTINGS, load_config, markdown_table
from engine_helpers import wait_until as wait_for
from redis_server import RedisServer


def make_app(redis_url: str, **conf: Any) -> Celery:
    return quick_app(redis_url, "quick", NS, **conf)


@pytest.fixture
def app(quick_apps: Callable[..., Celery]) -> Celery:
    """An app without a RedisLock: the test attaches one."""
    return quick_apps("quick", locks=False)


@pytest.fixture
def other(redis_url: str) -> Iterator[LockManager]:
    """A separate process-like lock user (its own owner and heartbeat)."""
    mgr = LockManager(redis_url, NS, owner_ttl=1.5)
    yield mgr
    mgr.close()


# -- settings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "setting,value",
    [
        ("redislock_owner_ttl", -1),
        ("redislock_owner_ttl", "soon"),
        ("redislock_heartbeat_interval", 100),
        ("redislock_reconcile_interval", -5),
        ("redislock_default_timeout", "never"),
        ("redislock_fast_restart_cleanup", "maybe"),
        ("redislock_eviction_check", "loud"),
        ("redislock_namespace", "bad name{"),
        ("redislock_url", "amqp://localhost"),
    ],
)
def test_bad_setting_raises_configuration_error_naming_it(
    redis_url: str, setting: str, value: object
) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_config({"broker_url": redis_url, setting: value})
    assert info.value.setting == setting
    assert setting in str(info.value)


def test_url_defaults_to_redis_broker_and_is_required_otherwise() -> None:
    assert load_config({"broker_url": "redis://h:1/2"}).url == "redis://h:1/2"
    with pytest.raises(ConfigurationError, match="redislock_url"):
        load_config({"broker_url": "amqp://guest@localhost//"})
    assert load_config({"broker_url": "amqp://x", "redislock_url": "rediss://h/0"}).url == (
        "rediss://h/0"
    )


def test_defaults_match_the_settings_table() -> None:
    cfg = load_config({"broker_url": "redis://h/0"})
    assert (cfg.namespace, cfg.owner_ttl, cfg.heartbeat_interval) == ("redislock", 30.0, 10.0)
    assert (cfg.reconcile_interval, cfg.default_timeout) == (60.0, None)
    assert (cfg.fast_restart_cleanup, cfg.eviction_check) == (True, "warn")
    assert {s.name for s in SETTINGS} == {
        "redislock_" + f for f in cfg.__dataclass_fields__ if f != "url"
    } | {"redislock_url"}


def test_configuration_docs_embed_the_settings_table() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert markdown_table() in doc


def test_settings_table_keeps_four_cells_per_row() -> None:
    """A `|` inside a cell ('warn' | 'raise') is escaped, not a column break."""
    rows = markdown_table().splitlines()[2:]
    assert len(rows) == len(SETTINGS)
    for row, setting in zip(rows, SETTINGS):
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells == [f"`{setting.name}`", setting.type, setting.default, setting.doc]


def test_settings_are_read_lazily_after_construction(redis_url: str) -> None:
    app = Celery("lazy", broker=redis_url, set_as_current=False)
    locks = RedisLock(app)
    app.conf.redislock_namespace = "late"
    assert locks.config.namespace == "late"
    app2 = Celery("bad", broker=redis_url, set_as_current=False)
    locks2 = RedisLock()
    locks2.init_app(app2)
    app2.conf.redislock_owner_ttl = 0
    with pytest.raises(ConfigurationError, match="redislock_owner_ttl"):
        _ = locks2.config


# -- beat schedule -----------------------------------------------------------


def test_beat_entry_is_merged_into_the_users_schedule_not_replacing_it(redis_url: str) -> None:
    app = Celery("beat", broker=redis_url, set_as_current=False)
    app.conf.beat_schedule = {"mine": {"task": "x", "schedule": 5.0}}
    RedisLock(app)
    schedule = app.conf.beat_schedule
    assert schedule["mine"] == {"task": "x", "schedule": 5.0}
    entry = schedule["celery_redislock.reconcile"]
    assert entry["task"] == "celery_redislock.reconcile"
    assert entry["schedule"] == 60.0 and entry["options"]["expires"] == 60.0


def test_users_own_reconcile_entry_is_kept(redis_url: str) -> None:
    app = Celery("beat2", broker=redis_url, set_as_current=False)
    RedisLock(app)  # before configuration
    mine = {"task": "celery_redislock.reconcile", "schedule": 7.0}
    app.conf.update(beat_schedule={"celery_redislock.reconcile": mine, "other": {"task": "y"}})
    assert app.conf.beat_schedule["celery_redislock.reconcile"] == mine
    assert "other" in app.conf.beat_schedule


def test_reconcile_interval_none_adds_no_beat_entry(redis_url: str) -> None:
    app = Celery("beat3", broker=redis_url, set_as_current=False)
    app.conf.redislock_reconcile_interval = None
    RedisLock(app)
    assert "celery_redislock.reconcile" not in (app.conf.beat_schedule or {})
    assert "celery_redislock.reconcile" in app.tasks


# -- @locked, eager (no worker) ----------------------------------------------


def test_missing_template_argument_is_a_clear_error_before_locking(
    app: Celery, r: redis.Redis
) -> None:
    RedisLock(app)

    @app.task(shared=False, bind=True)
    @locked("repo:{repo_id}", shared=["remote:{remote}"])
    def sync(self: Any, repo_id: int, **kwargs: Any) -> None:
        raise AssertionError("body must not run")

    with pytest.raises(TemplateError) as info:
        sync.apply(args=(1,), throw=True)
    assert info.value.argument == "remote" and info.value.template == "remote:{remote}"
    assert "remote:{remote}" in str(info.value) and "'remote'" in str(info.value)
    assert not r.keys(PREFIX + "lock:*")


def test_templates_use_defaults_and_var_keyword_arguments(app: Celery, r: redis.Redis) -> None:
    RedisLock(app)
    seen: list[tuple[str, ...]] = []

    @app.task(shared=False)
    @locked("repo:{repo_id}:{branch}", shared="user:{user}")
    def sync(repo_id: int, branch: str = "main", **kw: Any) -> int:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.resources)
        assert r.exists(PREFIX + f"lock:repo:{repo_id}:{branch}")
        return lease.fencing_token

    assert sync.apply(args=(3,), kwargs={"user": "ann"}, throw=True).get() > 0
    assert seen == [("repo:3:main", "user:ann")]
    assert current_lease() is None
    assert not r.keys(PREFIX + "lock:*")


def test_locked_keeps_the_signature_so_celery_checks_arguments(app: Celery) -> None:
    RedisLock(app)

    @app.task(shared=False, bind=True)
    @locked("repo:{repo_id}")
    def sync(self: Any, repo_id: int) -> None: ...

    assert sync.__wrapped__.__name__ == "sync"
    with pytest.raises(TypeError):
        sync.delay(1, 2, 3)


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_on_busy_raise_and_skip_try_once(
    app: Celery, other: LockManager, mode: str, r: redis.Redis
) -> None:
    RedisLock(app)
    ran: list[int] = []

    @app.task(shared=False)
    @locked("repo:{n}", on_busy=mode)
    def job(n: int) -> str:
        ran.append(n)
        return "ran"

    with other.lock("repo:1"):
        if mode == "raise":
            with pytest.raises(LockTimeout):
                job.apply(args=(1,), throw=True)
        else:
            assert job.apply(args=(1,), throw=True).get() is None
        assert not r.exists(PREFIX + "q:repo:1")  # never queued
    assert ran == []
    assert job.apply(args=(1,), throw=True).get() == "ran"


def test_on_busy_wait_times_out_with_lock_timeout(app: Celery, other: LockManager) -> None:
    RedisLock(app)

    @app.task(shared=False)
    @locked("repo:{n}", timeout=0.2)
    def job(n: int) -> None: ...

    with other.lock("repo:1"), pytest.raises(LockTimeout):
        job.apply(args=(1,), throw=True)


def test_locked_rejects_bad_arguments_at_decoration() -> None:
    with pytest.raises(ConfigurationError, match="on_busy"):
        locked("a", on_busy="later")
    with pytest.raises(ConfigurationError, match="timeout"):
        locked("a", on_busy="skip", timeout=3)
    with pytest.raises(ConfigurationError):
        locked()


def test_locks_lock_and_reconcile_outside_a_worker(
    app: Celery, redis_url: str, r: redis.Redis
) -> None:
    locks = RedisLock(app)
    with locks.lock("repo:9") as lease:
        assert r.hexists(PREFIX + "lock:repo:9", lease.token)
    # A dead owner: its liveness key is gone but it still holds a lock.
    dead = LockManager(redis_url, NS, owner_ttl=1.5, heartbeat=False)
    dead.acquire("repo:dead", timeout=1)
    r.delete(PREFIX + f"alive:{dead.owner_id}")
    result = app.tasks["celery_redislock.reconcile"].apply(throw=True).get()
    assert result["skipped"] is False
    assert result["cleaned"] >= 1 and result["released"] >= 1
    assert not r.exists(PREFIX + "lock:repo:dead")
    dead.close()


def test_reconcile_runs_one_at_a_time(app: Celery, other: LockManager) -> None:
    locks = RedisLock(app)
    with other.lock("celery_redislock:reconcile"):
        assert locks.reconcile() == {"skipped": True}
    assert locks.reconcile()["skipped"] is False


# -- in-process worker (threads pool) ----------------------------------------


@pytest.fixture
def worker_app(quick_apps: Callable[..., Celery]) -> tuple[Celery, RedisLock]:
    app = quick_apps("quick", locks=False)
    return app, RedisLock(app)


def test_worker_locked_task_acquires_and_releases(
    worker_app: tuple[Celery, RedisLock], r: redis.Redis
) -> None:
    app, locks = worker_app

    @app.task(shared=False, bind=True, acks_late=True)
    @locked("repo:{repo_id}", shared=["remote:{remote_id}"])
    def sync(self: Any, repo_id: int, remote_id: int) -> dict[str, Any]:
        lease = current_lease()
        assert lease is not None
        return {
            "owner": lease.owner_id,
            "fence": lease.fencing_token,
            "held": bool(r.hexists(PREFIX + f"lock:repo:{repo_id}", lease.token)),
            "shared": r.hget(PREFIX + f"lock:remote:{remote_id}", lease.token),
            "group": r.hget(PREFIX + f"group:{locks.incarnation}", lease.owner_id),
        }

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False) as w:
        node = w.redislock_node
        assert node is not None and node.state == "owner"
        assert r.hget(PREFIX + f"node:{w.hostname}", "inc") == node.incarnation.encode()
        out = sync.delay(1, 2).get(timeout=20)
        assert out["held"] and out["group"] is not None
        assert out["shared"] == f"s{out['fence']}".encode()  # mode, then the grant's fence
        assert out["owner"] != sync.request.id  # the owner is the process
        assert not r.exists(PREFIX + "lock:repo:1", PREFIX + "lock:remote:2")
        # The node heartbeat keeps the process's owner alive past its TTL.
        wait_for(lambda: node.ticks >= 8, what="node heartbeat ticks")
        assert r.pttl(PREFIX + f"alive:{out['owner']}") > 0
        inc = node.incarnation
    # After shutdown: record, group and owner gone; back to a standalone manager.
    assert not r.exists(PREFIX + f"node:{w.hostname}", PREFIX + f"group:{inc}")
    assert not r.exists(PREFIX + f"alive:{out['owner']}")
    assert locks.incarnation is None and locks.node is None


def test_worker_retry_releases_between_attempts_and_on_busy_retry_requeues(
    worker_app: tuple[Celery, RedisLock], other: LockManager, r: redis.Redis
) -> None:
    app, _ = worker_app
    attempts: list[int] = []

    @app.task(shared=False, bind=True, max_retries=3)
    @locked("repo:{n}", on_busy="raise")
    def flaky(self: Any, n: int) -> int:
        attempts.append(self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return self.request.retries

    busy: list[int] = []

    @app.task(shared=False, bind=True, max_retries=50)
    @locked("res:{n}", on_busy="retry", retry_countdown=0.05, retry_backoff=1.0)
    def polite(self: Any, n: int) -> int:
        busy.append(self.request.retries)
        return self.request.retries

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        # self.retry() raised inside the body released the lock: the retry
        # (on_busy='raise', no waiting) gets it.
        assert flaky.delay(1).get(timeout=20) == 1
        assert attempts == [0, 1]
        lease = other.acquire("res:1", timeout=1)
        res = polite.delay(1)
        wait_for(lambda: r.exists(PREFIX + "lock:res:1") and busy == [] and res.state == "RETRY")
        lease.release()
        assert res.get(timeout=20) >= 1
    assert not r.keys(PREFIX + "lock:*")


def test_on_busy_retry_logs_the_give_up_not_a_retry_once_max_retries_is_spent(
    worker_app: tuple[Celery, RedisLock], other: LockManager
) -> None:
    # max_retries=1: the first busy attempt retries (locked.retry), the
    # second finds the retries spent and fails with LockTimeout; it must log
    # that (locked.retries-exhausted), not announce a retry that never comes.
    app, _ = worker_app

    @app.task(shared=False, bind=True, max_retries=1)
    @locked("res:{n}", on_busy="retry", retry_countdown=0.05, retry_backoff=1.0)
    def polite(self: Any, n: int) -> int:
        return int(self.request.retries)

    lease = other.acquire("res:7", timeout=1)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("celery_redislock.task")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the test worker sets the root logger to ERROR
    try:
        with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
            with pytest.raises(LockTimeout):
                polite.delay(7).get(timeout=20)
    finally:
        lease.release()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [rec.getMessage() for rec in records]
    assert [m.split()[0] for m in lines] == ["locked.retry", "locked.retries-exhausted"], lines
    assert "retries=1" in lines[1] and "max_retries=1" in lines[1], lines


def test_worker_missing_argument_fails_the_task_without_locking(
    worker_app: tuple[Celery, RedisLock], r: redis.Redis
) -> None:
    app, _ = worker_app

    # **kwargs may carry "repo", so only the call can tell it is missing.
    @app.task(shared=False)
    @locked("repo:{repo}")
    def job(n: int, **kwargs: Any) -> None: ...

    with start_worker(app, pool="solo", perform_ping_check=False):
        with pytest.raises(TemplateError, match="repo"):
            job.delay(1).get(timeout=20)
    assert not r.keys(PREFIX + "lock:*")


def test_worker_reconcile_task_returns_report(
    worker_app: tuple[Celery, RedisLock], redis_url: str, r: redis.Redis
) -> None:
    app, _ = worker_app
    dead = LockManager(redis_url, NS, owner_ttl=1.5, heartbeat=False)
    dead.acquire("repo:dead", timeout=1)
    r.delete(PREFIX + f"alive:{dead.owner_id}")
    with start_worker(app, pool="threads", perform_ping_check=False):
        report = app.tasks["celery_redislock.reconcile"].delay().get(timeout=20)
    assert report["skipped"] is False and report["released"] == 1
    assert not r.exists(PREFIX + "lock:repo:dead")
    dead.close()


def test_worker_restart_frees_stale_predecessor_locks(
    worker_app: tuple[Celery, RedisLock], redis_url: str, r: redis.Redis
) -> None:
    app, _ = worker_app
    from celery_redislock.worker.node import Node, group_key, new_incarnation

    # A predecessor under the same node name that crashed long ago.
    inc = new_incarnation()
    gk = group_key(PREFIX, inc)
    mgr = LockManager(redis_url, NS, owner_ttl=30, heartbeat=False, group=lambda: gk)
    old = Node(mgr, "celery@restart", inc)
    old.start()
    mgr.acquire("repo:1", timeout=1)
    sec, usec = r.time()
    r.hset(PREFIX + "node:celery@restart", "hb_ms", str(sec * 1000 + usec // 1000 - 60_000))
    with start_worker(app, pool="solo", perform_ping_check=False, hostname="celery@restart") as w:
        assert w.redislock_node.state == "owner"
        assert not r.exists(PREFIX + "lock:repo:1")
        assert r.exists(PREFIX + f"tomb:{inc}")
    mgr.close()


def test_worker_process_init_hook_is_idempotent_and_makes_no_redis_call(
    tmp_path: Path,
) -> None:
    from celery import signals

    # A server of this test's own: the server-wide command counts below must
    # see no other test's clients.
    with RedisServer(workdir=tmp_path) as server:
        app = make_app(server.url)
        locks = RedisLock(app)
        r = server.client()
        try:
            owner = locks.manager.owner_id
            r.config_resetstat()
            signals.worker_process_init.send(sender=None)
            signals.worker_process_init.send(sender=None)
            assert locks.manager.owner_id == owner  # same pid: same identity
            calls = {
                k
                for k in r.info("commandstats")
                if not k.startswith(("cmdstat_info", "cmdstat_config"))
            }
            assert calls == set()
        finally:
            r.close()
            locks.close()


@pytest.fixture
def in_worker(app: Celery) -> Iterator[tuple[RedisLock, LockManager]]:
    """A RedisLock on ``app`` in a worker's main process (incarnation
    ``0123456789abcdef``), and its manager; left and closed after the test."""
    locks = RedisLock(app)
    mgr = locks.enter_worker("0123456789abcdef")
    try:
        yield locks, mgr
    finally:
        locks.leave_worker()
        mgr.close()


def test_forked_process_is_standalone_until_worker_process_init_makes_it_a_pool_child(
    in_worker: tuple[RedisLock, LockManager], r: redis.Redis
) -> None:
    # After any fork the engine is standalone (a task's helper process);
    # only Celery's worker_process_init, sent in real pool children, makes
    # the child a member of the incarnation's group again: idempotently per
    # pid, without a Redis command or a thread.
    from celery import signals

    locks, mgr = in_worker
    assert not mgr.liveness.own_heartbeat and mgr.liveness.group is not None  # the main process
    r.config_resetstat()

    def child() -> dict[str, Any]:  # pragma: no cover - runs in the child
        m = locks.manager
        out: dict[str, Any] = {"same": m is mgr}
        out["helper"] = [m.liveness.own_heartbeat, m.liveness.group is None]
        threads = threading.active_count()
        signals.worker_process_init.send(sender=None)
        signals.worker_process_init.send(sender=None)
        m = locks.manager
        group = m.liveness.group
        out["pool_child"] = [m.liveness.own_heartbeat, group() if group else None]
        out["new_threads"] = threading.active_count() - threads
        return out

    out = fork_and_report(child)
    assert out == {
        "same": True,
        "helper": [True, True],
        "pool_child": [False, PREFIX + "group:0123456789abcdef"],
        "new_threads": 0,
    }
    calls = {
        k for k in r.info("commandstats") if not k.startswith(("cmdstat_info", "cmdstat_config"))
    }
    assert calls == set()
    assert (
        not mgr.liveness.own_heartbeat and mgr.liveness.group is not None
    )  # the parent is unchanged


def test_close_in_a_forked_helper_stops_the_helpers_own_heartbeat(
    in_worker: tuple[RedisLock, LockManager], r: redis.Redis
) -> None:
    locks, _ = in_worker

    def child() -> list[bool]:  # pragma: no cover - runs in the child
        helper = locks.manager
        lease = helper.acquire("helper:1", timeout=5)
        beating = helper.heartbeat.running
        lease.release()
        locks.close()
        return [beating, helper.heartbeat.running, locks.manager is helper]

    out = fork_and_report(child)
    assert out == [True, False, False]  # a fresh standalone manager after close


def test_worker_start_warns_when_redis_may_evict_keys(
    worker_app: tuple[Celery, RedisLock], r: redis.Redis
) -> None:
    app, _ = worker_app
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("celery_redislock.worker")
    logger.addHandler(handler)  # the test worker reconfigures the root logger
    level = logger.level
    logger.setLevel(logging.WARNING)  # the test worker's root level is ERROR
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with start_worker(app, pool="solo", perform_ping_check=False):
            pass
    finally:
        r.config_set("maxmemory-policy", "noeviction")
        logger.removeHandler(handler)
        logger.setLevel(level)
    text = "\n".join(rec.getMessage() for rec in records)
    assert "startup.eviction-risk" in text and "allkeys-lru" in text
