"""The engine across real processes: exclusion, crashes, pauses and forks.

Each child is a spawned process with its own LockManager (see
engine_helpers.Child); the fork test forks this process on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import time

import redis

from engine_helpers import (
    Child,
    Managers,
    admin_url,
    assert_registry_truth,
    check_event_log,
    child_holder,
    child_mutex_worker,
    child_waiter,
    kinds,
    lock_holders,
    namespace_keys,
    wait_until,
)

#: Extra seconds allowed on top of a bound the issue sets, for a loaded
#: 2-core machine (process scheduling, Redis latency).
MARGIN = 3.0


def test_processes_in_mixed_modes_never_hold_incompatible_locks(
    redis_url: str, r: redis.Redis, closing: list[Child]
) -> None:
    workers, iterations = 4, 50
    for seed in range(workers):
        closing.append(Child(child_mutex_worker, redis_url, "t", seed, iterations))
    for child in closing:
        child.expect("ready")
    for child in closing:
        child.send("go")
    writes = sum(child.expect("done", timeout=90)[1] for child in closing)

    events = [e.decode() for e in r.lrange("events", 0, -1)]
    most = check_event_log(events)  # no exclusive holder ever overlapped another holder
    print("most holders at once:", most, "queued requests:", r.get("{t}:seq"))
    enters = [e for e in events if e.startswith("enter|")]
    assert len({e.split("|")[3] for e in enters}) == workers * iterations
    # the non-atomic read-modify-write under the exclusive lock lost no update
    assert writes > 0
    assert int(r.get("counter") or 0) == writes
    # nothing held or queued once everyone released
    assert kinds(namespace_keys(r)) <= {"fence", "born", "seq", "format", "owners", "alive"}


def test_waiter_acquires_from_sigkilled_holder_within_owner_ttl_plus_heartbeat(
    redis_url: str, r: redis.Redis, closing: list[Child]
) -> None:
    owner_ttl = 2.0
    heartbeat = owner_ttl / 3  # LockManager's default interval
    holder = Child(child_holder, redis_url, "t", owner_ttl, ["a"], ["b"])
    closing.append(holder)
    _, holder_fence, holder_owner, _ = holder.expect("held")

    waiter = Child(child_waiter, redis_url, "t", owner_ttl, ["a", "b"], [], 60.0)
    closing.append(waiter)
    waiter.expect("waiting")
    # the waiter is already queued behind the holder before the crash
    wait_until(lambda: r.zcard("{t}:q:a") == 1 and r.zcard("{t}:q:b") == 1, what="queued")

    killed_at = time.monotonic()
    holder.signal(signal.SIGKILL)
    _, waiter_fence, acquired_at, waiter_token = waiter.expect("acquired", timeout=30)

    # no reconcile, no cleanup_owner: the waiter's own script reclaimed the locks
    assert acquired_at - killed_at <= owner_ttl + heartbeat + MARGIN
    assert waiter_fence > holder_fence
    holders = lock_holders(r)
    assert holders == {"{t}:lock:a": {waiter_token: "x"}, "{t}:lock:b": {waiter_token: "x"}}
    assert not r.exists("{t}:held:" + holder_owner)
    assert_registry_truth(r)


def test_holder_paused_past_owner_ttl_loses_lock_and_learns_it_after_sigcont(
    redis_url: str, r: redis.Redis, closing: list[Child]
) -> None:
    holder = Child(child_holder, redis_url, "t", 2.0, ["a"], [])
    closing.append(holder)
    _, holder_fence, holder_owner, _ = holder.expect("held")
    waiter = Child(child_waiter, redis_url, "t", 10.0, ["a"], [], 60.0)
    closing.append(waiter)
    waiter.expect("waiting")
    wait_until(lambda: r.zcard("{t}:q:a") == 1, what="waiter queued")

    holder.signal(signal.SIGSTOP)
    try:
        _, waiter_fence, _, waiter_token = waiter.expect("acquired", timeout=30)
    finally:
        holder.signal(signal.SIGCONT)

    holder.send("wait_lost")
    _, lost, check_raised, fence = holder.expect("lost")
    assert lost is True
    assert check_raised is True  # lease.check() raised LockLost
    assert fence == holder_fence < waiter_fence

    # the late release of the lost lease does not free the new holder
    holder.send("release")
    holder.expect("released")
    assert lock_holders(r) == {"{t}:lock:a": {waiter_token: "x"}}
    assert_registry_truth(r)
    waiter.send("release")
    waiter.expect("released")
    assert not r.exists("{t}:lock:a")


def test_forked_child_has_its_own_owner_id_and_heartbeat(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers(owner_ttl=1.5)  # heartbeat every 0.5 s
    parent_lease = mgr.acquire(exclusive=["parent"], timeout=5)
    parent_owner = mgr.owner_id
    wait_until(lambda: mgr.heartbeat.ticks >= 1, what="parent heartbeat")

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        status = 0
        try:
            result: dict[str, object] = {"owner_id": mgr.owner_id}
            result["inherited_lease_lost"] = parent_lease.lost
            parent_lease.release()  # a lease inherited across fork: a no-op
            lease = mgr.acquire(exclusive=["child"], timeout=5)
            result["lease_owner"] = lease.owner_id
            result["ticks_at_start"] = mgr.heartbeat.ticks
            # more beats than fit in owner_ttl: only a heartbeat of the
            # child's own keeps its liveness key alive that long
            wait_until(lambda: mgr.heartbeat.ticks >= 5, what="child heartbeat")
            result["ticks"] = mgr.heartbeat.ticks
            client = redis.Redis.from_url(admin_url(mgr.url))
            result["alive"] = client.exists("{t}:alive:" + str(result["owner_id"]))
            result["pttl"] = client.pttl("{t}:alive:" + str(result["owner_id"]))
            lease.release()
            client.close()
        except BaseException as exc:
            result = {"error": repr(exc)}
            status = 1
        finally:
            os.write(write_fd, json.dumps(result).encode())
            os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        result = json.loads(pipe.read() or b"{}")  # EOF once the child exits
    _, raw_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(raw_status) == 0, result
    assert result["owner_id"] != parent_owner
    assert result["lease_owner"] == result["owner_id"]
    assert result["inherited_lease_lost"] is True
    assert result["ticks_at_start"] == 0  # the child's counter, not the parent's
    assert int(result["ticks"]) >= 5  # type: ignore[call-overload]
    assert result["alive"] == 1 and int(result["pttl"]) > 0  # type: ignore[call-overload]

    # the parent is untouched: same id, lease still held, heartbeat running
    assert mgr.owner_id == parent_owner
    assert not parent_lease.lost
    assert mgr.heartbeat.running
    holders = lock_holders(r)
    assert holders == {"{t}:lock:parent": {parent_lease.token: "x"}}
    assert r.exists("{t}:alive:" + parent_owner)
    parent_lease.release()


def test_child_processes_get_distinct_owner_ids(
    redis_url: str, closing: list[Child], managers: Managers
) -> None:
    mine = managers().owner_id
    ids = set()
    for _ in range(2):
        child = Child(child_waiter, redis_url, "t", 5.0, [f"r{len(ids)}"], [], 10.0)
        closing.append(child)
        ids.add(child.expect("waiting")[1])
        child.expect("acquired")
    assert len(ids) == 2 and mine not in ids
