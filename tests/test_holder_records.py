"""Task holder records ``{ns}:holder:<token>``: written with a grant taken by
a task (what ``@locked`` passes), copied by a hand-off, deleted with the
grant by release, a reclaim of a dead holder and cleanup; never written for
a plain engine lock."""

from __future__ import annotations

import threading

import redis

from celery_redislock import Inspector, Lease, LockManager
from engine_helpers import Managers, wait_until

INFO = "proj.sync\n0b7e4a2c-7b1e-4bd5-9f3e-6a1d0c2f9e41\ncelery@w1"


def as_task(mgr: LockManager, resource: str, timeout: float) -> Lease:
    """Acquire as @locked does in a task: the holder info set for this thread."""
    mgr._local.holder = INFO
    try:
        return mgr.acquire(resource, timeout=timeout)
    finally:
        mgr._local.holder = None


def holder_keys(r: redis.Redis) -> list[bytes]:
    return sorted(r.keys("{t}:holder:*"))


def test_a_plain_lock_writes_no_holder_record(managers: Managers, r: redis.Redis) -> None:
    with managers().lock("R", timeout=5):
        assert holder_keys(r) == []


def test_a_task_grant_records_its_holder_until_released(managers: Managers, r: redis.Redis) -> None:
    mgr = managers()
    lease = as_task(mgr, "R", 5)
    assert r.get("{t}:holder:" + lease.token) == INFO.encode()
    h = Inspector(mgr).locks(["R"])[0].holders[0]
    assert (h.task_name, h.task_id, h.node) == tuple(INFO.split("\n"))
    lease.release()
    assert holder_keys(r) == []


def test_a_hand_off_copies_the_waiters_holder_record(managers: Managers, r: redis.Redis) -> None:
    first, second = managers(), managers()
    held = first.acquire("R", timeout=5)  # a plain lock
    got: list[Lease] = []
    t = threading.Thread(target=lambda: got.append(as_task(second, "R", 20)))
    t.start()
    wait_until(lambda: r.zcard("{t}:q:R") == 1, what="the task's request queued")
    held.release()  # release.lua hands R to the queued request
    t.join(20)
    lease = got[0]
    assert r.get("{t}:holder:" + lease.token) == INFO.encode()
    lease.release()
    assert holder_keys(r) == []


def test_cleanup_and_a_reclaim_delete_the_holder_record(managers: Managers, r: redis.Redis) -> None:
    a, b, ops = managers(), managers(), managers(heartbeat=False)
    la = as_task(a, "R1", 5)
    ops.cleanup_owner(la.owner_id, force=True)
    assert holder_keys(r) == []
    lb = as_task(b, "R2", 5)
    r.delete("{t}:alive:" + lb.owner_id)  # its liveness lapsed
    with ops.lock("R2", timeout=5):  # reclaims R2 from the dead holder
        assert holder_keys(r) == []
