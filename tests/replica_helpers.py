"""A real master and one replica of it (``--replicaof``), for tests and benchmarks.

:class:`Pair` starts both (diskless sync, so the replica is in sync within a
moment), reads either directly, and pauses the replica with SIGSTOP so that
the master's ``WAIT`` gets no acknowledgement (``resume_replica`` sends
SIGCONT; ``close`` always does). :func:`start_master_and_replica` starts
such a pair for other setups (a Sentinel group), and
:func:`until_the_new_master_answers` is the retry loop a user writes while a
failover switches masters; ``assert_the_held_lock_survived`` and
``assert_the_lost_grant_is_retaken`` check a lock held across one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from celery_redislock import Lease, LockManager, LockTimeout, RedisUnavailable
from celery_redislock.ops.inspector import Inspector
from engine_helpers import wait_until
from redis_server import LOOPBACK, RedisServer


def fences_before_the_failover(mgr: LockManager) -> tuple[list[int], Lease]:
    """Three grants of ``a`` (exclusive) with ``s`` (shared), released, then
    ``held``, kept: their fencing tokens in grant order, and the held lease."""
    before = []
    for _ in range(3):
        with mgr.lock(exclusive=["a"], shared=["s"], timeout=5) as lease:
            before.append(lease.fencing_token)
    held = mgr.acquire(exclusive=["held"], timeout=5)
    before.append(held.fencing_token)
    return before, held


def start_master_and_replica(workdir: Path) -> tuple[RedisServer, RedisServer]:
    """Start a master and a replica of it (diskless sync) below ``workdir``."""
    fast_sync = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
    master = RedisServer(workdir=workdir / "master", extra_args=fast_sync)
    master.start()
    replica = RedisServer(
        workdir=workdir / "replica",
        extra_args=[*fast_sync, "--replicaof", LOOPBACK, str(master.port)],
    )
    replica.start()
    return master, replica


def until_the_new_master_answers(
    mgr: LockManager, call_bound: float, deadline: float
) -> tuple[int, int]:
    """Retry acquire+release on ``mgr`` until it works: (its fence, failed calls).

    The retry loop a user writes: every failed call must raise
    RedisUnavailable (anything else fails the test) within ``call_bound``
    seconds; the acquire must work within ``deadline`` seconds.
    """
    failures = 0

    def attempt() -> int | None:
        nonlocal failures
        started = time.monotonic()
        try:
            lease = mgr.acquire(exclusive=["probe"], timeout=0)
        except RedisUnavailable as exc:
            took = time.monotonic() - started
            assert took < call_bound, f"a call hung {took:.1f}s during the switch: {exc}"
            failures += 1
            return None
        lease.release()
        assert not lease.lost
        return lease.fencing_token

    fence: int = wait_until(attempt, deadline, "an acquire on the new master", interval=0.02)
    return fence, failures


def assert_the_held_lock_survived(mgr: LockManager, other: LockManager, held: Lease) -> None:
    """After a failover to an in-sync replica, ``held`` (a lease of ``mgr`` on
    "held") is there on the new master: same holder, same fence; ``other``
    cannot take it; ``mgr``'s heartbeat beats there and the lease is not
    lost; its release frees the lock."""
    holders = Inspector(other).holders("held")
    assert [(h.token, h.fence) for h in holders] == [(held.token, held.fencing_token)]
    with pytest.raises(LockTimeout):
        other.acquire(exclusive=["held"], timeout=0)
    ticks = mgr.heartbeat.ticks
    wait_until(lambda: mgr.heartbeat.ticks >= ticks + 2, what="two heartbeats on the new master")
    assert not held.lost
    held.release()
    assert not held.lost and Inspector(other).holders("held") == []


def assert_the_lost_grant_is_retaken(other: LockManager, held: Lease) -> Lease:
    """After a failover that lost the grant ``held`` (of "held"), ``other``
    takes the lock at once with a larger fence; the old lease's release frees
    nothing of the new holder's and reports the lease lost. The new lease,
    released again."""
    newer = other.acquire(exclusive=["held"], timeout=0)
    assert newer.fencing_token > held.fencing_token
    assert not held.lost  # its owner is alive: nothing told it yet
    held.release()
    assert held.lost
    holders = Inspector(other).holders("held")
    assert [(h.token, h.fence) for h in holders] == [(newer.token, newer.fencing_token)]
    newer.release()
    return newer


class Pair:
    """A master and one replica of it."""

    def __init__(self, workdir: Path) -> None:
        self.master, self.replica = start_master_and_replica(workdir)
        self.m = self.master.client(socket_timeout=5)
        self.r = self.replica.client(socket_timeout=5)
        self.paused = False

    def in_sync(self) -> bool:
        info: dict[str, Any] = self.r.info("replication")
        if info.get("master_link_status") != "up":
            return False
        return int(self.m.info("replication").get("connected_slaves", 0)) == 1

    def pause_replica(self) -> None:
        assert self.replica.process is not None
        os.kill(self.replica.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume_replica(self) -> None:
        if self.paused and self.replica.process is not None:
            os.kill(self.replica.process.pid, signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        self.resume_replica()
        self.m.close()
        self.r.close()
        self.replica.close()
        self.master.close()
