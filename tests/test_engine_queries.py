"""The small questions a caller asks the manager: take it only if free
(``try_acquire``), is it held and by whom (``is_locked``, ``holders``), and
did this ``release()`` release anything. Real redis-server; the command
counts come from ``INFO commandstats`` on a server of this module's own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from celery_redislock import InvalidResource, LockHolder, LockManager
from engine_helpers import Managers, counting
from redis_server import RedisServer

OWNER_TTL = 120.0  # no heartbeat ticks while commands are counted


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


@pytest.fixture
def mk(redis_server: RedisServer, r: redis.Redis) -> Iterator[Managers]:
    made = Managers(redis_server.url, owner_ttl=OWNER_TTL)
    yield made
    made.close_all()


def test_try_acquire_returns_a_lease_when_free_and_none_when_taken(mk: Managers) -> None:
    a, b = mk(), mk()
    lease = a.try_acquire("repo:1", shared=["remote:7"])
    assert lease is not None and lease.resources == ("repo:1", "remote:7")
    assert b.try_acquire("repo:1") is None
    assert b.try_acquire(shared=["repo:1"]) is None
    shared = b.try_acquire(shared=["remote:7"])  # shared with a's shared hold
    assert shared is not None
    lease.release()
    again = b.try_acquire("repo:1")
    assert again is not None and again.fencing_token > lease.fencing_token


def test_try_acquire_never_queues(mk: Managers, r: redis.Redis) -> None:
    a, b = mk(), mk()
    held = a.acquire("repo:1", timeout=0)
    assert b.try_acquire("repo:1") is None
    assert r.zcard("{t}:q:repo:1") == 0  # nothing left in line
    assert held.contenders() == 0


def test_try_acquire_raises_what_acquire_raises_for_bad_names(mk: Managers) -> None:
    with pytest.raises(InvalidResource):
        mk().try_acquire("")


def test_holders_and_is_locked_name_every_grant_with_its_mode_and_fence(mk: Managers) -> None:
    a, b, c = mk(), mk(), mk()
    assert c.holders("repo:1") == [] and c.is_locked("repo:1") is False
    la = a.acquire(shared=["repo:1"], timeout=0)
    lb = b.acquire(shared=["repo:1"], timeout=0)
    assert c.is_locked("repo:1") is True
    got = c.holders("repo:1")
    assert {h.owner_id for h in got} == {a.owner_id, b.owner_id}
    assert {(h.owner_id, h.fencing_token) for h in got} == {
        (a.owner_id, la.fencing_token),
        (b.owner_id, lb.fencing_token),
    }
    assert all(h.mode == "shared" and h.resource == "repo:1" for h in got)
    assert {h.token for h in got} == {la.token, lb.token}
    la.release()
    lb.release()
    lx = a.acquire("repo:1", timeout=0)
    assert c.holders("repo:1") == [
        LockHolder("repo:1", a.owner_id, "exclusive", lx.fencing_token, lx.token)
    ]
    lx.release()
    assert c.is_locked("repo:1") is False and c.holders("repo:1") == []


def test_a_dead_owners_grant_is_listed_until_it_is_reclaimed(mk: Managers, r: redis.Redis) -> None:
    dead, live = mk(), mk()
    dead.acquire("repo:1", timeout=0)
    dead.heartbeat.stop()
    r.delete("{t}:alive:" + dead.owner_id)  # its liveness ran out
    assert live.is_locked("repo:1") is True
    assert [h.owner_id for h in live.holders("repo:1")] == [dead.owner_id]
    taken = live.try_acquire("repo:1")  # the acquirer reclaims it
    assert taken is not None
    assert [h.owner_id for h in live.holders("repo:1")] == [live.owner_id]


def test_holders_and_is_locked_refuse_bad_names_before_any_call(mk: Managers) -> None:
    mgr = mk()
    for bad in ("", "x" * 600, 7):
        with pytest.raises(InvalidResource):
            mgr.holders(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidResource):
            mgr.is_locked(bad)  # type: ignore[arg-type]


def test_each_query_is_one_command_whatever_the_number_of_holders(
    mk: Managers, r: redis.Redis
) -> None:
    asker = mk()
    asker.is_locked("warm")  # the format check: once per process, not per call
    counts = []
    for n in (1, 20):
        r.delete("{t}:lock:r")
        holders = [mk() for _ in range(n)]
        for m in holders:
            m.acquire(shared=["r"], timeout=0)
        with counting(r) as seen_holders:
            assert len(asker.holders("r")) == n
        with counting(r) as seen_locked:
            assert asker.is_locked("r")
        counts.append((dict(seen_holders), dict(seen_locked)))
        for m in holders:
            m.close()
    assert counts[0] == counts[1] == ({"hgetall": 1}, {"hlen": 1})


def test_release_answers_whether_this_call_released_the_lease(mk: Managers) -> None:
    mgr = mk()
    lease = mgr.acquire("repo:1", timeout=0)
    assert lease.release() is True
    assert lease.release() is False  # harmless, and says so
    with mgr.lock("repo:2", timeout=0) as outer:
        inner = mgr.acquire("repo:2", timeout=1)  # re-entered: a count, no round trip
        assert inner.release() is True
        assert mgr.is_locked("repo:2")  # the outer lease still holds it
        assert inner.release() is False
    assert outer.release() is False  # the with block released it
    assert not mgr.is_locked("repo:2")


def test_a_lease_inherited_across_fork_releases_nothing_and_says_so(mk: Managers) -> None:
    mgr = mk()
    lease = mgr.acquire("repo:1", timeout=0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write, b"1" if lease.release() is False else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"1"
    assert mgr.is_locked("repo:1")  # the parent's lock is untouched
    assert lease.release() is True


def test_queries_work_on_a_manager_that_never_acquired(redis_server: RedisServer) -> None:
    mgr = LockManager(redis_server.url, namespace="t", owner_ttl=OWNER_TTL)
    try:
        assert mgr.is_locked("nothing") is False
        assert mgr.holders("nothing") == []
    finally:
        mgr.close()
