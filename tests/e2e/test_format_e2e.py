"""End-to-end: a real ``celery worker`` refuses a namespace of another data format.

The namespace's ``{ns}:format`` says another release's format: the worker
must not start (exit 78, EX_CONFIG), naming both versions and the fix in
its log, before it claims its node record or consumes a task.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from celery_redislock import FORMAT_VERSION

from .harness import START_TIMEOUT, Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_a_worker_refuses_to_start_on_a_namespace_of_another_data_format(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(heartbeat=1)
    newer = FORMAT_VERSION + 1
    c.lock_redis.set(c.key("format"), str(newer))
    w = c.start_worker("format", concurrency=1, wait=False)
    ping = c.send("ping", queue=w.queue)

    wait_for(lambda: not w.alive, START_TIMEOUT, "the worker to refuse to start", on_timeout=w.tail)

    assert w.wait(1) == 78, w.tail()
    assert not ping.ready(), "the worker consumed a task on a namespace of another format"
    [line] = w.log_lines("worker.format-mismatch")
    assert "CRITICAL" in line, line
    assert f"format {newer}" in line and f"uses format {FORMAT_VERSION}" in line, line
    assert "refuses to start" in line and "docs/operations.md" in line, line
    assert "Traceback" not in w.text()
    assert c.namespace_keys("node") == []
    assert c.lock_redis.get(c.key("format")) == str(newer)
