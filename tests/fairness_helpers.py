"""Helpers for tests/test_fairness.py: waiters in forked processes and threads.

- :func:`wait_until` (from engine_helpers): poll a condition every few ms up
  to a generous deadline (the only way these tests wait; nothing sleeps to
  synchronise).
- :func:`client`: a ``redis.Redis`` with str replies and *no* socket timeout,
  so a waiter's BLPOP is capped only by ``owner_ttl`` and the liveness
  deadline the acquire script returns: a test that sees a prompt grant then
  proves it was pushed, not found by a periodic re-check.
- :func:`child_waiter`: target of a forked process that acquires with its own
  LockManager and logs every step to a Redis list (``RPUSH`` inside the lock
  records the grant order exactly).
- :func:`queue_entries` and friends: read the wait queues straight from Redis.

Children are forked (``multiprocessing`` "fork" context): the point of these
tests is what a fork inherits.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from celery_redislock import LockManager, LockTimeout
from engine_helpers import wait_until

#: Namespace of every lock in the fairness tests.
NS = "fair"
PREFIX = "{" + NS + "}:"
#: Redis list every waiter logs to ("<name>", "<name>:released", ...).
LOG = "test:log"
#: Default deadline of every wait (seconds): generous, the machine is shared.
DEADLINE = 20.0

FORK = multiprocessing.get_context("fork")


def client(url: str, socket_timeout: float | None = None) -> redis.Redis:
    """A str-reply client; ``socket_timeout=None`` lets a BLPOP block long."""
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=socket_timeout)


def manager(url: str, owner_ttl: float = 30.0, **kwargs: Any) -> LockManager:
    """A LockManager on a no-socket-timeout client (its BLPOP cap is 30 s)."""
    return LockManager(client(url), NS, owner_ttl=owner_ttl, **kwargs)


def log(rs: redis.Redis) -> list[str]:
    """The waiters' log so far."""
    return list(rs.lrange(LOG, 0, -1))


def logged(rs: redis.Redis, entry: str) -> bool:
    return entry in log(rs)


def queue_entries(rs: redis.Redis, resource: str) -> list[str]:
    """Members of ``{ns}:q:<resource>`` in queue order (``<mode><owner>|<req>``)."""
    return list(rs.zrange(f"{PREFIX}q:{resource}", 0, -1))


def queue_len(rs: redis.Redis, resource: str) -> int:
    return int(rs.zcard(f"{PREFIX}q:{resource}"))


def entry_owner(member: str) -> str:
    return member[1:].split("|", 1)[0]


def entry_token(member: str) -> str:
    return member[1:]


def keys(rs: redis.Redis, kind: str) -> list[str]:
    """Every ``{ns}:<kind>:*`` key (KEYS is fine in a test; the engine never scans)."""
    return sorted(rs.keys(f"{PREFIX}{kind}:*"))


def blocked_in_blpop(rs: redis.Redis, count: int = 1, command: str = "blpop") -> bool:
    """True once at least ``count`` connections are blocked in BLPOP (or in
    ``command``: ``"xread"`` for holders in ``wait_for_contender``)."""
    clients = rs.client_list()
    return sum(1 for c in clients if c.get("cmd") == command and "b" in c.get("flags", "")) >= count


class Procs:
    """Forks child processes for one test and kills the survivors afterwards."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def start(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        proc = FORK.Process(target=target, args=args, kwargs=kwargs, daemon=True)
        proc.start()
        self.started.append(proc)
        return proc

    def join_ok(self, proc: Any, timeout: float = DEADLINE) -> None:
        proc.join(timeout)
        assert proc.exitcode == 0, f"child {proc.pid} ended with {proc.exitcode}"

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def child_waiter(
    url: str,
    name: str,
    exclusive: str | Iterable[str] | None = None,
    shared: str | Iterable[str] | None = None,
    *,
    timeout: float | None = 60.0,
    owner_ttl: float = 30.0,
    hold: bool = False,
) -> None:
    """Forked child: acquire with a fresh LockManager, log each step, release.

    Logs ``owner:<name>=<owner id>`` before asking, ``<name>`` once granted
    (inside the lock), ``<name>:releasing`` just before releasing (still
    inside: with hand-off the next holder may log before ``:released``),
    ``<name>:released`` after release, ``<name>:timeout``
    on LockTimeout and ``<name>:interrupted`` on KeyboardInterrupt. With
    ``hold``, keeps the lock until the test pushes to ``test:go:<name>``.
    """
    rs = client(url)
    mgr = LockManager(rs, NS, owner_ttl=owner_ttl)
    rs.rpush(LOG, f"owner:{name}={mgr.owner_id}")
    try:
        lease = mgr.acquire(exclusive, shared, timeout=timeout)
    except LockTimeout:
        rs.rpush(LOG, f"{name}:timeout")
        return
    except KeyboardInterrupt:
        rs.rpush(LOG, f"{name}:interrupted")
        return
    rs.rpush(LOG, name)
    if hold:
        rs.blpop([f"test:go:{name}"], timeout=0)
    rs.rpush(LOG, f"{name}:releasing")
    lease.release()
    rs.rpush(LOG, f"{name}:released")


def owner_of_child(rs: redis.Redis, name: str) -> str:
    """The owner id a child_waiter logged."""
    head = f"owner:{name}="
    found = wait_until(
        lambda: [e for e in log(rs) if e.startswith(head)], what=f"{name} logs its owner id"
    )
    return str(found[0][len(head) :])


class ThreadWaiter:
    """One acquire in a thread of this process; records the lease or the error."""

    def __init__(
        self,
        mgr: LockManager,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        timeout: float | None = 60.0,
        name: str = "waiter",
        rs: redis.Redis | None = None,
        release: bool = True,
    ) -> None:
        self.mgr = mgr
        self.args = (exclusive, shared)
        self.timeout = timeout
        self.rs = rs
        self.release = release
        self.lease: Any = None
        self.error: BaseException | None = None
        self.granted = threading.Event()
        self.done = threading.Event()
        self.granted_at = 0.0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.lease = self.mgr.acquire(*self.args, timeout=self.timeout)
            self.granted_at = time.monotonic()
            self.granted.set()
            if self.rs is not None:
                self.rs.rpush(LOG, self.thread.name)
            if self.release:
                self.lease.release()
        except BaseException as exc:  # recorded for the test to assert on
            self.error = exc
        finally:
            self.done.set()

    def join(self, timeout: float = DEADLINE) -> None:
        assert self.done.wait(timeout), f"thread {self.thread.name} did not finish"
        self.thread.join(timeout)


def pid_of_owner(owner_id: str) -> int:
    """Owner ids are ``<pid>-<hex>``."""
    return int(owner_id.split("-", 1)[0])
