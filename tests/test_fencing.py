"""Fencing tokens never go backwards, whichever is ahead: the counter or the clock."""

from __future__ import annotations

import redis

from celery_redislock import LockManager


def test_fence_follows_the_counter_when_it_is_ahead_of_the_server_clock(
    redis_url: str, r: redis.Redis
) -> None:
    # A failover to a replica with a slower clock, or many grants within one
    # microsecond: the stored counter is ahead of TIME, so the next token is
    # counter + 1, never the (smaller) clock value.
    mgr = LockManager(redis_url, "f")
    mgr.check_format()  # a namespace in use (its fence without a format key is older data)
    try:
        far_ahead = 8 * 10**15  # ahead of the clock, below 2**53 (exact in Lua)
        r.set("{f}:fence", far_ahead)
        with mgr.lock("R", timeout=5) as lease:
            assert lease.fencing_token == far_ahead + 1
        with mgr.lock("R", timeout=5) as lease:
            assert lease.fencing_token == far_ahead + 2
    finally:
        mgr.close()


def test_fence_follows_the_clock_when_the_counter_is_behind(redis_url: str, r: redis.Redis) -> None:
    mgr = LockManager(redis_url, "f")
    mgr.check_format()  # a namespace in use (its fence without a format key is older data)
    try:
        r.set("{f}:fence", 5)
        seconds, micros = r.time()
        with mgr.lock("R", timeout=5) as lease:
            assert lease.fencing_token >= seconds * 1_000_000 + micros
        assert int(r.get("{f}:fence")) == lease.fencing_token
    finally:
        mgr.close()
