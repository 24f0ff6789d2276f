"""Celery settings of the example project.

``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) is the broker, the result
backend and, since ``redislock_url`` is not set, the lock Redis too.
``REDISLOCK_NAMESPACE`` picks the lock namespace (default ``proj``).
"""

from __future__ import annotations

import os

_redis = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

broker_url = _redis
result_backend = _redis
broker_connection_retry_on_startup = True

# Redelivery after a lost worker process: ack only once the task finished, and
# requeue a task whose pool child died (SIGKILL, OOM kill) instead of failing it.
task_acks_late = True
task_reject_on_worker_lost = True
# One message per pool child at a time, so waiting happens in the lock queue
# (first come, first served) rather than in a child's prefetch buffer.
worker_prefetch_multiplier = 1
# A whole worker SIGKILLed with acks_late tasks leaves them unacked until the
# visibility timeout returns them (one hour by default). Keep it above your
# longest task; the library never relies on redelivery for lock safety.
broker_transport_options = {"visibility_timeout": 3600}

# celery-redislock: locks live under {proj}:... in the broker's Redis.
redislock_namespace = os.environ.get("REDISLOCK_NAMESPACE", "proj")
# A dead owner's locks are reclaimable this long after its last heartbeat.
redislock_owner_ttl = float(os.environ.get("REDISLOCK_OWNER_TTL", "30"))
# Seconds between heartbeats; also how fast a dead pool child's locks are freed.
redislock_heartbeat_interval = float(os.environ.get("REDISLOCK_HEARTBEAT_INTERVAL", "1"))
# Beat's reconcile pass: frees locks of owners nobody is left to clean up.
redislock_reconcile_interval = float(os.environ.get("REDISLOCK_RECONCILE_INTERVAL", "10"))
