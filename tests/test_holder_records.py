"""Task holder records: who holds a grant taken by a task (what ``@locked``
passes), kept as the resource's value in the owner's registry
(``{ns}:held:<owner>``, or its bucket) after the grant's request id,
carried by a hand-off and an adoption, gone with the grant; a plain engine
lock records ``''``. An earlier release kept the record in a key of its own
(``{ns}:holder:<token>``): such a key is still read, and deleted with the
grant."""

from __future__ import annotations

import threading

import redis

from celery_redislock import Inspector, Lease, LockManager
from celery_redislock.protocol.keys import registry_bucket
from engine_helpers import Managers, acquire_as_task, wait_until

INFO = "proj.sync\n0b7e4a2c-7b1e-4bd5-9f3e-6a1d0c2f9e41\ncelery@w1"
OTHER = "proj.other\n5f1c2d3e-0000-4bd5-9f3e-6a1d0c2f9e41\ncelery@w1"


def as_task(
    mgr: LockManager, resource: str, timeout: float, info: str = INFO, *, shared: bool = False
) -> Lease:
    """Acquire ``resource`` (exclusive, or ``shared``) as @locked does in a task."""
    if shared:
        return acquire_as_task(mgr, info, shared=[resource], timeout=timeout)
    return acquire_as_task(mgr, info, resource, timeout=timeout)


def record(r: redis.Redis, lease: Lease, resource: str) -> bytes | None:
    """The resource's value in the lease's owner's registry."""
    return r.hget("{t}:held:" + lease.owner_id, resource)


def request_id(lease: Lease) -> str:
    return lease.token.split("|", 1)[1]


def task_of(mgr: LockManager, resource: str) -> list[tuple[str | None, ...]]:
    """(token, task name, task id, node) of each holder, as the operator sees it."""
    return [
        (h.token, h.task_name, h.task_id, h.node)
        for h in Inspector(mgr).locks([resource])[0].holders
    ]


def holder_keys(r: redis.Redis) -> list[bytes]:
    return sorted(r.keys("{t}:holder:*"))


def test_a_plain_lock_records_no_holder(managers: Managers, r: redis.Redis) -> None:
    mgr = managers()
    with mgr.lock("R", timeout=5) as lease:
        assert record(r, lease, "R") == b""
        assert task_of(mgr, "R") == [(lease.token, None, None, None)]
    assert holder_keys(r) == []


def test_a_task_grant_records_its_holder_in_the_registry_until_released(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    lease = as_task(mgr, "R", 5)
    assert record(r, lease, "R") == f"{request_id(lease)}\n{INFO}".encode()
    assert task_of(mgr, "R") == [(lease.token, *INFO.split("\n"))]
    assert holder_keys(r) == []  # no key of its own
    lease.release()
    assert not r.exists("{t}:held:" + lease.owner_id)


def test_a_hand_off_writes_the_waiters_holder_record(managers: Managers, r: redis.Redis) -> None:
    first, second = managers(), managers()
    held = first.acquire("R", timeout=5)  # a plain lock
    got: list[Lease] = []
    t = threading.Thread(target=lambda: got.append(as_task(second, "R", 20)))
    t.start()
    wait_until(lambda: r.zcard("{t}:q:R") == 1, what="the task's request queued")
    held.release()  # release.lua hands R to the queued request
    t.join(20)
    lease = got[0]
    assert record(r, lease, "R") == f"{request_id(lease)}\n{INFO}".encode()
    assert task_of(first, "R") == [(lease.token, *INFO.split("\n"))]
    lease.release()
    assert not r.exists("{t}:held:" + lease.owner_id)


def test_cleanup_and_a_reclaim_take_the_holder_record_with_the_grant(
    managers: Managers, r: redis.Redis
) -> None:
    a, b, ops = managers(), managers(), managers(heartbeat=False)
    la = as_task(a, "R1", 5)
    ops.cleanup_owner(la.owner_id, force=True)
    assert not r.exists("{t}:held:" + la.owner_id)
    lb = as_task(b, "R2", 5)
    r.delete("{t}:alive:" + lb.owner_id)  # its liveness lapsed
    with ops.lock("R2", timeout=5):  # reclaims R2 from the dead holder
        assert record(r, lb, "R2") is None
    assert holder_keys(r) == []


def test_two_grants_of_one_owner_on_one_resource_never_show_each_others_task(
    managers: Managers, r: redis.Redis
) -> None:
    # One owner (a process), two tokens on one shared resource (two threads
    # running two tasks): one registry field, so one record. The operator
    # sees the task for the grant the record names, and no task (never the
    # wrong one) for the other.
    mgr = managers()
    first = as_task(mgr, "R", 5, shared=True)
    seen: list[Lease] = []
    t = threading.Thread(target=lambda: seen.append(as_task(mgr, "R", 5, OTHER, shared=True)))
    t.start()
    t.join(20)
    second = seen[0]
    assert sorted(task_of(mgr, "R")) == sorted(
        [(first.token, None, None, None), (second.token, *OTHER.split("\n"))]
    )
    second.release()
    # R stays in the registry (first still holds it), with the record of
    # the grant that left: first still shows no task, not second's.
    assert task_of(mgr, "R") == [(first.token, None, None, None)]
    first.release()


def test_a_spilled_registry_keeps_the_record_in_the_names_bucket(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    mgr.state.spill_at = 0  # every grant goes to the registry's buckets
    lease = as_task(mgr, "R", 5)
    bucket = "{t}:held:" + lease.owner_id + "|" + registry_bucket("R")
    assert r.hget(bucket, "R") == f"{request_id(lease)}\n{INFO}".encode()
    assert task_of(mgr, "R") == [(lease.token, *INFO.split("\n"))]
    lease.release()
    assert not r.exists(bucket)


def test_a_holder_record_key_of_an_earlier_release_is_read_and_deleted_with_the_grant(
    managers: Managers, r: redis.Redis
) -> None:
    # A grant an earlier release wrote: '' in the registry, the record in
    # {ns}:holder:<token>.
    mgr, ops = managers(), managers(heartbeat=False)
    lease = mgr.acquire("R", timeout=5)
    r.set("{t}:holder:" + lease.token, INFO)
    assert task_of(mgr, "R") == [(lease.token, *INFO.split("\n"))]
    ops.cleanup_owner(lease.owner_id, force=True)
    assert holder_keys(r) == []
