"""The Celery settings the worker apps of the end-to-end tests (:mod:`e2e.proj`)
and of the chaos run (:mod:`chaos.celery_app`) share, read from the ``E2E_*``
environment variables that :mod:`e2e.proj` lists."""

from __future__ import annotations

import os
from typing import Any

#: The ``E2E_*`` variables that are a numeric lock setting (seconds; the guard rate: a second), and that setting.
SECONDS_SETTINGS = (
    ("E2E_OWNER_TTL", "redislock_owner_ttl"),
    ("E2E_HEARTBEAT", "redislock_heartbeat_interval"),
    ("E2E_RECONCILE", "redislock_reconcile_interval"),
    ("E2E_UNIQUE_TTL", "redislock_unique_ttl"),
    ("E2E_DEFER_TTL", "redislock_defer_ttl"),
    ("E2E_DEFER_GRANT_TTL", "redislock_defer_grant_ttl"),
    ("E2E_DEFER_GUARD", "redislock_defer_guard_interval"),
    ("E2E_DEFER_GUARD_RATE", "redislock_defer_guard_rate"),
)


def env_float(name: str) -> float | None:
    """The environment variable ``name`` as a float; None when unset or empty."""
    value = os.environ.get(name)
    return float(value) if value else None


def worker_settings(namespace: str, result_expires: int) -> dict[str, Any]:
    """Late acks, one message a child, the queue ``E2E_QUEUE``, and the lock
    settings: ``E2E_NAMESPACE`` (default ``namespace``), ``E2E_LOCK_URL`` and
    :data:`SECONDS_SETTINGS`."""
    conf: dict[str, Any] = {
        "task_default_queue": os.environ.get("E2E_QUEUE", "celery"),
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "result_expires": result_expires,
        "redislock_namespace": os.environ.get("E2E_NAMESPACE", namespace),
    }
    if os.environ.get("E2E_LOCK_URL"):
        conf["redislock_url"] = os.environ["E2E_LOCK_URL"]
    for env, setting in SECONDS_SETTINGS:
        value = env_float(env)
        if value is not None:
            conf[setting] = value
    return conf
