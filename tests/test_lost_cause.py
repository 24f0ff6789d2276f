"""A lost lease says why: released by an operator, owner declared dead,
liveness expired, or Redis lost the lock (Lease.lost_cause, LockLost.cause,
the heartbeat.lost log line)."""

from __future__ import annotations

import logging

import pytest
import redis

from celery_redislock import Lease, LockLost, LockManager
from celery_redislock.exceptions import (
    CAUSE_DECLARED_DEAD,
    CAUSE_EXPIRED,
    CAUSE_OPERATOR,
    CAUSE_REDIS_LOST,
)
from engine_helpers import Managers, wait_until


def _quiet_holder(managers: Managers) -> tuple[LockManager, Lease]:
    """A manager whose heartbeat does not beat during the test, holding ``a``."""
    mgr = managers(owner_ttl=30, heartbeat_interval=10)
    return mgr, mgr.acquire("a", timeout=5)


def _assert_lost_at_the_next_acquire(mgr: LockManager, lease: Lease, cause: str) -> None:
    """``mgr``'s next acquire finds its owner gone: ``lease`` is lost, for ``cause``."""
    mgr.acquire("b", timeout=5)
    assert lease.lost
    assert lost_cause(lease) == cause


def lost_cause(lease: object) -> str | None:
    with pytest.raises(LockLost) as info:
        lease.check()  # type: ignore[attr-defined]
    return info.value.cause


def test_operator_release_is_named_as_the_cause_by_a_heartbeat_owner(
    managers: Managers, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = managers(heartbeat_interval=0.1)
    lease = mgr.acquire("a", timeout=5)
    cli = managers(heartbeat=False)
    with caplog.at_level(logging.ERROR, "celery_redislock.heartbeat"):
        cli.cleanup_owner(lease.owner_id, force=True, reason="operator")
        wait_until(lambda: lease.lost, what="the heartbeat to find the owner gone")
    assert lease.lost_cause == CAUSE_OPERATOR
    assert lost_cause(lease) == CAUSE_OPERATOR
    assert "released by operator via CLI" in str(LockLost(("a",), "o", 1, CAUSE_OPERATOR))
    lines = [r.getMessage() for r in caplog.records if "heartbeat.lost" in r.getMessage()]
    assert len(lines) == 1 and 'cause="released by operator via CLI"' in lines[0], lines


def test_operator_release_is_named_by_a_watched_owner_even_after_a_second_cleanup(
    managers: Managers, r: redis.Redis
) -> None:
    # A pool child (liveness refreshed by another process, a watcher thread
    # of its own). Its worker's tick cleans it again after the operator did:
    # the first reason stands.
    child = managers(heartbeat=False)
    cli = managers(heartbeat=False)
    lease = child.acquire("a", timeout=5)
    cli.cleanup_owner(lease.owner_id, force=True, reason="operator")
    cli.cleanup_owner(lease.owner_id, force=True)  # the worker's tick, later
    assert r.get("{t}:dead:" + lease.owner_id) == b"operator"
    wait_until(lambda: lease.lost, what="the watcher to mark the lease lost")
    assert lost_cause(lease) == CAUSE_OPERATOR


def test_a_cleanup_by_the_worker_or_reconcile_reads_owner_declared_dead(
    managers: Managers,
) -> None:
    child = managers(heartbeat=False)
    other = managers(heartbeat=False)
    lease = child.acquire("a", timeout=5)
    other.cleanup_owner(lease.owner_id, force=True)
    wait_until(lambda: lease.lost, what="the watcher to mark the lease lost")
    assert lost_cause(lease) == CAUSE_DECLARED_DEAD


def test_a_lapsed_liveness_reads_liveness_expired(managers: Managers) -> None:
    mgr = managers(owner_ttl=0.5, heartbeat_interval=0.1)
    lease = mgr.acquire("a", timeout=5)
    mgr.heartbeat.stop()  # a pause: nothing refreshes the owner any more
    wait_until(lambda: lease.lost, what="the local deadline to pass")
    assert lost_cause(lease) == CAUSE_EXPIRED


def test_redis_losing_its_data_reads_redis_lost_the_lock(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers(heartbeat_interval=0.1)
    lease = mgr.acquire("a", timeout=5)
    r.flushall()  # a restart without persistence, in effect
    wait_until(lambda: lease.lost, what="the heartbeat to find the owner gone")
    assert lost_cause(lease) == CAUSE_REDIS_LOST


def test_redis_losing_its_data_reads_so_even_after_another_process_acquired_again(
    managers: Managers, r: redis.Redis
) -> None:
    # Another process's grant creates the fencing counter again before this
    # owner finds its liveness key gone: the loss still reads as Redis's.
    mgr, lease = _quiet_holder(managers)
    r.flushall()  # a restart without persistence, in effect
    managers(heartbeat=False).acquire("z", timeout=5)  # the counter and format are back
    assert r.exists("{t}:fence") and r.exists("{t}:format")
    _assert_lost_at_the_next_acquire(
        mgr, lease, CAUSE_REDIS_LOST
    )  # finds its owner gone: a new identity


def test_a_liveness_key_gone_alone_reads_liveness_expired(
    managers: Managers, r: redis.Redis
) -> None:
    mgr, lease = _quiet_holder(managers)
    managers(heartbeat=False).acquire("z", timeout=5)  # a later grant of the same data
    r.delete("{t}:alive:" + lease.owner_id)  # evicted, or expired while paused
    _assert_lost_at_the_next_acquire(mgr, lease, CAUSE_EXPIRED)


def test_a_namespace_written_before_its_birth_was_recorded_reads_liveness_expired(
    managers: Managers, r: redis.Redis
) -> None:
    # Data of a release that kept no {ns}:born: the counter alone decides.
    mgr, lease = _quiet_holder(managers)
    r.delete("{t}:born", "{t}:alive:" + lease.owner_id)
    mgr.acquire("b", timeout=5)
    assert lost_cause(lease) == CAUSE_EXPIRED
