"""Deferred releases and heartbeats under Redis failures: one line, not a traceback per tick.

A release that fails (Redis down, or a release that cannot succeed: a
foreign value at the lock key, an ACL NOPERM) is kept and retried by the
process's heartbeat. A release that keeps failing is logged once, then
retried quietly with backoff and counted (``release_retry_failures``),
never a traceback per tick.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis

from celery_redislock import PermissionDenied
from engine_helpers import Managers, assert_registry_truth, wait_until
from redis_server import RedisServer

NS = "t"
PREFIX = "{" + NS + "}:"


def test_release_blocked_by_a_foreign_value_is_reported_once_then_retried_quietly(
    r: redis.Redis, managers: Managers, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = managers(owner_ttl=2.0, heartbeat_interval=0.05)
    lease = mgr.acquire("R", timeout=5)
    lock_key = f"{PREFIX}lock:R"
    grant = r.hgetall(lock_key)
    r.delete(lock_key)
    r.set(lock_key, "not-a-lock")  # someone else's value at the lock key
    caplog.set_level(logging.INFO, logger="celery_redislock")
    with pytest.raises(redis.ResponseError):
        lease.release()
    assert mgr.state.deferred
    wait_until(lambda: mgr.heartbeat.ticks >= 60, what="60 heartbeat ticks")
    assert not [rec for rec in caplog.records if rec.exc_info], caplog.text
    failed = [rec for rec in caplog.records if "release.retry-failed" in rec.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR, caplog.text
    # Counted, and backed off: far fewer tries than heartbeat ticks.
    assert 3 <= mgr.release_retry_failures < mgr.heartbeat.ticks / 4
    # The foreign value goes away: the next retry releases the lock.
    r.delete(lock_key)
    r.hset(lock_key, mapping=grant)
    wait_until(lambda: not r.exists(lock_key), what="the deferred release to succeed")
    # The heartbeat thread drops the orphan just after the script returns.
    wait_until(lambda: not mgr.state.deferred, what="the retried release to be forgotten")
    assert any("release.retried" in rec.getMessage() for rec in caplog.records)
    assert_registry_truth(r, NS)


def test_heartbeat_reports_an_outage_in_one_line_not_a_traceback_per_tick(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisServer(workdir=tmp_path / "redis") as server:
        made = Managers(server.url, NS)
        try:
            mgr = made(owner_ttl=5.0, heartbeat_interval=0.05)
            lease = mgr.acquire("R", timeout=5)
            caplog.set_level(logging.INFO, logger="celery_redislock")
            server.kill()
            ticks = mgr.heartbeat.ticks
            wait_until(lambda: mgr.heartbeat.ticks >= ticks + 3, what="three failed beats")
            server.start()  # empty: the owner's liveness is gone with the data
            wait_until(lambda: lease.lost, what="the heartbeat to reach Redis again")
        finally:
            made.close_all()
    records = [rec for rec in caplog.records if rec.name == "celery_redislock.heartbeat"]
    assert not [rec for rec in records if rec.exc_info], caplog.text
    down = [rec for rec in records if "heartbeat.unavailable" in rec.getMessage()]
    assert len(down) == 1 and down[0].levelno == logging.WARNING, caplog.text
    assert any("heartbeat.resumed" in rec.getMessage() for rec in records), caplog.text


def test_release_refused_by_an_acl_is_reported_once_then_retried_quietly(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The app's ACL user may touch every engine key but {t}:waits:* (a key
    # release.lua declares) and {t}:contended:* (which it deletes when the
    # lock is freed): its release fails with NOPERM until the ACL is fixed.
    keys = (
        " ".join(
            f"~{PREFIX}{kind}"
            for kind in ("fence", "born", "format", "seq", "owners", "held:*", "alive:*", "req:*")
        )
        + " "
        + " ".join(f"~{PREFIX}{kind}" for kind in ("wake:*", "lock:*", "q:*", "lost:*", "dead:*"))
    )
    with RedisServer(workdir=tmp_path / "redis") as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "+@all", *keys.split())
        made = Managers(f"redis://app:pw@127.0.0.1:{server.port}/0", NS)
        try:
            mgr = made(owner_ttl=5.0, heartbeat_interval=0.05)
            lease = mgr.acquire("R", timeout=5)
            caplog.set_level(logging.INFO, logger="celery_redislock")
            with pytest.raises(PermissionDenied, match="permission denied"):
                lease.release()
            wait_until(lambda: mgr.heartbeat.ticks >= 40, what="40 heartbeat ticks")
            assert admin.exists(f"{PREFIX}lock:R")
            admin.execute_command(
                "ACL", "SETUSER", "app", f"~{PREFIX}waits:*", f"~{PREFIX}contended:*"
            )
            wait_until(lambda: not admin.exists(f"{PREFIX}lock:R"), what="the retried release")
        finally:
            made.close_all()
            admin.close()
    assert not [rec for rec in caplog.records if rec.exc_info], caplog.text
    failed = [rec for rec in caplog.records if "release.retry-failed" in rec.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR, caplog.text
    assert 2 <= mgr.release_retry_failures < mgr.heartbeat.ticks / 4


def test_a_request_redis_never_answered_is_cleaned_up_without_a_warning(
    managers: Managers, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis down from the start: the failed acquire logs no release.deferred.

    The request may still be retried away later (a script sent as a
    connection broke may have run), so it is kept as an orphan, but no grant
    was ever seen and a WARNING would send an operator hunting for a lock
    nobody holds. Once Redis is back, the orphan is gone.
    """
    from celery_redislock import RedisUnavailable
    from tcp_proxy import TcpProxy

    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        mgr = managers(proxy.url, heartbeat_interval=0.1)
        proxy.cut()
        with caplog.at_level(logging.DEBUG, "celery_redislock"):
            with pytest.raises(RedisUnavailable):
                mgr.acquire("never", timeout=0)
        loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [m for m in loud if m.startswith("release.")], loud
        assert any(m.startswith("release.deferred ") for m in caplog.messages)
        proxy.restore()
        wait_until(lambda: not mgr.state.deferred, what="the orphaned request to be retried away")


class _Cut(Exception):
    """Raised in the main thread by a signal: an interrupt mid-call."""


def test_a_cut_short_acquire_whose_script_reaches_redis_after_its_release_leaves_no_grant(
    redis_url: str, r: redis.Redis, managers: Managers
) -> None:
    """An interrupt (SoftTimeLimitExceeded, a signal handler raising) while
    an acquire's reply is awaited: the request is released on a new
    connection, but the script sent on the dropped one may reach Redis after
    that release (through a proxy, or a server that runs connections on
    threads) and grant the lock to a live owner that will never release it.
    The heartbeat releases such a request once more: the late grant goes."""
    import signal
    import threading

    from tcp_proxy import TcpProxy

    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    lock_key = f"{PREFIX}lock:late"
    with TcpProxy(port) as proxy:
        mgr = managers(proxy.url, heartbeat_interval=0.1)
        mgr.acquire("warm", timeout=5).release()  # registered, scripts loaded
        proxy.trap(b"lock:late")  # the acquire's EVALSHA names its lock key

        def cut(signum: int, frame: Any) -> None:
            raise _Cut()

        main = threading.main_thread().ident
        assert main is not None
        old = signal.signal(signal.SIGALRM, cut)
        try:

            def interrupt() -> None:
                if proxy.caught.wait(30):  # the script is sent, its reply awaited
                    signal.pthread_kill(main, signal.SIGALRM)

            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(_Cut):
                mgr.acquire("late", timeout=30)
        finally:
            signal.signal(signal.SIGALRM, old)
        # The release went out (on a new connection) before the script: the
        # script arrives now, finds the lock free and grants it.
        proxy.let_go()
        assert proxy.reply.startswith(b"*3\r\n:1\r\n"), proxy.reply  # {1, fence, 0}
        wait_until(lambda: not r.exists(lock_key), what="the late grant to be released")
        other = managers()
        other.acquire("late", timeout=5).release()
        wait_until(lambda: not mgr.state.deferred, what="the second release to be forgotten")
        assert_registry_truth(r, NS)
