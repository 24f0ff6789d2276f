"""The loss model: a holder that lost its lock knows it, at the latest at its
next ``lease.check()`` (docs/design.md, "Loss model").

Against real redis-servers: a holder paused past owner_ttl (a SIGSTOPped
process, a stopped heartbeat), Redis losing its data (restart, FLUSHALL),
eviction (the policy check, a real eviction of a liveness key), close(),
and the identity races (a dead owner revived by a stale registration, a
grant landing on a retired identity).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock import ConfigurationError, Lease, LockError, LockLost, LockManager
from celery_redislock.engine.identity import OwnerIdentity
from engine_helpers import Child, Managers, child_holder, lock_holders, wait_until
from redis_server import RedisServer


def alive(owner: str) -> str:
    return "{t}:alive:" + owner


def raises_lost(lease: object) -> bool:
    try:
        lease.check()  # type: ignore[attr-defined]
    except LockLost:
        return True
    return False


def holding(managers: Managers, **kw: Any) -> tuple[LockManager, Lease]:
    """A manager made with ``kw`` and its lease of "a"."""
    mgr = managers(**kw)
    return mgr, mgr.acquire("a", timeout=5)


def queued_acquire(
    r: redis.Redis, mgr: LockManager, timeout: float
) -> tuple[threading.Thread, list[Any]]:
    """``mgr.acquire("a", timeout)`` in a thread, returned once its request is queued.

    The thread appends what the call returned (or raised) to the list returned.
    """
    out: list[Any] = []

    def wait() -> None:
        try:
            out.append(mgr.acquire("a", timeout=timeout))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    wait_until(lambda: r.zcard("{t}:q:a") == 1, what="queued")
    return t, out


def assert_goes_on_under_a_new_identity(mgr: LockManager, old_owner: str, resource: str) -> None:
    """A new acquire of ``mgr`` works, under another owner than ``old_owner``."""
    fresh = mgr.acquire(resource, timeout=5)
    assert fresh.owner_id != old_owner and not fresh.lost
    fresh.release()


# -- 1. the local deadline -----------------------------------------------------


def test_holder_resumed_after_sigstop_past_owner_ttl_fails_its_first_check(
    redis_url: str, r: redis.Redis, closing: list[Child]
) -> None:
    # A real process, stopped longer than owner_ttl then continued: the very
    # first check() it makes raises, before its heartbeat had a chance to run.
    for _ in range(3):  # every time, not by luck of thread scheduling
        r.flushall()
        holder = Child(child_holder, redis_url, "t", 1.0, ["a"], [])
        closing.append(holder)
        _, _, owner, _ = holder.expect("held")
        holder.signal(signal.SIGSTOP)
        try:
            key = alive(owner)
            wait_until(lambda: not r.exists(key), what="liveness expired in Redis")  # noqa: B023
            holder.send("check")  # waiting in the pipe when the process resumes
        finally:
            holder.signal(signal.SIGCONT)
        _, raised, lost = holder.expect("checked")
        assert (raised, lost) == (True, True)
        holder.close()


def test_stopped_heartbeat_makes_the_lease_lost_without_a_round_trip(
    managers: Managers, r: redis.Redis
) -> None:
    mgr, lease = holding(managers, owner_ttl=2.0)
    assert not lease.lost and lease.deadline > time.monotonic()
    mgr.heartbeat.stop()  # a GC pause, a starved thread: nothing refreshes
    wait_until(lambda: not r.exists(alive(lease.owner_id)), what="liveness expired")
    assert raises_lost(lease) and lease.lost
    assert lease.deadline < time.monotonic()
    # the lock is another's now, with a larger fence
    other = managers(owner_ttl=2.0).acquire("a", timeout=5)
    assert other.fencing_token > lease.fencing_token
    other.release()


def test_deadline_wins_over_a_liveness_key_that_is_still_there(
    managers: Managers, r: redis.Redis
) -> None:
    # The key outlives the deadline (here: its TTL removed; in life, a key
    # revived by a stale request or a Redis clock behind ours): the lease is
    # lost all the same, the heartbeat no longer refreshes that owner, and it
    # puts it to death in Redis (locks freed) rather than keep it.
    mgr, lease = holding(managers, owner_ttl=1.0)
    owner = lease.owner_id
    mgr.heartbeat.stop()
    r.persist(alive(owner))
    wait_until(lambda: lease.lost, what="local deadline passed")
    assert raises_lost(lease)
    assert r.exists(alive(owner))  # Redis still believes in it
    mgr.upkeep()  # the heartbeat's next tick (its thread was stopped above)
    assert not r.exists(alive(owner))
    assert lock_holders(r) == {}
    assert mgr.owner_id != owner  # continues under a new identity
    fresh = mgr.acquire("a", timeout=5)
    assert not fresh.lost
    fresh.release()


def test_heartbeat_moves_the_deadline_forward(managers: Managers) -> None:
    mgr, lease = holding(managers, owner_ttl=3.0)
    first = lease.deadline
    wait_until(lambda: lease.deadline > first + 0.5, what="a beat extended the deadline")
    # the margin: the deadline stays before the key can expire in Redis
    assert mgr.liveness_margin == pytest.approx(0.3)
    assert managers(owner_ttl=300.0).liveness_margin == 2.0  # bounded
    assert not lease.lost
    lease.release()


def test_owner_without_own_heartbeat_feeds_its_deadline_from_the_key_ttl(
    managers: Managers, r: redis.Redis
) -> None:
    # A Celery pool child: another process (the worker's main process)
    # refreshes its liveness. Its lost-owner watcher reads the key's PTTL while
    # it holds a lease: the deadline follows those refreshes, and a key that
    # vanishes (Redis lost it) makes the lease lost at once.
    child, lease = holding(managers, owner_ttl=1.0, heartbeat_interval=0.2, heartbeat=False)
    owner = lease.owner_id
    first = lease.deadline
    r.pexpire(alive(owner), 60_000)  # "the main process" refreshed it
    wait_until(lambda: lease.deadline > first + 10, what="deadline fed by PTTL")
    assert not lease.lost
    r.delete(alive(owner))  # Redis lost the key
    wait_until(lambda: lease.lost, what="watcher saw the key gone")
    assert raises_lost(lease)


def test_idle_owner_without_own_heartbeat_is_not_declared_lost_at_its_next_acquire(
    managers: Managers, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # An idle pool child does not watch its key (nothing to lose), so its
    # deadline goes stale while the main process keeps it alive: that is no
    # loss, and its next acquire goes on under the same owner, quietly.
    child, lease = holding(managers, owner_ttl=1.0, heartbeat_interval=0.2, heartbeat=False)
    owner, deadline = lease.owner_id, lease.deadline
    lease.release()
    r.pexpire(alive(owner), 60_000)  # "the main process" keeps it alive
    wait_until(lambda: time.monotonic() > deadline + 0.1, what="the old deadline passed")
    caplog.set_level(logging.ERROR, logger="celery_redislock")
    again = child.acquire("a", timeout=5)
    assert again.owner_id == owner and not again.lost
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR], caplog.text
    again.release()


def test_waiter_without_own_heartbeat_keeps_its_deadline_fresh_while_it_waits(
    managers: Managers, r: redis.Redis
) -> None:
    # A pool child waits several owner_ttl for a hand-off: its waiting loop
    # re-runs the script (a refresh) well before its deadline, so the lease
    # it is handed is not lost at birth.
    _, held = holding(managers, owner_ttl=5.0)
    child = managers(owner_ttl=1.0, heartbeat_interval=0.2, heartbeat=False)
    t, out = queued_acquire(r, child, 30)
    ident = child.liveness.identity.peek()
    assert ident is not None
    first = ident.valid_until
    r.pexpire(alive(ident.owner_id), 60_000)  # "the main process" keeps it alive
    wait_until(lambda: ident.valid_until > first + 3, what="the waiter's attempts refreshed it")
    held.release()
    t.join(20)
    lease = out[0]
    assert not lease.lost and lease.owner_id == ident.owner_id
    lease.release()


# -- 2. Redis loses the data ---------------------------------------------------


def _lost_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Every ERROR of the heartbeat logger (the loss, and nothing else)."""
    return [
        rec
        for rec in caplog.records
        if rec.levelno >= logging.ERROR and rec.name == "celery_redislock.heartbeat"
    ]


@pytest.mark.parametrize("how", ["flushall", "restart"])
def test_redis_losing_its_data_makes_held_leases_lost_once_and_never_revives_the_owner(
    how: str,
    managers: Managers,
    redis_server: RedisServer,
    r: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mgr, lease = holding(managers, owner_ttl=3.0)
    owner = lease.owner_id
    caplog.set_level(logging.ERROR, logger="celery_redislock.heartbeat")
    if how == "flushall":
        r.flushall()
    else:
        redis_server.restart()
    wait_until(lambda: lease.lost, what="lease lost after the data loss")
    assert raises_lost(lease)
    client = redis_server.client()
    try:
        other = managers(owner_ttl=3.0).acquire("a", timeout=5)  # the lock is free
        assert other.fencing_token > lease.fencing_token
        ticks = mgr.heartbeat.ticks
        wait_until(lambda: mgr.heartbeat.ticks >= ticks + 2, what="two more beats")
        assert not client.exists(alive(owner))  # never re-created
        errors = _lost_errors(caplog)
        assert len(errors) == 1, [e.getMessage() for e in errors]
        assert errors[0].getMessage().startswith("heartbeat.lost")
        assert "Redis lost its data" in errors[0].getMessage()
        # the manager goes on under a fresh identity
        assert_goes_on_under_a_new_identity(mgr, owner, "b")
        other.release()
    finally:
        client.close()


# -- 3. eviction -----------------------------------------------------------------


@pytest.fixture
def lru_server(tmp_path: Path) -> Iterator[RedisServer]:
    args = ["--maxmemory", "20mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(workdir=tmp_path / "lru", extra_args=args) as server:
        yield server


def test_manager_warns_on_its_first_round_trip_when_redis_may_evict(
    lru_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    made = Managers(lru_server.url)
    try:
        mgr = made(owner_ttl=5.0)
        with caplog.at_level(logging.WARNING, logger="celery_redislock"):
            mgr.acquire("a", timeout=5).release()
            mgr.acquire("a", timeout=5).release()
        warnings = [x for x in caplog.messages if x.startswith("startup.eviction-risk")]
        assert len(warnings) == 1 and "allkeys-lru" in warnings[0]
    finally:
        made.close_all()


def test_manager_in_raise_mode_refuses_a_redis_that_may_evict(lru_server: RedisServer) -> None:
    made = Managers(lru_server.url)
    client = lru_server.client()
    try:
        mgr = made(owner_ttl=5.0, eviction_check="raise")
        for _ in range(2):
            with pytest.raises(ConfigurationError, match="allkeys-lru"):
                mgr.acquire("a", timeout=5)
        assert client.dbsize() == 0  # refused before anything was written
        assert made(owner_ttl=5.0, eviction_check="ignore").acquire("a", timeout=5)
        with pytest.raises(ConfigurationError, match="eviction_check"):
            made(eviction_check="loud")
    finally:
        client.close()
        made.close_all()


def test_heartbeat_notices_an_evicted_lock_when_redis_may_evict(
    lru_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Under allkeys-lru a lock hash can go while its owner's liveness stays:
    # the heartbeat of a manager that found such a policy also checks each
    # held grant (HEXISTS lock token), and marks that lease lost.
    made = Managers(lru_server.url)
    client = lru_server.client()
    try:
        mgr = made(owner_ttl=1.5)
        with caplog.at_level(logging.WARNING, logger="celery_redislock.heartbeat"):
            evicted = mgr.acquire("a", timeout=5)
            kept = mgr.acquire("b", timeout=5)
            client.delete("{t}:lock:a")  # what the eviction of that key does
            wait_until(lambda: evicted.lost, what="heartbeat found the grant gone")
        assert raises_lost(evicted)
        assert not kept.lost and client.exists(alive(kept.owner_id))
        gone = [m for m in caplog.messages if m.startswith("heartbeat.grant-gone")]
        assert len(gone) == 1 and "{t}:lock:a" in gone[0]
        # the lock is free for another owner (the evicted holder is told)
        other = made(owner_ttl=1.5).acquire("a", timeout=5)
        assert other.fencing_token > evicted.fencing_token
    finally:
        client.close()
        made.close_all()


def test_heartbeat_notices_a_liveness_key_that_redis_evicted(tmp_path: Path) -> None:
    # volatile-ttl evicts the keys with a TTL, nearest expiry first: the
    # liveness key goes before any of the filler (which has no TTL).
    args = ["--maxmemory", "4mb", "--maxmemory-policy", "volatile-ttl"]
    with RedisServer(workdir=tmp_path / "evict", extra_args=args) as server:
        made = Managers(server.url)
        client = server.client()
        try:
            mgr = made(owner_ttl=2.0, eviction_check="ignore")
            lease = mgr.acquire("a", timeout=5)
            key = alive(lease.owner_id)
            i = 0
            while client.exists(key):
                try:
                    client.set(f"filler:{i}", b"x" * 65536)
                except redis.exceptions.OutOfMemoryError:
                    break
                i += 1
            assert not client.exists(key)
            wait_until(lambda: lease.lost, what="heartbeat found the evicted key")
            assert raises_lost(lease)
        finally:
            client.close()
            made.close_all()


# -- 4. close() ----------------------------------------------------------------


def test_close_releases_held_leases_refuses_acquire_and_removes_the_owner(
    managers: Managers, r: redis.Redis
) -> None:
    mgr, lease = holding(managers, owner_ttl=5.0)
    owner = lease.owner_id
    assert r.sismember("{t}:owners", owner)
    mgr.close()
    assert lease.released
    assert lock_holders(r) == {}
    assert not r.sismember("{t}:owners", owner) and not r.exists(alive(owner))
    assert not r.exists("{t}:held:" + owner)
    with pytest.raises(LockError, match="closed"):
        mgr.acquire("b", timeout=5)
    mgr.close()  # idempotent
    other = managers(owner_ttl=5.0).acquire("a", timeout=0)  # free at once
    other.release()


def test_close_with_redis_unreachable_marks_held_leases_lost(tmp_path: Path) -> None:
    server = RedisServer(workdir=tmp_path / "gone").start()
    mgr = LockManager(server.url, "t", owner_ttl=5.0)
    try:
        lease = mgr.acquire("a", timeout=5)
        server.kill()
        mgr.close()
        assert lease.lost and raises_lost(lease)
        with pytest.raises(LockError, match="closed"):
            mgr.acquire("b", timeout=0)
    finally:
        mgr.close()
        server.close()


def test_acquire_in_flight_when_close_runs_returns_no_lease(
    managers: Managers, r: redis.Redis
) -> None:
    _, held = holding(managers, owner_ttl=5.0)
    mgr = managers(owner_ttl=5.0)
    t, out = queued_acquire(r, mgr, 20)
    mgr.close()
    held.release()  # hands "a" to the closed manager's queued request ... or not
    t.join(20)
    assert len(out) == 1 and isinstance(out[0], LockError), out
    wait_until(lambda: not lock_holders(r), what="nothing left held")


# -- 5. identity races ---------------------------------------------------------


def test_a_stale_registration_cannot_revive_a_cleaned_owner(
    managers: Managers, r: redis.Redis
) -> None:
    # Thread A built its first acquire (a registration) before the owner was
    # declared dead; thread B's acquire registered it; then a cleanup freed
    # it. A's script runs last: it must not re-create the liveness key.
    mgr, lease = holding(managers, owner_ttl=2.0, heartbeat=False)
    owner = lease.owner_id
    report = managers(owner_ttl=2.0).cleanup_owner(owner, force=True)
    assert report.released == 1
    tomb = "{t}:dead:" + owner
    assert 0 < r.pttl(tomb) <= 3 * 2000  # bounded: it cannot leak
    stale = OwnerIdentity(owner_id=owner, pid=lease.pid, registered=False)
    reply = mgr.acquirer.attempt(stale, f"{owner}|late", mgr.request("b", None), False, False)
    assert int(reply[0]) == -1
    assert not r.exists(alive(owner)) and not r.exists("{t}:lock:b")
    wait_until(lambda: lease.lost, what="watcher marked the lease lost")
    # the manager goes on under a new identity (the retry a real acquire makes)
    assert_goes_on_under_a_new_identity(mgr, owner, "b")


def test_a_grant_landing_on_a_retired_identity_is_released_and_re_requested(
    managers: Managers, r: redis.Redis
) -> None:
    _, held = holding(managers, owner_ttl=5.0)
    waiter = managers(owner_ttl=5.0)
    t, out = queued_acquire(r, waiter, 20)
    old = waiter.liveness.identity.peek()
    assert old is not None
    # Its owner is declared dead (what the lost-owner watcher does when a
    # cleanup pushes) while the release below hands it the lock.
    waiter.liveness.owner_lost(old, "declared-dead")
    held.release()
    t.join(20)
    assert not t.is_alive(), "the waiter was never granted the lock"
    [lease] = out
    assert isinstance(lease, Lease) and not lease.lost
    assert lease.owner_id != old.owner_id
    assert lease.owner_id == waiter.owner_id
    assert lock_holders(r) == {"{t}:lock:a": {lease.token: "x"}}
    assert not r.exists("{t}:held:" + old.owner_id)
    lease.release()


def test_redis_outage_longer_than_the_deadline_loses_leases_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(workdir=tmp_path / "outage").start()
    made = Managers(server.url)
    try:
        mgr = made(owner_ttl=1.0)
        lease = mgr.acquire("a", timeout=5)
        caplog.set_level(logging.INFO, logger="celery_redislock.heartbeat")
        server.kill()
        # nothing can be confirmed: the keys may expire meanwhile
        wait_until(lambda: lease.lost, what="deadline passed during the outage")
        assert raises_lost(lease)
        ticks = mgr.heartbeat.ticks
        wait_until(lambda: mgr.heartbeat.ticks >= ticks + 3, what="beats during the outage")
        server.start()  # same port, empty
        wait_until(lambda: "heartbeat.resumed" in caplog.text, what="heartbeat resumed")
        messages = [r.getMessage() for r in caplog.records if r.name.endswith(".heartbeat")]
        assert sum(m.startswith("heartbeat.unavailable") for m in messages) == 1, messages
        assert not any(m.startswith("heartbeat.error") for m in messages), messages
        assert_goes_on_under_a_new_identity(mgr, lease.owner_id, "a")
    finally:
        made.close_all()
        server.close()
