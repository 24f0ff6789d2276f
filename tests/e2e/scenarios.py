"""Scenarios that more than one e2e module runs, against a plain Redis or a cluster.

Each takes a :class:`e2e.harness.Cluster` set up by the test and asserts
what the scenario must show (e2e/conftest.py has pytest rewrite these
asserts, so a failure shows the values).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .harness import CeleryProcess, Cluster, Worker, wait_for


def contend_and_check_counts(
    c: Cluster, resources: list[str], writes: int, reads_per_round: int
) -> None:
    """Exclusive writes to every resource and shared reads of resource ``0``.

    ``writes`` rounds of one write per resource, with ``reads_per_round``
    reads every third round; then no violation was recorded, every counter
    is exactly ``writes``, every writer left again, and the writes to
    resource ``0`` ran one after another in the order they were sent.
    """
    results = []
    for i in range(writes):
        for res in resources:
            results.append(c.send("write", res, 0.005))
        if i % 3 == 0:
            results.extend(c.send("read", "0", 0.02) for _ in range(reads_per_round))
    for result in results:
        result.get(timeout=180)

    assert c.data.lrange("e2e:violations", 0, -1) == []
    for res in resources:
        assert c.data.get(f"e2e:counter:{res}") == str(writes), res
        # every writer that entered left again: the marker is back to 0
        assert c.data.get(f"e2e:inside:w:{res}") == "0", res
    assert c.data.lrange("e2e:order:0", 0, -1) == [f"w{i}" for i in range(1, writes + 1)]


def restarted_worker_frees_its_predecessors_locks(
    cluster: Callable[..., Cluster], name: str
) -> None:
    """A worker SIGKILLed while holding ``res:r1`` and started again as ``name``.

    The new worker frees its predecessor's locks at start-up, long before
    the predecessor's liveness TTL (60 s on the cluster ``cluster`` makes),
    and the resource is usable again through it.
    """
    c = cluster(owner_ttl=60, heartbeat=1)
    w = c.start_worker(name)
    c.send("hold", "r1", "t1")
    owner = c.wait_held("t1")["owner"]

    w.destroy()  # SIGKILL the whole process group: nobody cleans up
    killed_at = time.monotonic()
    pttl = c.alive_pttl(owner)
    assert pttl > 30_000, "the predecessor's liveness should still be live"
    liveness_expires = killed_at + pttl / 1000
    assert owner in c.owners_holding("res:r1")

    w2 = c.start_worker(name)
    c.wait_freed(owner, "res:r1", "the predecessor's locks to be freed at start-up", timeout=45)
    freed_at = time.monotonic()
    print(f"predecessor's lock freed {freed_at - killed_at:.2f}s after the kill")
    assert freed_at < liveness_expires - 5, "freed only by liveness expiry"
    assert not c.lock_redis.exists(c.key("held", owner))
    assert owner not in c.active_owners()

    # the resource is usable again through the restarted worker
    again = c.send("hold", "r1", "t2", 0, queue=w2.queue)
    assert again.get(timeout=60)["attempt"] == 1
    c.wait_no_lock_keys()


def beat_reconcile_frees_a_dead_workers_lock(
    c: Cluster, keeper: CeleryProcess, victim: Worker, owner: str, resource: str
) -> CeleryProcess:
    """``victim`` (whose ``owner`` holds ``resource``) dies and never comes back.

    ``celery beat`` (started here and returned) schedules the reconcile
    task, ``keeper`` runs it and frees the lock once the owner's liveness is
    gone. ``c`` wants a short owner TTL and reconcile interval.
    """
    victim.destroy()
    beat = c.start_beat()
    c.wait_freed(owner, resource, "beat's reconcile to free the dead worker's lock", timeout=60)
    assert c.alive_pttl(owner) == -2  # freed only once its liveness was gone
    assert not c.lock_redis.exists(c.key("held", owner))
    wait_for(
        lambda: keeper.log_lines("reconcile"), 10, "a reconcile log line", on_timeout=keeper.tail
    )
    return beat
