"""An owner whose liveness another process refreshes (heartbeat=False, as in
a Celery pool child) is told at once when it is declared dead."""

from __future__ import annotations

import logging
import threading

import pytest
import redis

from celery_redislock import LockManager
from engine_helpers import wait_until
from fairness_helpers import blocked_in_blpop
from redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


def test_owner_without_own_heartbeat_marks_leases_lost_when_force_cleaned(
    redis_url: str, closing: list[LockManager], caplog: pytest.LogCaptureFixture
) -> None:
    # Without the watcher the lease stays "held" for the rest of the body
    # although its lock was freed and may be granted to someone else.
    child = LockManager(redis_url, "w", owner_ttl=60, heartbeat=False)
    operator = LockManager(redis_url, "w", owner_ttl=60)
    closing += [child, operator]
    lease = child.acquire("R", timeout=5)
    assert not lease.lost
    probe = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        wait_until(lambda: blocked_in_blpop(probe), what="the watcher to block on its lost list")
    finally:
        probe.close()
    with caplog.at_level(logging.ERROR, "celery_redislock.heartbeat"):
        report = operator.cleanup_owner(child.owner_id, force=True)
        assert report.released == 1
        wait_until(lambda: lease.lost, timeout=20)
    # Told by the cleanup's push to its lost list (where=declared-dead), not
    # by its next liveness check up to 10 s later (where=watch).
    [line] = [r.getMessage() for r in caplog.records if "heartbeat.lost" in r.getMessage()]
    assert "where=declared-dead" in line, line
    with pytest.raises(Exception, match="lost"):
        lease.check()
    # The lock is free for others, and the old lease's release frees nothing.
    other = operator.acquire("R", timeout=5)
    lease.release()
    assert operator.client.hexists(operator.keys.lock("R"), other.token)
    other.release()


def test_owner_with_its_own_heartbeat_needs_no_watcher(
    redis_url: str, closing: list[LockManager]
) -> None:
    # The heartbeat's PEXPIRE reply tells such an owner; no listener thread
    # (and no blocked connection) is started for it.
    mgr = LockManager(redis_url, "w", owner_ttl=1.0, heartbeat_interval=0.1)
    closing.append(mgr)
    lease = mgr.acquire("R", timeout=5)
    assert mgr.watcher.started_here is False
    mgr.cleanup_owner(mgr.owner_id, force=True)
    wait_until(lambda: lease.lost, timeout=20)


def test_exempt_process_starts_no_watcher_but_its_forked_pool_child_does(
    redis_url: str, closing: list[LockManager]
) -> None:
    # The Celery worker's main process is watched by its node heartbeat: no
    # watcher thread there (one fewer real thread blocked in Redis at exit),
    # while a forked pool child (a member again after worker_process_init),
    # whose owner nobody else tells, gets one. A forked helper that never
    # becomes a member runs its own heartbeat instead, and no watcher.
    import os

    mgr = LockManager(redis_url, "w", owner_ttl=60, heartbeat=False)
    closing.append(mgr)
    mgr.watcher.exempt_pid = os.getpid()
    mgr.acquire("R", timeout=5).release()
    assert mgr.watcher.started_here is False

    def in_child(member: bool) -> bytes:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                if member:
                    mgr.become_member()
                mgr.acquire("C", timeout=5).release()
                watching = mgr.watcher.started_here
                beating = mgr.heartbeat.running
                os.write(w, b"%d%d" % (watching, beating))
            finally:
                os._exit(0)
        os.close(w)  # a child that fails before writing ends the pipe: no hang
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as pipe:
            return pipe.read()

    assert in_child(member=True) == b"10"  # watcher, no heartbeat of its own
    assert in_child(member=False) == b"01"  # its own heartbeat, no watcher


def test_close_ends_the_watcher_and_closes_its_connection(redis_url: str, r: redis.Redis) -> None:
    # A closed manager must not leave a BLPOP blocked on the server (it used
    # to stay up to 4 s, and its connection until garbage collection), nor
    # mistake its own wake-up for a loss notice.
    baseline = {c["id"] for c in r.client_list()}
    threads = set(threading.enumerate())
    child = LockManager(redis_url, "w", owner_ttl=60, heartbeat=False)
    lease = child.acquire("R", timeout=5)
    (watcher,) = [
        t for t in set(threading.enumerate()) - threads if t.name == "redislock-lost-watch"
    ]
    wait_until(lambda: any(c["cmd"] == "blpop" for c in r.client_list()), what="watcher blocks")
    child.close()
    assert [c for c in r.client_list() if "b" in c["flags"]] == []
    assert lease.released and not lease.lost
    wait_until(
        lambda: {c["id"] for c in r.client_list()} - baseline == set(),
        what="the closed manager's connections gone",
    )
    watcher.join(timeout=20)
    assert not watcher.is_alive()


def _blpops(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_blpop", {}).get("calls", 0))


def test_an_idle_pool_child_sends_nothing_and_is_watched_again_once_it_holds(
    redis_url: str, r: redis.Redis, closing: list[LockManager]
) -> None:
    # A pool child holding and waiting for nothing has nothing a loss notice
    # could change: its watcher must not keep a BLPOP going (in a fleet of
    # idle workers those were most of the traffic). Once it holds again, it
    # must be told of a loss at once, as before.
    child = LockManager(redis_url, "w", owner_ttl=60, heartbeat=False, heartbeat_interval=0.2)
    operator = LockManager(redis_url, "w", owner_ttl=60)
    closing += [child, operator]
    child.acquire("R", timeout=5).release()
    wait_until(lambda: not [c for c in r.client_list() if "b" in c["flags"]], what="no BLPOP")
    before, passes = _blpops(r), child.watcher.passes
    wait_until(lambda: child.watcher.passes >= passes + 10, what="ten idle passes")
    assert _blpops(r) == before
    lease = child.acquire("R", timeout=5)
    wait_until(lambda: _blpops(r) > before, what="watched again")
    operator.cleanup_owner(child.owner_id, force=True)
    wait_until(lambda: lease.lost, timeout=20)
    assert lease.lost_cause == "owner declared dead"
