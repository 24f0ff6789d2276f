"""Race R9 of docs/worker.md: the lock Redis is unreachable when the worker starts.

The broker and result backend stay on the session's redis-server; only
``redislock_url`` points at a loopback port where nothing listens yet.

- ``redislock_eviction_check='raise'``: the bootstep's start raises
  RedisUnavailable and the worker refuses to start (it never reports ready).
- ``'warn'`` and ``'ignore'``: the worker starts, logs ``node.start-error``,
  and its heartbeat thread retries ``node_start`` every tick: once a
  redis-server listens on that port, the node record appears with the
  worker's incarnation and a @locked task runs and releases normally.

Runs Celery's in-process test worker, as tests/test_celery_quick.py does.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import TestWorkController, setup_app_for_worker
from celery.platforms import EX_FAILURE
from celery.result import _set_task_join_will_block
from celery.worker import state

from celery_redislock import RedisLock, RedisUnavailable, current_lease, locked
from celery_redislock.worker.node import group_key, node_key
from engine_helpers import wait_until
from redis_server import LOOPBACK, RedisServer

NS = "r9"
PREFIX = "{" + NS + "}:"
#: Short intervals: the retries and the test stay fast.
INTERVAL = 0.2
OWNER_TTL = 1.0


def make_app(broker_url: str, lock_url: str, eviction_check: str) -> Celery:
    app = Celery("r9", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.update(
        redislock_url=lock_url,
        redislock_namespace=NS,
        redislock_owner_ttl=OWNER_TTL,
        redislock_heartbeat_interval=INTERVAL,
        redislock_eviction_check=eviction_check,
        task_default_queue=f"q-{time.monotonic_ns()}",
        broker_connection_retry_on_startup=False,
    )
    return app


@pytest.fixture
def lock_port(free_port: Callable[..., int]) -> int:
    """A loopback port where nothing listens (yet)."""
    return free_port()


@pytest.fixture
def lock_url(lock_port: int) -> str:
    return f"redis://{LOOPBACK}:{lock_port}/0"


@pytest.fixture
def apps() -> Iterator[Callable[[str, str, str], Celery]]:
    """Makes apps with a RedisLock; closes them as test_celery_quick's worker_app does."""
    made: list[tuple[Celery, RedisLock]] = []

    def make(broker_url: str, lock_url: str, eviction_check: str) -> Celery:
        app = make_app(broker_url, lock_url, eviction_check)
        made.append((app, RedisLock(app)))
        return app

    yield make
    for app, locks in made:
        locks.close()
        gc.collect()  # AsyncResults unsubscribe while the broker Redis is up
        consumer = getattr(app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        app.close()


@contextmanager
def captured(*names: str, level: int = logging.INFO) -> Iterator[list[logging.LogRecord]]:
    """Records of the named loggers (the test worker resets the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(level)  # the test worker's root level is ERROR
    try:
        yield records
    finally:
        for lg, old in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(old)


@contextmanager
def worker_thread(
    app: Celery, hostname: str, pool: str = "solo", concurrency: int = 1
) -> Iterator[tuple[TestWorkController, threading.Thread]]:
    """Celery's test worker started in a thread, as ``start_worker`` does.

    Unlike ``start_worker``, which waits for ever for a worker that never
    gets ready, this does not wait: the test waits, with a deadline, for the
    worker to be ready or for ``worker.start()`` to return. On exit the
    worker is stopped (as ``start_worker`` stops it) and must end in 10 s.
    """
    setup_app_for_worker(app, "error", None)
    worker = TestWorkController(
        app=app,
        hostname=hostname,
        pool=pool,
        concurrency=concurrency,
        loglevel="error",
        logfile=None,
        ready_callback=None,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
    )
    thread = threading.Thread(target=worker.start, daemon=True)
    thread.start()
    try:
        yield worker, thread
    finally:
        state.should_terminate = 0
        thread.join(10)
        state.should_terminate = None
    assert not thread.is_alive(), "the worker did not stop within 10 s"


def messages(records: list[logging.LogRecord]) -> list[str]:
    return [rec.getMessage() for rec in list(records)]


def nothing_listens(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((LOOPBACK, port)) != 0


def test_raise_mode_refuses_to_start_when_the_lock_redis_is_unreachable(
    apps: Callable[[str, str, str], Celery],
    redis_url: str,
    lock_url: str,
    lock_port: int,
    r: redis.Redis,
) -> None:
    app = apps(redis_url, lock_url, "raise")
    locks = RedisLock.of(app)
    assert locks is not None
    with (
        captured("celery.worker", "celery_redislock") as records,
        worker_thread(app, "celery@r9-raise") as (worker, thread),
    ):
        wait_until(lambda: not thread.is_alive(), what="worker.start() to give up")

    assert not worker._on_started.is_set()  # the consumer never got ready
    assert worker.exitcode == EX_FAILURE
    fatal = [rec for rec in records if rec.levelno == logging.CRITICAL and rec.exc_info]
    assert len(fatal) == 1, messages(records)
    exc_info = fatal[0].exc_info
    assert exc_info is not None
    exc = exc_info[1]
    assert isinstance(exc, RedisUnavailable), repr(exc)
    assert exc.url == lock_url and f":{lock_port}" in str(exc)
    text = messages(records)
    assert not any("node.start-error" in m for m in text)  # not the warn/ignore path
    node = worker.redislock_node
    assert node is not None and node.state in ("init", "stopped") and node.ticks == 0
    # The release ran (worker_shutdown) and left worker mode.
    assert locks.node is None and locks.incarnation is None
    # Nothing was written: not to the broker's Redis, and the lock Redis
    # still does not exist.
    assert r.keys(PREFIX + "*") == []
    assert nothing_listens(lock_port)


@pytest.mark.parametrize("mode", ["warn", "ignore"])
def test_worker_starts_without_the_lock_redis_and_claims_its_node_once_redis_is_up(
    apps: Callable[[str, str, str], Celery],
    redis_url: str,
    lock_url: str,
    lock_port: int,
    r: redis.Redis,
    tmp_path: Path,
    mode: str,
) -> None:
    app = apps(redis_url, lock_url, mode)

    @app.task(shared=False, bind=True, acks_late=True)
    @locked("repo:{n}")
    def sync(self: Any, n: int) -> dict[str, Any]:
        lease = current_lease()
        assert lease is not None
        held = lock_client.hexists(PREFIX + f"lock:repo:{n}", lease.token)
        return {"held": bool(held), "fence": lease.fencing_token}

    # The lock Redis that comes up later may evict keys: the eviction check
    # skipped at start-up must still run once it answers ('warn').
    server = RedisServer(
        workdir=tmp_path / "lock-redis",
        port=lock_port,
        extra_args=["--maxmemory-policy", "allkeys-lru"],
    )
    lock_client = server.client()
    hostname = f"celery@r9-{mode}"
    try:
        with captured("celery_redislock") as records:
            with worker_thread(app, hostname, pool="threads", concurrency=2) as (w, thread):
                wait_until(
                    lambda: w._on_started.is_set() or not thread.is_alive(),
                    what="the worker to get ready or to give up",
                )
                assert w._on_started.is_set() and thread.is_alive(), "the worker did not start"
                _set_task_join_will_block(False)
                node = w.redislock_node
                assert node is not None
                inc = node.incarnation
                text = messages(records)
                assert any(
                    m.startswith(f"node.start-error node={hostname} ") and f":{lock_port}" in m
                    for m in text
                ), text
                # The heartbeat thread is running and retrying node_start.
                wait_until(
                    lambda: any(
                        m.startswith(f"node.heartbeat-error node={hostname} ")
                        for m in messages(records)
                    ),
                    what="a failed node_start retry in the heartbeat",
                )
                assert node.state == "init"
                assert nothing_listens(lock_port)

                server.start()  # the lock Redis comes up on that same port
                assert server.port == lock_port
                wait_until(
                    lambda: lock_client.hget(node_key(PREFIX, hostname), "inc") == inc.encode(),
                    what="the node record with our incarnation",
                )
                wait_until(lambda: node.state == "owner", what="the node to own its record")
                assert any(
                    m.startswith(f"node.start node={hostname} inc={inc} predecessor=none")
                    for m in messages(records)
                )
                if mode == "warn":
                    wait_until(
                        lambda: any(
                            m.startswith("startup.eviction-risk") and "allkeys-lru" in m
                            for m in messages(records)
                        ),
                        what="the skipped eviction check to run late and warn",
                    )

                out = sync.delay(1).get(timeout=20)
                assert out["held"] and out["fence"] > 0
                assert lock_client.keys(PREFIX + "lock:*") == []
                assert lock_client.hlen(group_key(PREFIX, inc)) >= 1
            # Shutdown released everything of this incarnation.
            assert not lock_client.exists(node_key(PREFIX, hostname), group_key(PREFIX, inc))
        # Nothing of the namespace went to the broker's Redis.
        assert r.keys(PREFIX + "*") == []
        risk = [m for m in messages(records) if m.startswith("startup.eviction-risk")]
        assert len(risk) == (1 if mode == "warn" else 0), risk  # once, and never when 'ignore'
    finally:
        lock_client.close()
        server.close()
