"""Celery apps for the in-process tests: one place builds and closes them.

``quick_app`` makes an app over the test Redis (broker, result backend and
lock store) with a short owner TTL and heartbeat and a queue of its own, so
tests in one session never see each other's messages. ``close_app`` shuts
it down while Redis is still up. The ``quick_apps`` fixture (tests/conftest.py)
makes such apps in :data:`QUICK_NS` and closes them after the test;
:func:`fork_and_report` runs code in a forked child and returns what it found.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_redislock import RedisLock

#: The lock namespace of the in-process Celery tests, and its key prefix.
QUICK_NS = "quick"
QUICK_PREFIX = "{" + QUICK_NS + "}:"


def quick_app(redis_url: str, main: str, namespace: str, **conf: Any) -> Celery:
    """An app whose settings suit a quick test; ``conf`` overrides them."""
    app = Celery(main, broker=redis_url, backend=redis_url, set_as_current=False)
    settings: dict[str, Any] = {
        "redislock_namespace": namespace,
        "redislock_owner_ttl": 1.5,
        "redislock_heartbeat_interval": 0.25,
        "task_default_queue": f"q-{time.monotonic_ns()}",
        "broker_connection_retry_on_startup": False,
    }
    settings.update(conf)
    app.conf.update(settings)
    return app


def close_app(app: Celery) -> None:
    """Close the app's lock manager and result consumer, then the app."""
    locks = RedisLock.of(app)
    if locks is not None:
        locks.close()
    # Drop AsyncResults while Redis is up: their __del__ unsubscribes, and
    # after the session's server stops the backend would retry for 20 s.
    gc.collect()
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
    app.close()


def fork_and_report(body: Callable[[], Any]) -> Any:
    """Run ``body`` in a forked child; return its JSON-able result (None if it failed).

    The child sends the result through a pipe and exits at once
    (``os._exit``: no atexit handler, no test teardown in the child).
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        code = 1
        try:
            os.close(read_fd)
            os.write(write_fd, json.dumps(body()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        out = json.loads(pipe.read() or b"null")
    os.waitpid(pid, 0)
    return out
