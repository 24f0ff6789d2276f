"""The unique tasks of the end-to-end tests, defined on any app.

:mod:`e2e.proj` defines them on the workers' app; a test defines them on
its producer app too, so that ``apply_async`` runs ``UniqueTask``'s enqueue
in the test process (``send_task`` would bypass it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import redis

from celery_redislock import UniqueTask, locked

#: Longest a unique hold blocks waiting for its go signal, seconds.
HOLD_LIMIT = 300.0


def _unique_task(app: Any, name: str, unique_key: str) -> Any:
    """``app.task`` for a bound, late-acked, exclusive ``UniqueTask``."""
    return app.task(
        name=name,
        bind=True,
        base=UniqueTask,
        unique_key=unique_key,
        acks_late=True,
        shared=False,
    )


def _run_info(task: Any, **extra: Any) -> dict[str, Any]:
    """What a run logs: its pid, task id, ``extra`` and its unique key's token."""
    lease = task.unique_lease
    return {
        "pid": os.getpid(),
        "id": task.request.id,
        **extra,
        "key_token": lease.token if lease is not None else None,
    }


def define(app: Any, data: Callable[[], redis.Redis]) -> Any:
    """Define ``e2e.unique_hold`` on ``app``; return the task."""

    @_unique_task(app, "e2e.unique_hold", "uh:{tag}")
    def unique_hold(self: Any, tag: str, fail: bool = False, block: int = 1000) -> dict[str, Any]:
        """Run once per key: log ``e2e:uh-log:<tag>``, wait for ``e2e:go:<tag>``.

        Deliveries up to ``block`` wait for the go signal; a later one (a
        redelivery after its child was killed) completes at once. ``fail``:
        raise RuntimeError after the go signal.
        """
        r = data()
        attempt = int(r.incr(f"e2e:uh-attempts:{tag}"))
        info = _run_info(self, attempt=attempt)
        r.rpush(f"e2e:uh-log:{tag}", json.dumps(info))
        if attempt <= block:
            deadline = time.monotonic() + HOLD_LIMIT
            while time.monotonic() < deadline:
                if r.blpop([f"e2e:go:{tag}"], timeout=0.5):
                    break
        if fail:
            raise RuntimeError(f"unique_hold {tag} fails as asked")
        return info

    return unique_hold


def define_deferred(app: Any, data: Callable[[], redis.Redis]) -> Any:
    """Define ``e2e.unique_defer`` on ``app`` (unique and deferred); return the task."""

    @_unique_task(app, "e2e.unique_defer", "ud:{tag}")
    @locked("res:{res}", on_busy="defer")
    def unique_defer(self: Any, res: str, tag: str) -> dict[str, Any]:
        """Unique per ``tag``, deferred while ``res:<res>`` is busy: logs its
        run (and its unique key's lease) to ``e2e:ud-log:<tag>``, then waits
        for ``e2e:go:<tag>``."""
        r = data()
        info = _run_info(self)
        r.incr(f"e2e:runs:{tag}")
        r.rpush(f"e2e:ud-log:{tag}", json.dumps(info))
        r.blpop([f"e2e:go:{tag}"], timeout=HOLD_LIMIT)
        return info

    return unique_defer
