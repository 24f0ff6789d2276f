"""A real Redis Cluster failover: a master is SIGKILLed and its replica promoted.

The module's cluster has three masters and one replica each
(``--cluster-node-timeout 1000``, no persistence, diskless sync), built by
tests/test_cluster.py's ``running_cluster(replicas=True)``. Each test fails
over a different master, using a namespace whose hash slot that master
serves, with managers made from one ``redis+cluster://`` URL (as
``redislock_url`` would make them). What a user relies on:

- during the switch every call raises :class:`RedisUnavailable` (never another
  exception type) within a bound of the socket timeout; afterwards the same
  manager (same client: no restart) acquires and releases on the promoted
  replica: the cluster client re-reads the slot map on its own;
- every fencing token issued after the failover is larger than every token
  issued before it, whether the replica had the last writes or missed them
  (the clock floor of ``next_fence`` in ``_common.lua``);
- a lock held across the failover is still held (same holder, same fence;
  its heartbeat beats on the new master; released normally) when the
  replica had it;
- when the replica missed the last writes, the grant made after the cut is
  gone: another manager takes the lock with a larger fence, and the old
  lease's release reports it lost; an owner whose registration itself was
  never replicated is told by its heartbeat (``on_lost``, cause "liveness
  expired") that its lease is lost.

Promotion is waited for as a condition (the replica reports role:master and
every survivor cluster_state:ok), never a sleep.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_redislock import LockManager
from celery_redislock.exceptions import CAUSE_EXPIRED
from celery_redislock.ops.inspector import Inspector
from engine_helpers import wait_until
from redis_server import RedisServer
from replica_helpers import (
    assert_the_held_lock_survived,
    assert_the_lost_grant_is_retaken,
    fences_before_the_failover,
    until_the_new_master_answers,
)
from test_cluster import MASTERS, SLOTS, _info_text, running_cluster

#: Socket (and connect) timeout of the managers' cluster URL, in seconds.
SOCKET_TIMEOUT = 1.0
#: Bound on one failed call during the switch: redis-py's cluster client
#: retries a connection error three times (with a short backoff) after
#: refreshing the slot map, each try up to the socket timeout; plus a wide
#: margin for a loaded machine. The default socket timeout (5 s) and a hung
#: call would both exceed it.
CALL_BOUND = 4 * SOCKET_TIMEOUT + 6.0
#: Deadline for the cluster to fail over (node timeout 1 s, election ~1 s).
FAILOVER_DEADLINE = 30.0
#: Owner TTL of the managers: longer than the whole switch may take, so a
#: lease is never lost to its own deadline here (only to the failover).
OWNER_TTL = FAILOVER_DEADLINE + 10.0


@pytest.fixture(scope="module")
def ha() -> Iterator[list[RedisServer]]:
    """3 masters then 3 replicas (servers[3 + i] replicates servers[i])."""
    fast = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")
    with running_cluster("--cluster-node-timeout", "1000", *fast, replicas=True) as servers:
        yield servers


def _namespace_on(master: int) -> str:
    """A fresh namespace whose hash slot master ``master`` serves."""
    per = SLOTS // MASTERS
    while True:
        ns = "fo" + uuid.uuid4().hex[:8]
        if master * per <= key_slot(("{" + ns + "}").encode()) < (master + 1) * per:
            return ns


def _url(servers: list[RedisServer]) -> str:
    seeds = ",".join(f"127.0.0.1:{s.port}" for s in servers[:MASTERS])
    return (
        f"redis+cluster://{seeds}/?socket_timeout={SOCKET_TIMEOUT}"
        f"&socket_connect_timeout={SOCKET_TIMEOUT}"
    )


class Managers:
    """Managers made from the cluster URL, closed at teardown."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url, self.namespace = url, namespace
        self.made: list[LockManager] = []

    def __call__(self, **kw: Any) -> LockManager:
        kw.setdefault("heartbeat", False)
        kw.setdefault("owner_ttl", OWNER_TTL)
        mgr = LockManager(self.url, self.namespace, **kw)
        self.made.append(mgr)
        return mgr

    def close(self) -> None:
        for mgr in self.made:
            mgr.close()


def _promoted(replica: RedisServer, survivors: list[RedisServer]) -> bool:
    try:
        client = replica.client(socket_timeout=2)
        try:
            if client.info("replication").get("role") != "master":
                return False
        finally:
            client.close()
        for server in survivors:
            c = server.client(socket_timeout=2)
            try:
                if "cluster_state:ok" not in _info_text(c.execute_command("CLUSTER", "INFO")):
                    return False
            finally:
                c.close()
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    return True


def _until_the_new_master_answers(mgr: LockManager) -> tuple[int, int]:
    """Retry acquire+release on ``mgr`` until it works: (its fence, failed calls)."""
    return until_the_new_master_answers(mgr, CALL_BOUND, FAILOVER_DEADLINE)


def _sync(master: RedisServer, ns: str) -> None:
    """The replica has every write so far (a write in the slot, then WAIT 1)."""
    client = master.client(socket_timeout=10)
    try:
        client.set("{" + ns + "}:sync-marker", "1")
        assert client.wait(1, 10_000) == 1
    finally:
        client.close()


def _until_promoted(
    other: LockManager, replica: RedisServer, ha: list[RedisServer]
) -> tuple[int, int]:
    """After the master's kill: :func:`_until_the_new_master_answers` for
    ``other``, then wait until ``replica`` is promoted; (fence, failures)."""
    fence, failures = _until_the_new_master_answers(other)
    wait_until(
        lambda: _promoted(replica, [s for s in ha if s.process is not None]),
        FAILOVER_DEADLINE,
        "the replica's promotion",
        interval=0.05,
    )
    return fence, failures


def _shard(ha: list[RedisServer], index: int) -> tuple[RedisServer, RedisServer, str, Managers]:
    """Master ``index``, its replica, a namespace it serves and managers in it."""
    ns = _namespace_on(index)
    return ha[index], ha[MASTERS + index], ns, Managers(_url(ha), ns)


def test_failover_to_an_in_sync_replica_keeps_the_lock_and_the_client_follows(
    ha: list[RedisServer],
) -> None:
    master, replica, ns, managers = _shard(ha, 0)
    try:
        other = managers()
        mgr = managers(heartbeat=True, heartbeat_interval=0.5)
        client = mgr.client
        assert client.get_node_from_key("{" + ns + "}:x").port == master.port
        before, held = fences_before_the_failover(mgr)
        _sync(master, ns)

        master.kill()
        fence, failures = _until_promoted(other, replica, ha)
        assert failures > 0  # the calls right after the kill did meet the switch
        assert fence > max(before)

        # The holder's own client (idle since the kill) re-reads the slot map
        # at its next call: same client object, now routed to the promoted
        # replica, without a restart.
        _until_the_new_master_answers(mgr)
        assert mgr.client is client
        assert client.get_node_from_key("{" + ns + "}:x").port == replica.port
        # The heartbeat (its own cloned cluster client) beats on the new master.
        assert_the_held_lock_survived(mgr, other, held)

        after = []
        with other.lock(exclusive=["held"], timeout=5) as lease:
            after.append(lease.fencing_token)
        with mgr.lock(exclusive=["a"], shared=["s"], timeout=5) as lease:
            after.append(lease.fencing_token)
        assert min(after) > max(before)
        assert after == sorted(after) and len(set(after)) == len(after)
    finally:
        managers.close()


def test_failover_to_a_replica_that_missed_the_last_writes_reports_the_loss_and_grows_fences(
    ha: list[RedisServer],
) -> None:
    # The replica misses the last writes: it is stopped (SIGSTOP, so it cannot
    # reconnect), the master drops its replication link, two grants are made
    # on the master only (one by an owner registered before the cut, one by
    # an owner whose registration itself is after it), and the master is
    # SIGKILLed before the replica resumes.
    master, replica, ns, managers = _shard(ha, 1)
    try:
        mgr = managers(heartbeat=True, heartbeat_interval=0.5)
        other = managers()
        before = []
        for _ in range(3):
            with mgr.lock(exclusive=["a"], timeout=5) as lease:
                before.append(lease.fencing_token)
        _sync(master, ns)  # mgr's registration and these grants are replicated

        assert replica.process is not None
        direct = master.client(socket_timeout=5)
        os.kill(replica.process.pid, signal.SIGSTOP)
        try:
            direct.execute_command("CLIENT", "KILL", "TYPE", "replica")
            wait_until(
                lambda: direct.info("replication")["connected_slaves"] == 0,
                what="the master to drop its replica",
            )
            held = mgr.acquire(exclusive=["held"], timeout=5)
            late = managers(heartbeat=True, heartbeat_interval=0.5)
            causes: list[str | None] = []
            late_lease = late.acquire(exclusive=["late"], timeout=5)
            late_lease.add_lost_hook(lambda _lease, cause: causes.append(cause))
            before += [held.fencing_token, late_lease.fencing_token]
            direct.close()
            master.kill()
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        assert before == sorted(before) and len(set(before)) == len(before)
        # The replica really missed the last fence increments: its counter is
        # the last one before the cut (read before anything is granted again).
        on_replica = replica.client(socket_timeout=5, decode_responses=True)
        try:
            on_replica.execute_command("READONLY")  # read a slot of its master
            assert int(on_replica.get("{" + ns + "}:fence")) == before[2] < held.fencing_token
        finally:
            on_replica.close()

        fence, failures = _until_promoted(other, replica, ha)
        assert failures > 0
        # The clock floor (TIME in µs) keeps the new master's tokens above the
        # ones it never saw.
        assert fence > max(before)

        # The owner registered after the cut: its liveness key is not on the
        # new master, so its heartbeat marks its lease lost and says why.
        wait_until(lambda: late_lease.lost, what="the late owner's heartbeat to see the loss")
        assert causes == [CAUSE_EXPIRED] and late_lease.lost_cause == CAUSE_EXPIRED

        # The grant made after the cut is gone: another manager takes the lock
        # with a larger fence; the old lease's release frees nothing of the
        # new holder's and reports the lease lost.
        assert Inspector(other).holders("held") == []
        newer = assert_the_lost_grant_is_retaken(other, held)
        with mgr.lock(exclusive=["held"], timeout=5) as lease:
            assert lease.fencing_token > newer.fencing_token > max(before)
    finally:
        managers.close()
