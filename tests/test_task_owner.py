"""Locks held by a task id and adopted by the process that runs the task.

``acquire_for_task`` takes resources for the task owner ``task:<id>`` (its
own liveness, the ``ttl`` given); ``adopt`` moves them to the calling
process's owner in one script (adopt.lua), keeping mode and fencing token,
and tombstones the task owner. Real Redis throughout.
"""

from __future__ import annotations

import pytest
import redis

from celery_redislock import Inspector, LockError, LockManager
from celery_redislock.protocol.keys import task_owner_id, task_token, validate_task_id
from engine_helpers import (
    Managers,
    all_keys,
    assert_registry_truth,
    counting,
    lock_fences,
    lock_holders,
    wait_until,
)

TID = "6f1c2a9e-3b7d-4e1a-9c55-0d2b8e4f7a10"


def _alive(r: redis.Redis, owner: str) -> bool:
    return bool(r.exists("{t}:alive:" + owner))


def _expired_task_owner(producer: LockManager, r: redis.Redis, task_id: str, key: str) -> None:
    """``producer`` takes ``key`` for the task ``task_id`` (ttl 0.2 s), whose
    owner's liveness then expires."""
    producer.acquire_for_task(task_id, key, ttl=0.2)
    wait_until(lambda: not _alive(r, f"task:{task_id}"), what="task owner liveness expiry")


def test_a_task_owner_holds_with_its_own_liveness_ttl(managers: Managers, r: redis.Redis) -> None:
    mgr = managers()
    grant = mgr.acquire_for_task(TID, "unique:a", ttl=60)
    assert grant.granted and grant.fencing_token and grant.token == f"task:{TID}|task:{TID}"
    owner = task_owner_id(TID)
    assert 50_000 < r.pttl("{t}:alive:" + owner) <= 60_000
    assert r.sismember("{t}:owners", owner)
    assert lock_holders(r) == {"{t}:lock:unique:a": {grant.token: "x"}}
    assert_registry_truth(r)
    # The process's own owner holds nothing and was not even registered.
    assert not _alive(r, mgr.owner_id)


def test_a_busy_resource_names_the_holding_task_queued_or_running(
    managers: Managers, r: redis.Redis
) -> None:
    producer, worker = managers(), managers()
    assert producer.acquire_for_task("first", "unique:a", ttl=60).granted
    busy = producer.acquire_for_task("second", "unique:a", ttl=60)
    assert not busy.granted and busy.fencing_token is None
    assert busy.holder_task_id == "first" and busy.holder_owner == "task:first"
    # Nothing of the refused task is left behind: no registry, and no
    # liveness key that would live for the whole ttl.
    assert not r.exists("{t}:held:task:second", "{t}:alive:task:second")
    adoption = worker.adopt("first")
    assert adoption.adopted
    busy = producer.acquire_for_task("second", "unique:a", ttl=60)
    assert busy.holder_task_id == "first" and busy.holder_owner == worker.owner_id
    # A plain lock blocks too, and names no task.
    with producer.lock("unique:b", timeout=0):
        other = producer.acquire_for_task("third", "unique:b", ttl=60)
        assert not other.granted and other.holder_task_id is None
        assert other.holder_owner == producer.owner_id


def test_a_refusal_by_a_shared_holder_names_that_holder(managers: Managers) -> None:
    reader, writer, producer = managers(), managers(), managers()
    lease = reader.acquire(shared="r")
    busy = producer.acquire_for_task("t", "r", ttl=60)  # exclusive: the reader blocks it
    assert not busy.granted
    assert busy.holder == lease.token and busy.holder_owner == reader.owner_id
    assert busy.holder_task_id is None  # a plain lock, not a task's
    assert producer.acquire_for_task("t2", shared="r", ttl=60).granted  # readers share
    lease.release()
    held = writer.acquire("w")
    busy = producer.acquire_for_task("t3", shared="w", ttl=60)
    assert not busy.granted and busy.holder == held.token
    held.release()


def test_a_refused_try_keeps_the_liveness_of_a_task_owner_holding_other_locks(
    managers: Managers, r: redis.Redis
) -> None:
    producer = managers()
    assert producer.acquire_for_task("t", "a", ttl=60).granted
    assert producer.acquire_for_task("other", "b", ttl=60).granted
    assert not producer.acquire_for_task("t", "b", ttl=60).granted
    assert _alive(r, "task:t") and lock_holders(r)["{t}:lock:a"] == {"task:t|task:t": "x"}


def test_a_repeated_call_for_the_same_task_is_the_same_grant(
    managers: Managers, r: redis.Redis
) -> None:
    mgr = managers()
    first = mgr.acquire_for_task(TID, "unique:a", ttl=60)
    assert not first.repeated
    again = mgr.acquire_for_task(TID, "unique:a", ttl=60)
    assert again.granted and again.fencing_token == first.fencing_token
    assert again.repeated
    assert lock_holders(r) == {"{t}:lock:unique:a": {first.token: "x"}}


def test_adopt_moves_every_grant_keeping_mode_and_fence(managers: Managers, r: redis.Redis) -> None:
    producer, worker = managers(), managers()
    g1 = producer.acquire_for_task(TID, ["unique:a", "x:1"], shared="s:1", ttl=60)
    fence = g1.fencing_token
    adoption = worker.adopt(TID)
    assert adoption.status == "adopted" and adoption.by == worker.owner_id
    [lease] = adoption.leases
    assert lease.fencing_token == fence
    assert set(lease.exclusive) == {"unique:a", "x:1"} and lease.shared == ("s:1",)
    assert lease.owner_id == worker.owner_id
    token = task_token(worker.owner_id, TID)
    assert lease.token == token
    assert lock_holders(r) == {
        "{t}:lock:unique:a": {token: "x"},
        "{t}:lock:x:1": {token: "x"},
        "{t}:lock:s:1": {token: "s"},
    }
    assert lock_fences(r, "{t}:lock:s:1") == {token: fence}
    assert_registry_truth(r)
    owner = task_owner_id(TID)
    # The task owner is gone: no registry, liveness, owners entry; tombstoned.
    assert not r.exists("{t}:held:" + owner, "{t}:alive:" + owner)
    assert not r.sismember("{t}:owners", owner)
    assert r.exists("{t}:dead:" + owner)
    assert r.sismember("{t}:owners", worker.owner_id) and _alive(r, worker.owner_id)
    # A late acquire for the adopted task id is refused, not re-created.
    with pytest.raises(LockError, match="retired"):
        producer.acquire_for_task(TID, "unique:z", ttl=60)
    # The adopted lease is a normal lease: its release frees the locks.
    lease.release()
    assert lock_holders(r) == {}
    assert_registry_truth(r)


def test_adopted_locks_do_not_make_the_next_acquire_nested(managers: Managers) -> None:
    producer, worker = managers(), managers()
    producer.acquire_for_task(TID, "unique:a", ttl=60)
    [lease] = worker.adopt(TID).leases
    # A nested acquire without a timeout would raise ValueError.
    with worker.lock("other"):
        pass
    lease.release()


def test_adopt_is_idempotent_for_the_same_process(managers: Managers, r: redis.Redis) -> None:
    producer, worker, other = managers(), managers(), managers()
    producer.acquire_for_task(TID, ["a", "b"], ttl=60)
    first = worker.adopt(TID)
    again = worker.adopt(TID)  # a retried call after a lost reply
    assert again.adopted
    assert [(x.token, x.fencing_token, x.resources) for x in again.leases] == [
        (x.token, x.fencing_token, x.resources) for x in first.leases
    ]
    elsewhere = other.adopt(TID)
    assert elsewhere.status == "adopted-elsewhere" and not elsewhere.leases
    assert elsewhere.by == worker.owner_id
    first.leases[0].release()
    # Released since: the retried adopt no longer returns it.
    assert worker.adopt(TID).leases == []
    assert lock_holders(r) == {}


def test_adopting_a_task_owner_that_expired_or_was_released_says_so(
    managers: Managers, r: redis.Redis
) -> None:
    producer, worker = managers(), managers()
    _expired_task_owner(producer, r, "short", "unique:a")
    expired = worker.adopt("short")
    assert expired.status == "expired" and not expired.adopted and expired.leases == []
    # Nothing moved: the dead task owner's grant is anyone's to reclaim.
    assert worker.acquire("unique:a", timeout=0).fencing_token
    producer.acquire_for_task("unsent", "unique:b", ttl=60)
    report = producer.release_task("unsent")
    assert report.released == 1 and report.status == "cleaned"
    assert worker.adopt("unsent").status == "tombstoned"
    assert worker.adopt("never-seen").status == "expired"
    assert "{t}:lock:unique:b" not in lock_holders(r)
    assert_registry_truth(r)


def test_a_task_owner_whose_liveness_expires_is_reclaimed_and_reconciled(
    managers: Managers, r: redis.Redis
) -> None:
    producer, other = managers(), managers()
    _expired_task_owner(producer, r, "lost", "unique:a")
    assert other.acquire_for_task("next", "unique:a", ttl=60).granted  # reclaimed
    _expired_task_owner(producer, r, "lost2", "unique:b")
    report = other.reconcile()
    assert report.released == 1
    assert not r.sismember("{t}:owners", "task:lost2")
    assert r.exists("{t}:dead:task:lost2")
    with pytest.raises(LockError, match="retired"):
        producer.acquire_for_task("lost2", "unique:b", ttl=60)
    assert_registry_truth(r)


def test_each_retry_attempt_has_its_own_task_owner(managers: Managers, r: redis.Redis) -> None:
    producer, worker = managers(), managers()
    producer.acquire_for_task(TID, "unique:a", ttl=60)
    [lease] = worker.adopt(TID).leases
    lease.release()
    retry = producer.acquire_for_task(TID, "unique:a", ttl=60, attempt=1)
    assert retry.granted and retry.token == f"task+1:{TID}|task:{TID}"
    assert worker.adopt(TID, attempt=1).leases[0].fencing_token == retry.fencing_token


def test_adopted_locks_die_with_the_adopting_owner(managers: Managers, r: redis.Redis) -> None:
    producer = managers()
    worker = managers(owner_ttl=0.3, heartbeat=False)
    producer.acquire_for_task(TID, "unique:a", ttl=60)
    [lease] = worker.adopt(TID).leases
    wait_until(lambda: not _alive(r, worker.owner_id), what="adopter liveness expiry")
    # Freed by whoever comes first: reconcile, or the adopter's own watcher
    # putting its lapsed identity to death.
    wait_until(lambda: producer.reconcile() and not lock_holders(r), what="locks freed")
    assert lease.lost


def test_task_ids_that_cannot_be_a_key_suffix_are_refused(managers: Managers) -> None:
    mgr = managers()
    for bad in ("", "a|b", "a\nb", "x" * 600, 42, None, "\ud800"):
        with pytest.raises(ValueError):
            mgr.acquire_for_task(bad, "unique:a", ttl=60)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            mgr.adopt(bad)  # type: ignore[arg-type]
    # What Celery accepts and is safe is accepted: uuids, names, '{', ':'.
    for ok in (TID, "report:42", "{other}:lock:x", "ünïcode id"):
        assert validate_task_id(ok) == ok
    assert mgr.acquire_for_task("{other}:lock:x", "unique:q", ttl=60).granted
    # Every key it wrote is in the namespace (a task id is only ever a suffix),
    # the task owner's liveness key among them.
    keys = all_keys(mgr.client)
    assert "{t}:alive:task:{other}:lock:x" in keys
    assert all(k.startswith("{t}:") for k in keys), sorted(keys)


def test_a_script_flush_between_calls_never_makes_a_first_grant_look_repeated(
    managers: Managers, r: redis.Redis
) -> None:
    """NOSCRIPT of the last script of the pipeline only: the grant made by
    the first one is not mistaken for an earlier one by a resent pipeline."""
    mgr = managers()
    mgr.acquire_for_task("warm", "w", ttl=60)  # both scripts loaded
    r.script_flush()
    mgr.acquire("load-acquire", timeout=0).release()  # acquire.lua loaded again
    grant = mgr.acquire_for_task(TID, "unique:a", ttl=60)
    assert grant.granted and not grant.repeated


def test_adopt_and_acquire_for_task_run_one_script_each(managers: Managers) -> None:
    producer, worker = managers(), managers()
    worker.acquire("warm", timeout=0).release()  # registered, eviction check done
    producer.acquire("warm", timeout=0).release()
    producer.acquire_for_task("warm-task", "warm", ttl=60)  # every script loaded
    worker.adopt("warm-task").leases[0].release()
    with counting(producer.client) as sent:
        producer.acquire_for_task(TID, "unique:a", ttl=60)
    # acquire.lua, then forget_idle.lua in the same pipeline (one round trip).
    assert sent.get("evalsha") == 2 and "script|load" not in sent
    with counting(worker.client) as sent:
        worker.adopt(TID)
    assert sent.get("evalsha") == 1 and "script|load" not in sent


def test_close_leaves_no_owner_behind(managers: Managers, r: redis.Redis) -> None:
    producer, worker = managers(), managers()
    producer.acquire_for_task(TID, "unique:a", ttl=60)
    worker.adopt(TID)
    worker.close()
    assert lock_holders(r) == {}
    assert_registry_truth(r)


def test_lock_manager_is_importable_with_the_new_types() -> None:
    from celery_redislock.engine.manager import Adoption, TaskGrant

    assert Adoption and TaskGrant and LockManager


def test_holder_records_follow_the_grant_to_its_adopter(managers: Managers, r: redis.Redis) -> None:
    producer, worker = managers(), managers()

    def task_of(resource: str) -> tuple[str | None, ...]:
        [held] = Inspector(producer).locks([resource])[0].holders
        return held.token, held.task_name, held.task_id, held.node

    g = producer.acquire_for_task("h1", "unique:a", ttl=60, holder="proj.report\nh1\n")
    assert task_of("unique:a") == (g.token, "proj.report", "h1", None)
    [lease] = worker.adopt("h1", holder="proj.report\nh1\ncelery@w1").leases
    assert task_of("unique:a") == (lease.token, "proj.report", "h1", "celery@w1")
    # Without new holder info the task owner's record moves as it is.
    producer.acquire_for_task("h2", "unique:b", ttl=60, holder="proj.report\nh2\n")
    [lease2] = worker.adopt("h2").leases
    assert task_of("unique:b") == (lease2.token, "proj.report", "h2", None)
    # So does a record key an earlier release wrote (and the key goes).
    g3 = producer.acquire_for_task("h3", "unique:c", ttl=60)
    r.set("{t}:holder:" + g3.token, "proj.report\nh3\nold")
    [lease3] = worker.adopt("h3").leases
    assert task_of("unique:c") == (lease3.token, "proj.report", "h3", "old")
    assert not r.keys("{t}:holder:*")
    for held in (lease, lease2, lease3):
        held.release()
    assert not r.exists("{t}:held:" + worker.owner_id)


def test_a_namespace_of_another_format_refuses_task_acquires(
    managers: Managers, r: redis.Redis
) -> None:
    from celery_redislock import FORMAT_VERSION, FormatMismatch

    r.set("{t}:format", str(FORMAT_VERSION + 1))
    with pytest.raises(FormatMismatch):
        managers().acquire_for_task(TID, "unique:a", ttl=60)
    assert not r.exists("{t}:lock:unique:a", "{t}:alive:task:" + TID)
