"""celery_redislock.inspect: read-only views of holders, waiters, owners, status.

Against the real redis-server fixture. A *dead* owner is a real process
that acquired locks and exited without releasing them (``os._exit``), with
a short owner_ttl; the test waits for its liveness key to expire. A *live*
owner is a LockManager in this process with its heartbeat running.

The helpers here are reused by tests/test_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_redislock import LockManager, LockTimeout
from celery_redislock.ops.inspector import Inspector, describe_fields, redact_url
from engine_helpers import command_delta, commandstats, wait_until
from redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


NS = "t"
DEADLINE = 20.0

# -- helpers (also used by test_cli.py; the waiting and command-counting ones
# -- come from engine_helpers) -------------------------------------------------


_DEAD_OWNER = r"""
import json, os, sys
from celery_redislock import LockManager
url, ns, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
m = LockManager(url, ns, owner_ttl=0.3, name=spec.get("name"))
for ex, sh in spec["leases"]:
    m.acquire(exclusive=ex, shared=sh, timeout=5)
print(m.owner_id, flush=True)
os._exit(0)  # die holding the locks
"""


def dead_owner(
    url: str,
    leases: list[tuple[list[str], list[str]]],
    *,
    namespace: str = NS,
    name: str | None = None,
) -> str:
    """Run a process that takes ``leases`` and dies holding them; return its
    owner id once its liveness key has expired."""
    spec = json.dumps({"leases": leases, "name": name})
    out = subprocess.run(
        [sys.executable, "-c", _DEAD_OWNER, url, namespace, spec],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    owner = out.stdout.strip()
    client = redis.Redis.from_url(url)
    try:
        wait_until(
            lambda: not client.exists(f"{{{namespace}}}:alive:{owner}"), what="liveness expiry"
        )
    finally:
        client.close()
    return owner


def registries(client: redis.Redis, namespace: str = NS) -> dict[str, set[str]]:
    """owner -> lock keys in its registry, read via the owners set (test-side).

    The registry is a hash of resource names; they are returned as lock keys.
    """
    out = {}
    for owner in client.smembers(f"{{{namespace}}}:owners"):
        o = owner.decode()
        names = client.hkeys(f"{{{namespace}}}:held:{o}")
        out[o] = {f"{{{namespace}}}:lock:{k.decode()}" for k in names}
    return out


@pytest.fixture
def insp(redis_url: str) -> Iterator[Inspector]:
    mgr = LockManager(redis_url, NS, heartbeat=False)
    yield Inspector(mgr, batch_size=3)  # small batches: the walks must page
    mgr.close()


def queued_waiter(
    mgr: LockManager, exclusive: Any = None, shared: Any = None, timeout: float = DEADLINE
) -> threading.Thread:
    """Start a thread that waits for the locks, releases them once granted."""

    def run() -> None:
        try:
            mgr.acquire(exclusive=exclusive, shared=shared, timeout=timeout).release()
        except LockTimeout:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- holders ------------------------------------------------------------------


def test_holders_report_token_owner_mode_and_liveness(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    a = managers(name="alpha")
    b = managers(name="beta")
    la = a.acquire(shared=["repo:1"], timeout=5)
    lb = b.acquire(shared=["repo:1"], timeout=5)
    holders = insp.holders("repo:1")
    assert {h.token for h in holders} == {la.token, lb.token}
    by_owner = {h.owner_id: h for h in holders}
    ha = by_owner[a.owner_id]
    assert ha.mode == "shared" and ha.resource == "repo:1"
    assert ha.alive and ha.ttl is not None and 0 < ha.ttl <= 30
    assert ha.description is not None and "name=alpha" in ha.description
    assert ha.fence == la.fencing_token
    assert insp.holders("repo:2") == []


def test_dead_holder_is_reported_dead_with_no_description(insp: Inspector, redis_url: str) -> None:
    owner = dead_owner(redis_url, [(["repo:9"], [])])
    [h] = insp.holders("repo:9")
    assert h.owner_id == owner and h.mode == "exclusive"
    assert not h.alive and h.ttl is None and h.description is None


# -- waiters ------------------------------------------------------------------


def test_waiters_are_listed_in_serving_order_with_mode_and_liveness(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    holder = managers()
    w1, w2 = managers(name="first"), managers(name="second")
    lease = holder.acquire(exclusive=["repo:1"], timeout=5)
    t1 = queued_waiter(w1, exclusive=["repo:1"])
    wait_until(lambda: len(insp.waiters("repo:1")) == 1, what="first waiter queued")
    t2 = queued_waiter(w2, shared=["repo:1"])
    ws = wait_until(
        lambda: (lambda x: x if len(x) == 2 else None)(insp.waiters("repo:1")),
        what="second waiter queued",
    )
    assert [(w.position, w.owner_id, w.mode) for w in ws] == [
        (1, w1.owner_id, "exclusive"),
        (2, w2.owner_id, "shared"),
    ]
    assert all(w.alive and w.state == "queued" and not w.nested for w in ws)
    assert ws[1].description is not None and "name=second" in ws[1].description
    assert insp.lock_info("repo:1").waiting == 2
    lease.release()
    t1.join(DEADLINE)
    t2.join(DEADLINE)
    assert insp.waiters("repo:1") == []


# -- owners -------------------------------------------------------------------


def test_owners_lists_alive_and_dead_owners_with_registry_sizes(
    insp: Inspector, managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead = dead_owner(redis_url, [(["a", "b"], ["c"])])
    live = managers(name="celery@host-1")
    live.acquire(exclusive=["d"], timeout=5)
    owners = {o.owner_id: o for o in insp.owners()}
    assert set(owners) == {dead, live.owner_id}
    assert not owners[dead].alive and owners[dead].locks == 3
    lo = owners[live.owner_id]
    assert lo.alive and lo.locks == 1 and lo.node == "celery@host-1"
    assert lo.pid is not None and lo.host
    assert [o.alive for o in insp.owners()] == [False, True]  # dead first


def test_owner_node_and_incarnation_come_from_its_group_hash_when_present(
    insp: Inspector, managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    grouped = managers(name="celery@w1 inc=abc123", group=lambda: "{t}:group:abc123")
    grouped.acquire(exclusive=["x"], timeout=5)
    plain = managers()
    plain.acquire(exclusive=["y"], timeout=5)
    info = insp.owner(grouped.owner_id)
    assert (info.node, info.incarnation, info.in_group, info.tombstoned) == (
        "celery@w1",
        "abc123",
        True,
        False,
    )
    r.set("{t}:tomb:abc123", "1")
    assert insp.owner(grouped.owner_id).tombstoned is True
    other = insp.owner(plain.owner_id)
    assert (other.node, other.incarnation, other.in_group) == (None, None, None)


# -- locks --------------------------------------------------------------------


def test_locks_walks_registries_and_lists_every_held_lock(
    insp: Inspector, managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead = dead_owner(redis_url, [([f"r{i}" for i in range(5)], ["s"])])
    live = managers()
    live.acquire(shared=["s"], exclusive=["z"], timeout=5)
    infos = insp.locks()
    assert [i.resource for i in infos] == ["r0", "r1", "r2", "r3", "r4", "s", "z"]
    s = next(i for i in infos if i.resource == "s")
    assert {(h.owner_id, h.alive) for h in s.holders} == {(dead, False), (live.owner_id, True)}
    named = insp.locks(["z", "free"])
    assert [(i.resource, len(i.holders)) for i in named] == [("free", 0), ("z", 1)]


def test_odd_typed_registry_member_is_reported_not_dropped(
    insp: Inspector, managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    m = managers()
    m.acquire(exclusive=["ok"], timeout=5)
    r.set("{t}:lock:weird", "not a hash")
    r.hset(f"{{t}}:held:{m.owner_id}", "weird", "")
    infos = {i.resource: i for i in insp.locks()}
    assert infos["weird"].odd_type == "string" and infos["weird"].holders == ()
    assert infos["ok"].odd_type is None


# -- status -------------------------------------------------------------------


def test_status_counts_owners_and_locks_and_reads_fence_and_eviction(
    insp: Inspector, managers: Callable[..., LockManager], redis_url: str, r: redis.Redis
) -> None:
    dead_owner(redis_url, [(["a", "b"], [])])
    live = managers()
    lease = live.acquire(exclusive=["c"], timeout=5)
    st = insp.status()
    assert (st.owners, st.alive_owners, st.dead_owners) == (2, 1, 1)
    assert (st.registered_locks, st.dead_owner_locks) == (3, 2)
    assert st.fence == lease.fencing_token
    assert st.eviction_policy == "noeviction" and not st.may_evict
    assert st.namespace == "t" and st.redis_version
    assert any("reconcile" in w for w in st.warnings)
    json.dumps(st.as_dict())  # JSON-ready


def test_status_warns_when_redis_may_evict_keys(insp: Inspector, r: redis.Redis) -> None:
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        st = insp.status()
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    assert st.may_evict and st.eviction_policy == "allkeys-lru"
    assert any("noeviction" in w for w in st.warnings)


def test_empty_namespace_has_zero_counts_and_no_fence(insp: Inspector) -> None:
    st = insp.status()
    assert (st.owners, st.registered_locks, st.fence) == (0, 0, None)
    assert insp.locks() == [] and insp.owners() == []


# -- cost ---------------------------------------------------------------------

_READ_ONLY = {
    "sscan",
    "smembers",
    "hscan",
    "hkeys",
    "hrandfield",
    "hvals",
    "hlen",
    "pttl",
    "get",
    "exists",
    "hgetall",
    "hget",
    "hexists",
    "hmget",
    "zcard",
    "zrange",
    "type",
}


def _measure(insp: Inspector, r: redis.Redis) -> dict[str, int]:
    before = commandstats(r)
    insp.locks()
    insp.owners()
    insp.status()
    insp.holders("k0")
    insp.waiters("k0")
    insp.queue_lengths()
    return command_delta(before, commandstats(r))


def test_listing_never_scans_the_keyspace_and_costs_the_same_whatever_else_redis_holds(
    insp: Inspector, redis_url: str, r: redis.Redis
) -> None:
    dead_owner(redis_url, [([f"k{i}" for i in range(4)], [])])
    # A live holder with no thread of its own in this process: a dead
    # owner's liveness key set again (a live manager's heartbeat or lost
    # watch would add its own commands to the counts at random moments).
    live = dead_owner(redis_url, [(["m"], ["n"])])
    r.set(f"{{{NS}}}:alive:{live}", "pid=1", px=60_000)
    insp.usage()  # the one-time format check (once per inspector)
    small = _measure(insp, r)
    pipe = r.pipeline(transaction=False)
    for i in range(20000):
        pipe.set(f"unrelated:{i}", "x")
    pipe.execute()
    large = _measure(insp, r)
    assert "scan" not in small and "keys" not in small
    assert large == small  # O(owners + their locks), not O(keyspace)
    assert set(small) <= _READ_ONLY, f"inspection must only read: {small}"


# -- release planning ---------------------------------------------------------


def test_resource_plan_names_every_lock_of_each_dead_owner_and_keeps_live_holders(
    insp: Inspector, managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead = dead_owner(redis_url, [(["other"], ["shared:1"])])
    live = managers()
    live.acquire(shared=["shared:1"], timeout=5)
    plan = insp.plan_resource("shared:1")
    assert [o.owner_id for o in plan.owners] == [dead]
    assert sorted(plan.resources[dead]) == ["other", "shared:1"]
    assert [h.owner_id for h in plan.kept] == [live.owner_id]
    forced = insp.plan_resource("shared:1", force=True)
    assert {o.owner_id for o in forced.owners} == {dead, live.owner_id}
    assert forced.kept == () and [o.owner_id for o in forced.live_owners] == [live.owner_id]


# -- small pieces -------------------------------------------------------------


def test_redact_url_hides_the_password_only() -> None:
    assert redact_url("redis://u:secret@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_describe_fields_parses_the_liveness_value() -> None:
    assert describe_fields("pid=12 host=h name=celery@w inc=ab") == {
        "pid": "12",
        "host": "h",
        "name": "celery@w",
        "inc": "ab",
    }
    assert describe_fields(None) == {}


def test_batch_size_out_of_range_is_refused(redis_url: str) -> None:
    mgr = LockManager(redis_url, NS, heartbeat=False)
    try:
        with pytest.raises(ValueError, match="batch_size"):
            Inspector(mgr, batch_size=0)
    finally:
        mgr.close()


def test_owners_of_a_named_node_are_labelled_from_its_record_and_group(
    insp: Inspector, managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    # The worker bootstep writes {ns}:node:<name> (field inc) and each owner's
    # first acquire registers it in {ns}:group:<inc> (see docs/worker.md).
    r.hset("{t}:node:celery@w1", mapping={"inc": "inc1", "hb": "3", "pid": "99"})
    child = managers(group=lambda: "{t}:group:inc1")
    child.acquire(exclusive=["x"], timeout=5)
    other = managers()
    other.acquire(exclusive=["y"], timeout=5)
    node = insp.node("celery@w1")
    assert node is not None and node.incarnation == "inc1"
    assert list(node.owners) == [child.owner_id] and node.record["hb"] == "3"
    assert node.owners[child.owner_id] == os.getpid()  # parsed from the process tag
    assert insp.node("celery@nowhere") is None
    labelled = {o.owner_id: o for o in insp.owners(nodes=["celery@w1", "celery@nowhere"])}
    assert (labelled[child.owner_id].node, labelled[child.owner_id].incarnation) == (
        "celery@w1",
        "inc1",
    )
    assert labelled[other.owner_id].node is None
    r.set("{t}:tomb:inc1", "1")
    assert {o.owner_id: o.tombstoned for o in insp.owners(nodes=["celery@w1"])}[
        child.owner_id
    ] is True
