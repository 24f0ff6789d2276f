"""The namespace's data-format version (``{ns}:format``, format.lua).

Every process writes it once if missing (first use, or after Redis lost its
data) and refuses a namespace of another format with FormatMismatch, naming
both versions and the fix, before writing anything else. Real redis-server.
"""

from __future__ import annotations

import logging

import pytest
import redis

from celery_redislock import FORMAT_VERSION, FormatMismatch, LockError, LockManager
from celery_redislock.protocol.keys import UNVERSIONED_FORMAT
from celery_redislock.store.scripts import Scripts
from engine_helpers import Managers, command_delta, commandstats, namespace_keys, wait_until
from redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


FORMAT_KEY = "{t}:format"


def test_the_first_use_records_this_releases_format_once(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    assert r.get(FORMAT_KEY) is None
    mgr.acquire("a", timeout=5).release()
    assert r.get(FORMAT_KEY) == str(FORMAT_VERSION).encode()
    # checked once per manager: later acquires send no format script
    before = commandstats(r)
    mgr.acquire("a", timeout=5).release()
    delta = command_delta(before, commandstats(r))
    assert delta.get("evalsha") == 2, delta  # acquire + release, nothing else


def test_a_namespace_of_another_format_is_refused_naming_both_versions_and_the_fix(
    managers: Managers, r: redis.Redis
) -> None:
    newer = FORMAT_VERSION + 1
    r.set(FORMAT_KEY, str(newer))
    mgr = managers()
    with pytest.raises(FormatMismatch) as info:
        mgr.acquire("a", timeout=5)
    exc = info.value
    assert isinstance(exc, LockError)
    assert (exc.found, exc.expected, exc.namespace) == (newer, FORMAT_VERSION, "t")
    text = str(exc)
    assert f"format {newer}" in text and f"uses format {FORMAT_VERSION}" in text
    assert "upgrade this process" in text and "redislock_namespace" in text
    assert "docs/operations.md" in text
    # nothing was written: no grant, no owner, the format key untouched
    assert namespace_keys(r) == {FORMAT_KEY}
    assert r.get(FORMAT_KEY) == str(newer).encode()
    with pytest.raises(FormatMismatch):
        mgr.cleanup_owner("someone")
    # an older format names the drain-and-switch procedure instead
    r.set(FORMAT_KEY, "0")
    with pytest.raises(FormatMismatch, match="drain them .* format --switch"):
        managers().acquire("a", timeout=5)


def test_the_error_survives_pickling_like_every_lock_error() -> None:
    import pickle

    exc = FormatMismatch("ns", "redis://u:pw@h:1/0", 3, 1)
    again = pickle.loads(pickle.dumps(exc))
    assert str(again) == str(exc) and "pw" not in str(exc)


def test_data_from_before_format_versioning_counts_as_the_unversioned_format(
    redis_url: str, r: redis.Redis
) -> None:
    """format.lua on a namespace with a fence but no format key: the
    unversioned format, written only when it is this release's."""
    scripts = Scripts(r)
    keys = [FORMAT_KEY, "{t}:fence"]
    r.set("{t}:fence", "123")
    other = str(UNVERSIONED_FORMAT + 1)
    reply = scripts.run("format", keys, [other, str(UNVERSIONED_FORMAT)])
    assert reply == [str(UNVERSIONED_FORMAT).encode(), b"unversioned"]
    assert r.get(FORMAT_KEY) is None  # refused: nothing written
    reply = scripts.run("format", keys, [str(UNVERSIONED_FORMAT), str(UNVERSIONED_FORMAT)])
    assert reply == [str(UNVERSIONED_FORMAT).encode(), b"created"]
    assert r.get(FORMAT_KEY) == str(UNVERSIONED_FORMAT).encode()
    assert scripts.run("format", keys, [other, str(UNVERSIONED_FORMAT)]) == [
        str(UNVERSIONED_FORMAT).encode(),
        b"stored",
    ]


@pytest.mark.parametrize("how", ["flushall", "restart"])
def test_redis_losing_its_data_simply_re_creates_the_format_key(
    how: str,
    caplog: pytest.LogCaptureFixture,
    managers: Managers,
    redis_server: RedisServer,
    r: redis.Redis,
) -> None:
    caplog.set_level(logging.ERROR)
    mgr = managers(owner_ttl=3.0)
    lease = mgr.acquire("a", timeout=5)
    if how == "flushall":
        r.flushall()
    else:
        redis_server.restart()
    client = redis_server.client()
    try:
        wait_until(lambda: lease.lost, what="lease lost after the data loss")
        assert client.get(FORMAT_KEY) is None
        # the running manager goes on (re-checking once), and so does a new one
        mgr.acquire("b", timeout=5).release()
        assert client.get(FORMAT_KEY) == str(FORMAT_VERSION).encode()
        client.flushall()  # a brand-new process after another loss
        fresh = LockManager(client, "t", heartbeat=False)
        fresh.acquire("c", timeout=5).release()
        assert client.get(FORMAT_KEY) == str(FORMAT_VERSION).encode()
        assert not [rec for rec in caplog.records if "format" in rec.getMessage().lower()]
    finally:
        client.close()


def test_data_of_a_release_from_before_format_versioning_is_refused_as_such(
    managers: Managers, r: redis.Redis
) -> None:
    assert UNVERSIONED_FORMAT != FORMAT_VERSION  # the layout changed since
    r.set("{t}:fence", "1764456000123456")  # used, by a release without a format key
    with pytest.raises(FormatMismatch) as info:
        managers().acquire("a", timeout=5)
    assert info.value.unversioned and info.value.found == UNVERSIONED_FORMAT
    assert "written before format versioning" in str(info.value)
    assert "drain them" in str(info.value)
    assert r.get(FORMAT_KEY) is None  # nothing written


def test_a_process_that_re_creates_the_fence_records_its_format(
    managers: Managers, r: redis.Redis
) -> None:
    """The fence and the format key come back together after a data loss.

    A manager whose format check passed before the loss (here: its liveness
    key survived, so it never noticed) re-creates the fence with its next
    grant. Before, that left a fence without a format key, which every
    process checking afterwards took for data of a release from before
    format versioning and refused (FormatMismatch: 1 vs this release), as a
    seeded chaos run with Redis restarts found.
    """
    veteran = managers()
    veteran.acquire("a", timeout=5).release()
    r.delete(FORMAT_KEY, "{t}:fence")  # the loss, as the veteran does not see it
    veteran.acquire("b", timeout=5).release()
    assert r.get(FORMAT_KEY) == str(FORMAT_VERSION).encode()
    newcomer = managers()
    newcomer.acquire("c", timeout=5).release()  # no FormatMismatch
