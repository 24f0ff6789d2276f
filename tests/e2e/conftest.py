"""Fixtures for end-to-end tests with real ``celery worker``/``beat`` processes.

- ``cluster``: a factory of :class:`e2e.harness.Cluster` on the session's
  redis-server (emptied for the test); every process it started is killed at
  teardown, and every log is printed when the test failed.
- ``lock_redis``: a second redis-server used only by the lock engine, so that
  its INFO commandstats count the engine's commands and not the broker's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from redis_server import RedisServer

from .harness import Cluster

# The shared scenarios assert; rewrite them as pytest does test modules.
pytest.register_assert_rewrite("e2e.scenarios")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, redis_url: str, tmp_path: Path
) -> Iterator[Callable[..., Cluster]]:
    """``cluster(**settings)`` makes a Cluster; all are torn down after the test."""
    made: list[Cluster] = []

    def make(**settings: Any) -> Cluster:
        c = Cluster(redis_url, tmp_path / f"cluster{len(made)}", **settings)
        made.append(c)
        return c

    try:
        yield make
    finally:
        rep = getattr(request.node, "rep_call", None)
        failed = rep is None or rep.failed
        for c in made:
            if failed:
                print(c.report())
            c.close()


@pytest.fixture(scope="module")
def lock_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A second redis-server, only for the lock engine (not the broker)."""
    with RedisServer(workdir=tmp_path_factory.mktemp("lock-redis")) as server:
        yield server
