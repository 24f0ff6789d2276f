"""What a worker logs when a deferred task parks: parked, not dropped.

An in-process Celery worker (threads pool) over the test's real Redis;
Celery's trace logs the park's ``Ignore`` in the same process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore

from celery_helpers import QUICK_NS as NS
from celery_redislock import LockManager, locked
from celery_redislock.integration.parked import PARKED_WORDING
from engine_helpers import wait_until


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def of(self, logger: str) -> list[str]:
        return [r.getMessage() for r in list(self.records) if r.name.startswith(logger)]


@contextmanager
def _lines() -> Iterator[_Lines]:
    """The worker's log records (its logging set-up replaced the root's
    handlers, so pytest's capture sees none of them)."""
    handler = _Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def test_a_parked_task_is_logged_as_parked_and_another_ignore_as_celery_logs_it(
    quick_apps: Callable[..., Celery], redis_url: str
) -> None:
    app = quick_apps("parkedlog")

    @app.task(name="pl.deferred")
    @locked("res:pl", on_busy="defer")
    def deferred() -> str:
        return "ran"

    @app.task(name="pl.ignored")
    def ignored() -> None:
        raise Ignore()

    other = LockManager(redis_url, NS, owner_ttl=30)
    try:
        with (
            start_worker(
                app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="INFO"
            ),
            _lines() as lines,
        ):
            blocker = other.acquire("res:pl")
            res = deferred.delay()
            wait_until(lambda: res.state == "DEFERRED", what="parked")
            plain = ignored.delay()
            wait_until(
                lambda: any(plain.id in m for m in lines.of("celery.app.trace")),
                what="the plain Ignore's line",
            )
            blocker.release()
            assert res.get(timeout=20) == "ran"
        trace = lines.of("celery.app.trace")
        ours = [m for m in trace if res.id in m]
        assert f"Task pl.deferred[{res.id}] {PARKED_WORDING}" in ours, trace
        assert not any(m.endswith("ignored") for m in ours), trace
        assert f"Task pl.ignored[{plain.id}] ignored" in trace  # not ours: as Celery says it
        [line] = [m for m in lines.of("celery_redislock") if m.startswith("locked.deferred")]
        assert res.id in line and line.endswith("parked; it runs when its locks are free"), line
    finally:
        other.close()
