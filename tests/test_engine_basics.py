"""The engine's API one call at a time: grants, fencing, retries, interrupts,
bad input, configuration, an unreachable Redis, restarts and the eviction check."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import redis

from celery_redislock import (
    ConfigurationError,
    InvalidResource,
    LockError,
    LockManager,
    LockTimeout,
    RedisUnavailable,
    check_eviction,
)
from celery_redislock.ops.inspector import Inspector
from celery_redislock.protocol.keys import MAX_RESOURCE_BYTES, MAX_RESOURCES
from engine_helpers import (
    Managers,
    all_keys,
    assert_registry_truth,
    lock_fences,
    lock_holders,
    namespace_keys,
    registries,
)
from redis_server import RedisServer


def lock(name: str) -> str:
    return "{t}:lock:" + name


# -- grants and fencing ----------------------------------------------------


def test_each_grant_stores_its_fence_in_the_lock_hash_for_as_long_as_it_holds(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers(owner_ttl=1.0)
    lease = mgr.acquire(exclusive=["a"], shared=["b"])
    reader = managers().acquire(shared=["b"])

    assert lock_fences(r, lock("a")) == {lease.token: lease.fencing_token}
    assert lock_fences(r, lock("b")) == {
        lease.token: lease.fencing_token,
        reader.token: reader.fencing_token,
    }
    # No request record to expire: the fence is part of the grant itself,
    # so operators see it however long the lock is held.
    assert not r.exists("{t}:req:" + lease.token)
    [holder] = Inspector(mgr).holders("a")
    assert (holder.token, holder.mode, holder.fence) == (
        lease.token,
        "exclusive",
        lease.fencing_token,
    )
    lease.release()
    reader.release()


def test_lock_context_manager_grants_then_releases_everything(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    with mgr.lock(exclusive=["repo:1"], shared=["remote:7"], timeout=5) as lease:
        assert lease.exclusive == ("repo:1",) and lease.shared == ("remote:7",)
        assert lock_holders(r) == {
            lock("repo:1"): {lease.token: "x"},
            lock("remote:7"): {lease.token: "s"},
        }
        assert lease.token.startswith(mgr.owner_id + "|")
        lease.check()  # not lost: no exception
    assert lease.released and not lease.lost
    assert lock_holders(r) == {} and registries(r) == {}
    assert {k.split(":", 2)[1] for k in namespace_keys(r)} <= {
        "fence",
        "born",
        "format",
        "owners",
        "alive",
    }


def test_holder_tokens_are_the_owner_id_and_a_short_request_number_never_reused(
    managers: Managers, r: redis.Redis
) -> None:
    # Before: '<pid>-<16 hex>|<32 hex uuid>', 55 bytes stored in every held
    # lock. Now the owner id is 17 characters and the request id a counter.
    one, two = managers(), managers()
    assert re.fullmatch(r"\d+-[A-Za-z0-9_-]{11}", one.owner_id), one.owner_id
    leases = [
        m.acquire(f"t{i}-{j}", timeout=0) for i in range(20) for j, m in enumerate((one, two))
    ]
    tokens = [lease.token for lease in leases]
    assert len(set(tokens)) == len(tokens)
    for lease in leases:
        owner, _, number = lease.token.partition("|")
        assert owner == lease.owner_id and re.fullmatch(r"[0-9a-f]{1,8}", number), lease.token
        assert r.hexists(f"{{t}}:lock:{lease.resources[0]}", lease.token)
    # one counter per process: a request id is never handed out twice, even
    # to two managers (or to an identity that replaced a retired one)
    numbers = [t.partition("|")[2] for t in tokens]
    assert len(set(numbers)) == len(numbers)
    for lease in leases:
        lease.release()


def test_an_owners_registry_of_a_few_locks_is_one_compact_hash_of_resource_names(
    managers: Managers, r: redis.Redis
) -> None:
    # Before: a set of lock keys, a hash table at any size (about 76 B per
    # lock). A hash of up to 128 short fields is one listpack (ziplist on 6.2).
    mgr = managers()
    leases = [mgr.acquire(f"repo:{i}", timeout=0) for i in range(5)]
    held = "{t}:held:" + mgr.owner_id
    assert r.hgetall(held) == {f"repo:{i}".encode(): b"" for i in range(5)}
    assert r.object("encoding", held) in (b"listpack", b"ziplist")
    for lease in leases:
        lease.release()
    assert not r.exists(held)


def test_fencing_tokens_strictly_increase_across_managers(managers: Managers) -> None:
    one, two = managers(), managers()
    tokens = []
    for i in range(20):
        mgr = (one, two)[i % 2]
        with mgr.lock(exclusive=["a"], shared=[f"s{i}"], timeout=5) as lease:
            tokens.append(lease.fencing_token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_fencing_tokens_stay_above_earlier_ones_after_a_restart_without_persistence(
    managers: Managers, redis_server: RedisServer, r: redis.Redis
) -> None:
    mgr = managers()
    before = []
    for _ in range(5):
        with mgr.lock(exclusive=["a"], timeout=5) as lease:
            before.append(lease.fencing_token)
    held = mgr.acquire(exclusive=["b"], timeout=5)

    redis_server.restart()  # empty again: no fence counter, no scripts, no liveness
    client = redis_server.client()
    try:
        assert client.dbsize() == 0
        assert client.script_exists(*mgr.channel.scripts.shas.values()) == [False] * len(
            mgr.channel.scripts.shas
        )
        # the same manager (stale connections, NOSCRIPT, liveness gone) ...
        after_same = mgr.acquire(exclusive=["a"], timeout=5)
        # ... and a fresh one both get tokens above every earlier one
        fresh = managers()
        after_fresh = fresh.acquire(exclusive=["c"], timeout=5)
    finally:
        client.close()
    assert after_same.fencing_token > max(before) and after_same.fencing_token > held.fencing_token
    assert after_fresh.fencing_token > after_same.fencing_token
    assert after_same.owner_id != held.owner_id  # the old identity was declared dead
    assert held.lost  # its lock vanished with the restart
    after_same.release()
    after_fresh.release()


def test_scripts_run_again_after_script_flush(managers: Managers, r: redis.Redis) -> None:
    mgr = managers()
    first = mgr.acquire(exclusive=["a"], timeout=5)
    r.script_flush()
    first.release()  # release.lua reloaded on NOSCRIPT
    r.script_flush()
    with mgr.lock(exclusive=["a"], timeout=5) as second:
        assert second.fencing_token > first.fencing_token
    r.script_flush()
    assert mgr.cleanup_owner("nobody-1").status == "cleaned"
    r.script_flush()
    assert mgr.reconcile().errors == {}
    assert lock_holders(r) == {}


# -- idempotent requests and interrupts ----------------------------------


def test_the_same_request_sent_twice_yields_one_grant_with_one_fence(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    req = mgr.request(["a"], ["b"])
    ident = mgr.liveness.identity.current()
    token = f"{ident.owner_id}|retried-request"

    first = mgr.acquirer.attempt(ident, token, req, True, False)
    ident.registered = True
    second = mgr.acquirer.attempt(ident, token, req, True, False)  # e.g. a retry after a timeout

    assert int(first[0]) == 1 and int(second[0]) == 1
    assert int(second[1]) == int(first[1])  # the same grant, not a new one
    assert int(r.get("{t}:fence") or 0) == int(first[1])  # the counter moved once
    assert lock_holders(r) == {lock("a"): {token: "x"}, lock("b"): {token: "s"}}
    assert registries(r) == {ident.owner_id: {lock("a"), lock("b")}}

    mgr.releaser.end_request(ident.owner_id, token, req)
    assert lock_holders(r) == {} and registries(r) == {}
    assert not r.exists("{t}:req:" + token)


def test_interrupt_after_the_grant_leaves_nothing_held(
    managers: Managers, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr, other = managers(), managers()
    real_attempt = mgr.acquirer.attempt
    granted: list[Any] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        reply = real_attempt(*args, **kwargs)
        if int(reply[0]) == 1:
            granted.append(reply)
            raise KeyboardInterrupt  # arrives after Redis committed the grant
        return reply

    monkeypatch.setattr(mgr.acquirer, "attempt", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.acquire(exclusive=["a"], shared=["b"], timeout=5)

    assert granted  # the script did grant
    assert lock_holders(r) == {} and registries(r) == {}
    assert not [k for k in namespace_keys(r) if k.split(":")[1] in ("req", "wake", "q")]
    assert mgr.state.leases == {} and mgr.state.deferred == {}
    with other.lock(exclusive=["a", "b"], timeout=0):
        pass

    # the interrupted thread is not left "inside" a lock: a plain acquire works
    monkeypatch.setattr(mgr.acquirer, "attempt", real_attempt)
    with mgr.lock(exclusive=["a"], timeout=None):
        pass


def test_interrupt_while_waiting_leaves_no_queue_entry(
    managers: Managers, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder, mgr = managers(), managers()
    held = holder.acquire(exclusive=["a"], timeout=0)

    def interrupted_block(token: str, seconds: float) -> None:
        assert r.zcard("{t}:q:a") == 1  # really queued when the interrupt comes
        raise KeyboardInterrupt

    monkeypatch.setattr(mgr.acquirer, "block", interrupted_block)
    with pytest.raises(KeyboardInterrupt):
        mgr.acquire(exclusive=["a"], timeout=10)

    assert not r.exists("{t}:q:a")
    assert lock_holders(r) == {lock("a"): {held.token: "x"}}
    mine = ("{t}:req:" + mgr.owner_id, "{t}:wake:" + mgr.owner_id)
    assert not [k for k in namespace_keys(r) if k.startswith(mine)]
    assert_registry_truth(r)


# -- bad input -------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("no resources", {}),
    ("empty lists", {"exclusive": [], "shared": []}),
    ("empty name", {"exclusive": [""]}),
    ("None name", {"exclusive": [None]}),
    ("int name", {"shared": [42]}),
    ("bytes names", {"exclusive": b"abc"}),
    ("bytes in list", {"exclusive": [b"abc"]}),
    ("too long", {"exclusive": ["x" * (MAX_RESOURCE_BYTES + 1)]}),
    ("too long in utf-8", {"exclusive": ["é" * (MAX_RESOURCE_BYTES // 2 + 1)]}),
    ("newline", {"exclusive": ["a\nb"]}),
    ("nul", {"shared": ["a\x00b"]}),
    ("del", {"shared": ["a\x7f"]}),
    ("lone surrogate", {"exclusive": ["a\udc80"]}),
    ("shared and exclusive", {"exclusive": ["a", "b"], "shared": ["b"]}),
    ("too many", {"exclusive": [f"r{i}" for i in range(MAX_RESOURCES + 1)]}),
]


@pytest.mark.parametrize("kwargs", [k for _, k in BAD_REQUESTS], ids=[n for n, _ in BAD_REQUESTS])
def test_bad_requests_raise_invalid_resource_and_leave_nothing(
    managers: Managers, r: redis.Redis, kwargs: dict[str, Any]
) -> None:
    mgr = managers()
    with pytest.raises(InvalidResource) as info:
        mgr.acquire(timeout=0, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, LockError)
    with pytest.raises(InvalidResource):
        with mgr.lock(timeout=0, **kwargs):
            pass
    assert all_keys(r) == set()


def test_longest_valid_name_is_accepted(managers: Managers, r: redis.Redis) -> None:
    name = "x" * MAX_RESOURCE_BYTES
    with managers().lock(exclusive=[name], timeout=0):
        assert r.exists(lock(name))


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan, "5", True])
def test_bad_timeouts_raise_value_error_and_leave_nothing(
    managers: Managers, r: redis.Redis, timeout: Any
) -> None:
    with pytest.raises(ValueError, match="timeout"):
        managers().acquire(exclusive=["a"], timeout=timeout)
    assert all_keys(r) == set()


def test_nested_acquire_without_timeout_raises_value_error_and_changes_nothing(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    with mgr.lock(exclusive=["outer"], timeout=5):
        before = {k: r.dump(k) for k in all_keys(r)}
        with pytest.raises(ValueError, match="nested"):
            mgr.acquire(exclusive=["inner"], timeout=None)
        with pytest.raises(ValueError, match="nested"):
            mgr.acquire(exclusive=["inner"])
        assert {k: r.dump(k) for k in all_keys(r)} == before
        with mgr.lock(exclusive=["inner"], timeout=1):  # with a timeout it is fine
            pass
    assert lock_holders(r) == {}


BAD_CONFIG: list[tuple[str, dict[str, Any]]] = [
    ("owner_ttl", {"owner_ttl": 0}),
    ("owner_ttl", {"owner_ttl": -1}),
    ("owner_ttl", {"owner_ttl": math.nan}),
    ("owner_ttl", {"owner_ttl": "30"}),
    ("owner_ttl", {"owner_ttl": True}),
    ("heartbeat_interval", {"owner_ttl": 10, "heartbeat_interval": 6}),
    ("heartbeat_interval", {"heartbeat_interval": 0}),
    ("heartbeat_interval", {"heartbeat_interval": -1}),
    ("heartbeat_interval", {"heartbeat_interval": math.nan}),
    ("heartbeat_interval", {"heartbeat_interval": "1"}),
    ("namespace", {"namespace": ""}),
    ("namespace", {"namespace": "a b"}),
    ("namespace", {"namespace": "a}b"}),
    ("namespace", {"namespace": "a:b"}),
    ("namespace", {"namespace": "n" * 65}),
    ("namespace", {"namespace": None}),
    ("queue_scan_limit", {"queue_scan_limit": 0}),
    ("redis_url", {"redis_url": 6379}),
    ("redis_url", {"redis_url": "http://127.0.0.1:6379"}),
]


@pytest.mark.parametrize(
    ("setting", "kwargs"), BAD_CONFIG, ids=[f"{s}={list(k.values())[-1]!r}" for s, k in BAD_CONFIG]
)
def test_bad_configuration_raises_configuration_error_naming_the_setting(
    redis_url: str, r: redis.Redis, setting: str, kwargs: dict[str, Any]
) -> None:
    kwargs = dict(kwargs)
    url = kwargs.pop("redis_url", redis_url)
    with pytest.raises(ConfigurationError) as info:
        LockManager(url, **kwargs)
    assert info.value.setting == setting and str(info.value).startswith(setting + ":")
    assert isinstance(info.value, ValueError)
    assert all_keys(r) == set()


def test_unreachable_redis_raises_redis_unavailable_naming_the_url(
    managers: Managers, free_port: Any
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    mgr = managers(url=url)
    with pytest.raises(RedisUnavailable) as info:
        mgr.acquire(exclusive=["a"], timeout=1)
    assert info.value.url == url and url in str(info.value)
    assert isinstance(info.value, LockError)
    with pytest.raises(RedisUnavailable, match="127.0.0.1"):
        mgr.reconcile()
    with pytest.raises(RedisUnavailable):
        mgr.cleanup_owner("someone-1")


def test_unreachable_redis_error_does_not_leak_the_password(
    managers: Managers, free_port: Any
) -> None:
    port = free_port()
    mgr = managers(url=f"redis://app:s3cret-pw@127.0.0.1:{port}/0")
    with pytest.raises(RedisUnavailable) as info:
        mgr.acquire(exclusive=["a"], timeout=1)
    assert "s3cret-pw" not in str(info.value) and "s3cret-pw" not in info.value.url
    assert f"redis://app:***@127.0.0.1:{port}/0" in str(info.value)


def test_timeout_zero_gives_up_at_once_with_lock_timeout(managers: Managers) -> None:
    holder, other = managers(), managers()
    with holder.lock(exclusive=["a"], timeout=0):
        with pytest.raises(LockTimeout) as info:
            other.acquire(shared=["a"], timeout=0)
        assert info.value.timeout == 0 and info.value.resources == ("a",)


# -- the eviction check ----------------------------------------------------


def test_eviction_check_reports_noeviction_safe_and_lru_may_evict(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    original = r.config_get("maxmemory-policy")["maxmemory-policy"]
    assert original == b"noeviction" or original == "noeviction"
    safe = mgr.check_eviction()
    assert (safe.policy, safe.may_evict) == ("noeviction", False)
    assert "never evicted" in safe.describe()
    try:
        r.config_set("maxmemory-policy", "allkeys-lru")
        risky = check_eviction(mgr.client)
        assert (risky.policy, risky.may_evict) == ("allkeys-lru", True)
        assert "noeviction" in risky.describe()  # tells the operator the fix
    finally:
        r.config_set("maxmemory-policy", original)
    assert check_eviction(r).may_evict is False


def test_a_list_of_names_changed_after_a_request_is_read_afresh(managers: Any) -> None:
    # Requests are cached by their names; a list the caller changes later
    # must be read as it is now, not as it was.
    mgr = managers()
    names = ["A", "B"]
    with mgr.lock(names, timeout=0) as first:
        assert first.resources == ("A", "B")
    names.append("C")
    with mgr.lock(names, timeout=0) as second:
        assert second.resources == ("A", "B", "C")
    names[0] = "bad\n"
    with pytest.raises(InvalidResource):
        mgr.acquire(names, timeout=0)
    # A tuple of the same names is the same request.
    with mgr.lock(("A", "B", "C"), shared=["S"], timeout=0) as third:
        assert third.resources == ("A", "B", "C", "S")
