"""Celery apps for the in-process tests: one place builds and closes them.

``quick_app`` makes an app over the test Redis (broker, result backend and
lock store) with a short owner TTL and heartbeat and a queue of its own, so
tests in one session never see each other's messages. ``close_app`` shuts
it down while Redis is still up.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from celery import Celery

from celery_redislock import RedisLock


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
