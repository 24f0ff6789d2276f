"""An owner holding many locks: its registry spills into buckets.

Up to ``REGISTRY_SPILL_AT`` grants an owner's registry is one hash of
resource names (one compact listpack/ziplist). Past it, further names go
to bucket hashes listed by a bucket index, so no hash outgrows the compact
encoding (a hash table costs 68-95 B per entry instead of about 14 B), and
every path that reads or edits a registry (release, reclaim by another
acquirer, cleanup, the inspector) sees the buckets: registry truth holds.
"""

from __future__ import annotations

import os

import redis

from celery_redislock import Inspector, LockManager
from celery_redislock.protocol.options import REGISTRY_SPILL_AT
from conftest import Managers
from engine_helpers import assert_registry_truth, counting, namespace_keys, registries

MANY = REGISTRY_SPILL_AT * 3
COMPACT = (b"listpack", b"ziplist")


def held_keys(r: redis.Redis, owner: str) -> set[str]:
    return {k for k in namespace_keys(r) if k.startswith("{t}:held:" + owner)}


def spilled_and_dead(managers: Managers, r: redis.Redis) -> tuple[LockManager, LockManager]:
    """A dead owner (:func:`dead_to_be`, liveness key deleted) that held
    ``MANY`` locks (spilled into buckets), and another manager."""
    dead, other = dead_to_be(managers), managers()
    take(dead, MANY)
    assert r.delete("{t}:alive:" + dead.owner_id) == 1
    return dead, other


def dead_to_be(managers: Managers) -> LockManager:
    """A manager whose owner the test will declare dead (its liveness key
    deleted): no heartbeat, and no lost-owner watch that would notice and
    free its locks before the test's own path does."""
    mgr = managers(heartbeat=False)
    mgr.watcher.exempt_pid = os.getpid()
    return mgr


def take(mgr: LockManager, count: int, prefix: str = "repo:") -> list:
    return [mgr.acquire(f"{prefix}{i}", timeout=0) for i in range(count)]


def test_an_owner_holding_many_locks_keeps_every_registry_hash_compact(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    leases = take(mgr, MANY)

    keys = held_keys(r, mgr.owner_id)
    assert len(keys) > 2, keys  # the main hash, the bucket index, buckets
    for key in keys:
        assert r.object("encoding", key) in COMPACT, (key, r.hlen(key))
    assert registries(r)[mgr.owner_id] == {f"{{t}}:lock:repo:{i}" for i in range(MANY)}
    assert_registry_truth(r)
    inspector = Inspector(mgr, batch_size=7)  # small batches: the walks must page
    assert sorted(inspector.registry(mgr.owner_id)) == sorted(
        f"{{t}}:lock:repo:{i}" for i in range(MANY)
    )
    assert inspector.owner(mgr.owner_id).locks == MANY
    assert inspector.status().registered_locks == MANY

    for lease in leases:
        lease.release()
    assert_registry_truth(r)
    assert mgr.owner_id not in registries(r)


def test_cleanup_of_a_dead_owner_that_spilled_frees_every_lock_and_its_buckets(
    managers: Managers, r: redis.Redis
) -> None:
    dead, other = spilled_and_dead(managers, r)

    report = other.cleanup_owner(dead.owner_id)

    assert report.status == "cleaned"
    assert report.released == MANY
    assert held_keys(r, dead.owner_id) == set()
    assert_registry_truth(r)
    with other.lock(exclusive=[f"repo:{i}" for i in range(0, MANY, 7)], timeout=0):
        pass


def test_an_acquirer_reclaiming_a_spilled_grant_removes_it_from_its_bucket(
    managers: Managers, r: redis.Redis
) -> None:
    dead, other = spilled_and_dead(managers, r)
    last = f"repo:{MANY - 1}"  # taken after the spill: in a bucket

    with other.lock(last, timeout=0):
        assert f"{{t}}:lock:{last}" not in registries(r)[dead.owner_id]
        assert_registry_truth(r)


def test_a_resource_held_twice_across_the_spill_leaves_no_registry_entry_behind(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    first = mgr.acquire(shared="both", timeout=0, nested=False)  # in the main hash
    leases = take(mgr, MANY)
    second = mgr.acquire(shared="both", timeout=0, nested=False)  # in its bucket
    assert "{t}:lock:both" in registries(r)[mgr.owner_id]

    first.release()
    assert "{t}:lock:both" in registries(r)[mgr.owner_id]  # still held by `second`
    second.release()
    assert "{t}:lock:both" not in registries(r)[mgr.owner_id]
    assert_registry_truth(r)
    for lease in leases:
        lease.release()
    assert_registry_truth(r)


def test_closing_a_manager_that_spilled_deletes_its_bucket_index(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    owner = mgr.owner_id
    for lease in take(mgr, MANY):
        lease.release()
    assert held_keys(r, owner) == {"{t}:held:" + owner + "|"}  # the index alone

    mgr.close()

    assert held_keys(r, owner) == set()


def test_a_spilled_owner_pays_two_commands_more_per_cycle_however_many_it_holds(
    managers: Managers, r: redis.Redis
) -> None:
    # No heartbeat and no lost-owner watcher: the beats, and the watcher's
    # BLPOP and PTTL while the owner holds leases, would land in the
    # counted windows (a watcher's BLPOP returning inside one was seen).
    mgr = managers(heartbeat=False, owner_ttl=600)
    mgr.watcher.exempt_pid = os.getpid()

    def cycle() -> dict[str, int]:
        with counting(r) as delta:
            mgr.acquire("probe", timeout=0, nested=False).release()
        return {k: v for k, v in delta.items() if v}

    mgr.acquire("warm", timeout=0).release()  # registers the owner
    plain = cycle()
    leases = take(mgr, MANY)
    spilled = cycle()
    leases += take(mgr, MANY, prefix="more:")
    spilled_more = cycle()

    # The bucket index HSET on acquire, the bucket HDEL on release.
    assert sum(spilled.values()) == sum(plain.values()) + 2, (plain, spilled)
    assert spilled_more == spilled  # flat in the number of locks held
    for lease in leases:
        lease.release()


def test_names_that_differ_in_a_digit_spread_over_buckets_that_all_stay_compact(
    r: redis.Redis, managers: Managers
) -> None:
    # 5,000 names like res-000123: about 78 per bucket if they spread
    # evenly; a bucket past 128 would turn into a hash table.
    mgr = managers()
    leases = [mgr.acquire(f"res-{i:06d}", timeout=0) for i in range(5000)]
    sizes = {}
    for key in held_keys(r, mgr.owner_id):
        assert r.object("encoding", key) in COMPACT, (key, r.hlen(key))
        sizes[key] = r.hlen(key)
    assert len(sizes) == 2 + 64, sorted(sizes)  # main hash, index, 64 buckets
    for lease in leases:
        lease.release()
