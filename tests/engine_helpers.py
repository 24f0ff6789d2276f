"""Shared helpers for the engine tests (tests/test_engine_*.py).

- :func:`wait_until`: poll a condition every few ms up to a generous deadline.
- :class:`Managers`: makes LockManagers for one test and closes them after.
- :func:`namespace_keys`, :func:`assert_registry_truth`: read the engine's
  state straight from Redis (KEYS on the test client is fine here: the
  engine itself never scans).
- :func:`commandstats`, :func:`command_delta`: ``INFO commandstats`` counters
  and their difference, to count the commands an operation made.
- :func:`queue_requests`: queued requests with no waiting thread (dead
  entries once the owner's liveness key is deleted).
- :func:`acquire_as_task`: acquire as ``@locked`` does in a task (with a
  holder record).
- :class:`Child` and the ``child_*`` targets: a holder or waiter in a spawned
  process with its own LockManager, talking to the test over a pipe.

This module is imported by spawned children too, so it imports nothing from
the test modules and keeps every child target at module level.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import redis

from acl_helpers import admin_url
from celery_redislock import Lease, LockLost, LockManager

#: Default deadline of every wait in these tests (seconds). Generous: the
#: machine is small and shared.
DEADLINE = 20.0


def wait_until(
    cond: Callable[[], Any], timeout: float = DEADLINE, what: str = "", *, interval: float = 0.005
) -> Any:
    """Return ``cond()`` once it is truthy; fail the test after ``timeout`` seconds.

    The one polling helper of the suite (engine, fairness, inspect, node and
    quick Celery tests): it waits on a condition, never a fixed sleep.
    """
    deadline = time.monotonic() + timeout
    while (value := met(cond(), deadline, timeout, what or cond)) is None:
        time.sleep(interval)
    return value


def met(value: Any, deadline: float, timeout: float, what: object) -> Any:
    """``value`` when it is truthy, else None; fails the test once the
    monotonic ``deadline`` (``timeout`` seconds after the wait began) has
    passed. The one step of every wait on a condition (the asyncio tests'
    ones await between steps)."""
    if value:
        return value
    if time.monotonic() > deadline:
        raise AssertionError(f"condition not met within {timeout}s: {what}")
    return None


class Managers:
    """Creates LockManagers for a test; ``close_all()`` stops their heartbeats.

    ``managers(**kw)`` connects to the ``url`` given here, ``managers(url,
    **kw)`` (or ``url=``) to another one. Keyword arguments override
    ``defaults``, then ``namespace`` and ``owner_ttl=30``.
    """

    def __init__(self, url: Any = None, namespace: str = "t", **defaults: Any) -> None:
        self.url = url
        self.namespace = namespace
        self.defaults = defaults
        self.made: list[LockManager] = []

    def __call__(self, url: Any = None, /, **kwargs: Any) -> LockManager:
        kwargs = {**self.defaults, **kwargs}
        kwargs.setdefault("namespace", self.namespace)
        kwargs.setdefault("owner_ttl", 30.0)
        if url is None:
            url = kwargs.pop("url", self.url)
        if url is None:
            raise TypeError("Managers: no url given here or at construction")
        mgr = LockManager(url, **kwargs)
        self.made.append(mgr)
        return mgr

    def close_all(self) -> None:
        for mgr in self.made:
            try:
                mgr.close()
            except Exception:
                pass
        self.made.clear()


# -- reading the engine's state from Redis --------------------------------


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def namespace_keys(r: redis.Redis, namespace: str = "t") -> set[str]:
    """Every key of ``namespace`` (test-side KEYS: fine in tests)."""
    prefix = "{" + namespace + "}:"
    return {_s(k) for k in r.keys(glob_escape(prefix) + "*")}


def all_keys(r: redis.Redis) -> set[str]:
    return {_s(k) for k in r.keys("*")}


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def kinds(keys: Iterable[str], namespace: str = "t") -> set[str]:
    """The kind part of each key (``lock``, ``q``, ``held``, ...)."""
    prefix = "{" + namespace + "}:"
    return {k[len(prefix) :].split(":", 1)[0] for k in keys}


def lock_holders(r: redis.Redis, namespace: str = "t") -> dict[str, dict[str, str]]:
    """lock key -> {holder token: mode} for every lock hash of the namespace.

    The mode is the first character of the stored value (``'x'`` or ``'s'``);
    the fencing token that follows it is left out (see :func:`lock_fences`).
    """
    out: dict[str, dict[str, str]] = {}
    for key in namespace_keys(r, namespace):
        if key.startswith("{" + namespace + "}:lock:") and _s(r.type(key)) == "hash":
            out[key] = {_s(t): _s(v)[:1] for t, v in r.hgetall(key).items()}
    return out


def lock_fences(r: redis.Redis, lock_key: str) -> dict[str, int]:
    """{holder token: fencing token stored with its grant} of one lock hash."""
    return {_s(t): int(_s(v)[1:].partition(":")[0]) for t, v in r.hgetall(lock_key).items()}


def registries(r: redis.Redis, namespace: str = "t") -> dict[str, set[str]]:
    """owner id -> lock keys in its registry, for every registry in Redis.

    A registry is a hash of resource names (each with the value ``''``);
    they are returned as lock keys ``{ns}:lock:<resource>``. An owner that
    spilled (``manager.REGISTRY_SPILL_AT``) also has a bucket index
    ``{ns}:held:<owner>|`` and buckets ``{ns}:held:<owner>|<b>``: their names
    count as its registry, and every bucket must be listed in the index.
    """
    head = "{" + namespace + "}:held:"
    lock = "{" + namespace + "}:lock:"

    def entries() -> Iterator[tuple[str, set[str]]]:
        for key in namespace_keys(r, namespace):
            if not key.startswith(head):
                continue
            fields = {_s(f): _s(v) for f, v in r.hgetall(key).items()}
            assert set(fields.values()) <= {""}, f"{key}: {fields}"
            yield key[len(head) :], set(fields)

    found = registry_names(entries())
    return {owner: {lock + name for name in names} for owner, names in found.items()}


def registry_names(entries: Iterable[tuple[str, Iterable[str]]]) -> dict[str, set[str]]:
    """owner -> resource names, from ``(key after held:, field names)`` pairs.

    ``<owner>`` is a main registry, ``<owner>|`` a bucket index and
    ``<owner>|<b>`` a bucket: the names of the main hash and of the buckets
    count; a bucket its index does not list fails.
    """
    out: dict[str, set[str]] = {}
    indexes: dict[str, set[str]] = {}
    buckets: dict[str, set[str]] = {}
    for key, names in entries:
        owner, bar, bucket = key.partition("|")
        if bar and not bucket:
            indexes[owner] = set(names)
            continue
        if bar:
            buckets.setdefault(owner, set()).add(bucket)
        if names:
            out.setdefault(owner, set()).update(names)
    for owner, found in buckets.items():
        assert found <= indexes.get(owner, set()), f"{owner}: buckets {found} not indexed"
    return out


def held_by_owner(r: redis.Redis, namespace: str = "t") -> dict[str, set[str]]:
    """owner id -> lock keys in which it has at least one holder token."""
    out: dict[str, set[str]] = {}
    for key, holders in lock_holders(r, namespace).items():
        for token in holders:
            out.setdefault(token.split("|", 1)[0], set()).add(key)
    return out


def assert_registry_truth(r: redis.Redis, namespace: str = "t") -> None:
    """Invariant 4: every owner's registry is exactly the lock keys it holds."""
    assert registries(r, namespace) == held_by_owner(r, namespace)


def queue_requests(
    mgr: LockManager, count: int, exclusive: Any = None, shared: Any = None
) -> list[str]:
    """Queue ``count`` requests of ``mgr``'s owner with its own acquire script,
    no thread waiting for them (each must be blocked). Returns their tokens.

    Deleting the owner's liveness key afterwards leaves dead queue entries,
    as the owner's liveness expiring would.
    """
    ident = mgr.liveness.identity.current()
    req = mgr.request(exclusive, shared)
    tokens = []
    for _ in range(count):
        token = f"{ident.owner_id}|{uuid.uuid4().hex}"
        reply = mgr.acquirer.attempt(ident, token, req, True, False)
        assert int(reply[0]) == 0, reply  # blocked, hence queued
        ident.registered = True
        tokens.append(token)
    return tokens


def acquire_as_task(
    mgr: LockManager,
    info: str,
    exclusive: str | list[str] | None = None,
    shared: list[str] | None = None,
    timeout: float | None = 5.0,
) -> Lease:
    """Acquire as ``@locked`` does in a task: ``info`` (``task name\ntask
    id\nnode``) is the thread's holder for this one call, so the grant
    carries its holder record."""
    with mgr.context.using(holder=info):
        return mgr.acquire(exclusive, shared, timeout=timeout)


# -- INFO commandstats ------------------------------------------------------


def commandstats(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started (``INFO commandstats``)."""
    raw = client.execute_command("INFO", "commandstats")
    text = _s(raw) if isinstance(raw, (bytes, str)) else None
    out: dict[str, int] = {}
    if text is None:  # already parsed by redis-py
        for name, stats in dict(raw).items():
            out[str(name).removeprefix("cmdstat_")] = int(stats["calls"])
        return out
    for line in text.splitlines():
        if not line.startswith("cmdstat_"):
            continue
        name, _, fields = line.partition(":")
        calls = dict(f.split("=", 1) for f in fields.split(","))["calls"]
        out[name.removeprefix("cmdstat_")] = int(calls)
    return out


#: Commands the measuring itself or a connection handshake makes.
NOT_COUNTED = frozenset({"info", "hello", "client|setinfo", "client", "select", "ping"})


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two :func:`commandstats` readings (non-zero only)."""
    out = {}
    for name, calls in after.items():
        if name in NOT_COUNTED:
            continue
        diff = calls - before.get(name, 0)
        if diff:
            out[name] = diff
    return out


@contextmanager
def counting(client: redis.Redis) -> Iterator[dict[str, int]]:
    """``with counting(r) as delta:`` fills ``delta`` with the commands run inside."""
    delta: dict[str, int] = {}
    before = commandstats(client)
    yield delta
    delta.update(command_delta(before, commandstats(client)))


# -- child processes --------------------------------------------------------


class Child:
    """A spawned process running ``target(conn, *args)``, talking over a pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def recv(self, timeout: float = DEADLINE) -> Any:
        """The child's next message; fail if none comes within ``timeout``."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.pid} sent nothing within {timeout}s")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise AssertionError(f"child {self.pid} failed: {msg[1]}")
        return msg

    def expect(self, kind: str, timeout: float = DEADLINE) -> tuple[Any, ...]:
        msg = self.recv(timeout)
        assert msg[0] == kind, msg
        return tuple(msg)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.join(10)
        self.conn.close()


def _guard(conn: Connection, body: Callable[[], None]) -> None:
    try:
        body()
    except BaseException as exc:  # report, so the test fails with the cause
        import traceback

        try:
            conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        except Exception:
            pass
        raise


def _obey(
    conn: Connection, mgr: LockManager, lease: Lease, **more: Callable[[], tuple[Any, ...]]
) -> None:
    """Answer the test's commands until ``("exit",)`` (closes ``mgr``):
    ``("release",)`` -> ``("released",)``; ``more``: command name -> the
    maker of its answer."""
    while True:
        cmd = conn.recv()
        if cmd[0] in more:
            conn.send(more[cmd[0]]())
        elif cmd[0] == "release":
            lease.release()
            conn.send(("released",))
        elif cmd[0] == "exit":
            mgr.close()
            return


def child_holder(
    conn: Connection,
    url: str,
    namespace: str,
    owner_ttl: float,
    exclusive: list[str],
    shared: list[str],
) -> None:
    """Acquire, report ``("held", fence, owner_id, token)``, then obey commands.

    Commands: ``("wait_lost",)`` -> waits until the lease is lost and answers
    ``("lost", lease.lost, check_raised_LockLost, fence)``; ``("check",)`` ->
    calls ``lease.check()`` at once and answers ``("checked",
    check_raised_LockLost, lease.lost)``; ``("release",)`` ->
    ``("released",)``; ``("exit",)``.
    """

    def body() -> None:
        mgr = LockManager(url, namespace=namespace, owner_ttl=owner_ttl)
        lease = mgr.acquire(exclusive=exclusive, shared=shared, timeout=DEADLINE)
        conn.send(("held", lease.fencing_token, lease.owner_id, lease.token))

        def check_raised() -> bool:
            try:
                lease.check()
            except LockLost:
                return True
            return False

        def wait_lost() -> tuple[Any, ...]:
            wait_until(lambda: lease.lost, what="lease.lost in the paused holder")
            raised = check_raised()
            return ("lost", lease.lost, raised, lease.fencing_token)

        def check() -> tuple[Any, ...]:
            raised = check_raised()
            return ("checked", raised, lease.lost)

        _obey(conn, mgr, lease, wait_lost=wait_lost, check=check)

    _guard(conn, body)


def child_waiter(
    conn: Connection,
    url: str,
    namespace: str,
    owner_ttl: float,
    exclusive: list[str],
    shared: list[str],
    timeout: float,
) -> None:
    """Report ``("waiting", owner_id)``, acquire (blocking), report
    ``("acquired", fence, time.monotonic(), token)``, then obey ``release``/``exit``."""

    def body() -> None:
        mgr = LockManager(url, namespace=namespace, owner_ttl=owner_ttl)
        conn.send(("waiting", mgr.owner_id))
        lease = mgr.acquire(exclusive=exclusive, shared=shared, timeout=timeout)
        conn.send(("acquired", lease.fencing_token, time.monotonic(), lease.token))
        _obey(conn, mgr, lease)

    _guard(conn, body)


def child_mutex_worker(
    conn: Connection, url: str, namespace: str, seed: int, iterations: int
) -> None:
    """Mixed-mode lock traffic on resources ``a`` and ``b``.

    Every iteration picks one of four request shapes. Inside the lease it
    appends ``enter|<res>|<mode>|<id>`` and ``exit|...`` events to the list
    ``events`` (plain key, outside the namespace), and writers of ``a`` do a
    non-atomic read-modify-write of ``counter`` (GET, then SET + 1 in a later
    round trip). Reports ``("ready",)``, waits for ``("go",)``, ends with
    ``("done", writes_of_a)``.
    """

    def body() -> None:
        mgr = LockManager(url, namespace=namespace, owner_ttl=10.0)
        data = redis.Redis.from_url(admin_url(url), decode_responses=True)
        rng = random.Random(seed)
        shapes: list[tuple[list[str], list[str]]] = [
            (["a"], []),  # writer of a
            (["a", "b"], []),  # writer of both
            ([], ["a", "b"]),  # reader of both
            (["b"], ["a"]),  # writer of b, reader of a
        ]
        conn.send(("ready",))
        assert conn.recv()[0] == "go"
        writes = 0
        for i in range(iterations):
            exclusive, shared = rng.choice(shapes)
            ident = f"{os.getpid()}:{i}"
            with mgr.lock(exclusive=exclusive, shared=shared, timeout=60) as lease:
                held = [(res, "x") for res in exclusive] + [(res, "s") for res in shared]
                for res, mode in held:
                    data.rpush("events", f"enter|{res}|{mode}|{ident}|{lease.fencing_token}")
                if "a" in exclusive:
                    value = int(data.get("counter") or 0)
                    data.rpush("trace", ident)  # one more round trip inside the window
                    data.set("counter", value + 1)
                    writes += 1
                else:
                    data.get("counter")
                for res, mode in held:
                    data.rpush("events", f"exit|{res}|{mode}|{ident}|{lease.fencing_token}")
        conn.send(("done", writes))
        mgr.close()
        data.close()

    _guard(conn, body)


def check_event_log(events: list[str]) -> dict[str, int]:
    """Replay enter/exit events; fail on two incompatible holders at once.

    Returns, per resource, the most holders seen inside at the same time.
    """
    inside: dict[str, dict[str, str]] = {}
    most: dict[str, int] = {}
    top_fence: dict[str, int] = {}  # highest fence that entered each resource
    top_x_fence: dict[str, int] = {}  # highest fence of an exclusive entry
    for event in events:
        kind, res, mode, ident, fence_s = event.split("|")
        fence = int(fence_s)
        now = inside.setdefault(res, {})
        if kind == "enter":
            assert ident not in now, event
            if mode == "x":
                assert not now, f"{event} while {now} inside"
                # every earlier holder was granted earlier: a smaller fence
                assert fence > top_fence.get(res, 0), event
                top_x_fence[res] = fence
            else:
                assert "x" not in now.values(), f"{event} while {now} inside"
                assert fence > top_x_fence.get(res, 0), event
            top_fence[res] = max(top_fence.get(res, 0), fence)
            now[ident] = mode
            most[res] = max(most.get(res, 0), len(now))
        else:
            assert now.pop(ident) == mode, event
    assert all(not now for now in inside.values()), inside
    return most


def run_scenario(script: str, redis_url: str, scenario: str) -> dict[str, Any]:
    """Run ``tests/scripts/<script>`` (a monkey-patching engine scenario) in a
    fresh interpreter and return the JSON object it prints last."""
    path = Path(__file__).parent / "scripts" / script
    # This checkout's package first (not whichever one the venv installed).
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(path), redis_url, scenario],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
