"""End-to-end: ``@locked(on_busy="defer")`` with real ``celery worker -P prefork``.

docs/defer.md gives the algorithm and its races (D1-D11). Pinned here:

- parked tasks keep their FIFO place among parked and waiting requests and
  free their pool slot (a task on another resource runs while the long one
  holds); each runs once, under its own task id (AsyncResult: DEFERRED, then
  SUCCESS);
- revoking a parked task takes it out of the queue (REVOKED, never runs);
- SIGKILL of the whole worker while a task is parked (D4): another worker
  runs it once the dead holder's liveness ran out;
- an adopting child stalled (SIGSTOP) right after its adoption until past
  the grant deadline and an upkeep (D8: the adoption and the park record's
  ``adopted`` are one step, so the upkeep does not park the task again):
  it runs once;
- SIGKILL of the adopting child before it adopts (D7: the message comes
  back, the copy adopts) and of the whole worker while the grant is in
  transit (D6: the grant TTL runs out, the task is parked again and another
  worker runs it); each runs exactly once;
- the threads, solo and gevent pools dispatch from their main process too;
- a redelivered copy that finds no park record (the lock Redis lost it)
  of a task whose body started (its adoption marker) or ran (SUCCESS) is
  dropped (``defer.stale-copy``), not run again;
- a parked task that retries (``self.retry()``) runs every attempt, parking
  again while its resource is busy;
- a ``UniqueTask`` that parks keeps its unique key while parked (a duplicate
  gets its id), runs as soon as the lock is handed to it, and a withdrawn one
  frees its key;
- waiting tasks (``on_busy="wait"``) in every pool slot (``-c 2``; solo's
  only slot) give their slots up to a grant in transit: parked in their
  places, they run after it, and the grant is adopted in its first life.

The tests that kill nothing share one worker (module fixture); the stall
and SIGKILL tests start their own.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_redislock import Inspector, LockManager, RedisLock
from redis_server import RedisServer

from . import unique_tasks
from .harness import Cluster, redis_ms, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


#: owner_ttl of the shared worker (and of the other pools' test): long, so that the fallbacks that would hide
#: a missing push (a parked task's first re-attempt, park + owner_ttl; a
#: waiting task's own next try, at most owner_ttl after it blocked) come
#: well after the pushes these tests wait for (:func:`_by`).
SHARED_OWNER_TTL = 30.0


def _by(since: float) -> float:
    """Seconds left until ``since`` (epoch) + ``SHARED_OWNER_TTL`` - 2: a task
    done by then was served by push, not by a fallback."""
    return max(0.5, since + SHARED_OWNER_TTL - 2 - time.time())


@contextmanager
def _one_worker(
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    concurrency: int,
    **settings: Any,
) -> Iterator[Cluster]:
    """A Cluster (heartbeat 0.5 s, ``settings``) with one prefork worker
    ``name`` of ``concurrency`` children; closed after."""
    c = Cluster(redis_server.url, tmp_path_factory.mktemp(name), heartbeat=0.5, **settings)
    try:
        c.start_worker(name, concurrency=concurrency)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def shared(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One prefork worker (-c 3) for the tests that kill nothing."""
    with _one_worker(
        redis_server, tmp_path_factory, "defer-shared", 3, owner_ttl=SHARED_OWNER_TTL
    ) as c:
        yield c


@pytest.fixture(scope="module")
def unique_defer(shared: Cluster) -> Iterator[Any]:
    """``e2e.unique_defer`` on a producer app of this test process, so that
    ``delay()`` runs UniqueTask's enqueue (``send_task`` would bypass it)."""
    app = Celery("e2e-defer-producer", broker=shared.broker_url, backend=shared.broker_url)
    app.conf.update(
        task_default_queue=shared.queue,
        result_expires=600,
        redislock_namespace=shared.namespace,
        redislock_url=shared.lock_url,
    )
    locks = RedisLock(app)
    try:
        yield unique_tasks.define_deferred(app, lambda: shared.data)
    finally:
        locks.close()
        consumer = getattr(app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        app.close()


@pytest.fixture(scope="module")
def pair(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefork worker with two pool slots and a grant TTL of 30 s, for
    waiting tasks mixed with deferred ones."""
    with _one_worker(
        redis_server, tmp_path_factory, "defer-pair", 2, owner_ttl=5, defer_grant_ttl=30
    ) as c:
        yield c


def _deferred(c: Cluster, result: Any) -> bool:
    return bool(result.state == "DEFERRED")


def _holding(c: Cluster, res: str, tag: str, what: str = "holder") -> Any:
    """Send ``e2e.dhold`` on ``res`` as ``tag``; return once its body holds the lock."""
    result = c.send("dhold", res, tag)
    wait_for(lambda: c.data.llen(f"e2e:held-log:{tag}"), 60, what, on_timeout=c.report)
    return result


def _parked(c: Cluster, task: str, *args: Any, what: str = "parked", **kwargs: Any) -> Any:
    """Send ``task``; return once it is parked (state DEFERRED)."""
    result = c.send(task, *args, **kwargs)
    wait_for(lambda: _deferred(c, result), 60, what, on_timeout=c.report)
    return result


def _parked_behind(c: Cluster, task: str, res: str) -> tuple[Any, Any]:
    """A ``dhold`` holding ``res`` as ``<res>-h``, then ``task`` on ``res`` as
    ``<res>-d`` parked behind it: both results."""
    return _holding(c, res, f"{res}-h"), _parked(c, task, res, f"{res}-d")


def _queue(c: Cluster, resource: str) -> list[str]:
    return [str(m) for m in c.lock_redis.zrange(c.key("q", resource), 0, -1)]


def _runs(c: Cluster, tag: str) -> int:
    return int(c.data.get(f"e2e:runs:{tag}") or 0)


def test_parked_tasks_keep_their_fifo_place_among_waiters_and_free_their_pool_slot(
    shared: Cluster,
) -> None:
    c = shared
    holder = _holding(c, "fifo", "fifo-h")
    d1 = _parked(c, "dwrite", "fifo", "d1", what="d1 parked")
    assert d1.info["resources"] == ["res:fifo"]
    d1_parked = float(d1.info["parked_at"])
    w2 = c.send("wwrite", "fifo", "w2")  # waits in its pool slot
    wait_for(lambda: len(_queue(c, "res:fifo")) == 2, 60, "w2 queued", on_timeout=c.report)
    w2_queued = time.time()
    d3 = _parked(c, "dwrite", "fifo", "d3", what="d3 parked")
    d3_parked = float(d3.info["parked_at"])
    queue = _queue(c, "res:fifo")
    assert [m.split("|")[0][1:].startswith("defer:") for m in queue] == [True, False, True]
    assert queue[0][1:].startswith(f"defer:{d1.id}|") and queue[2][1:].startswith(f"defer:{d3.id}|")

    # Two slots are taken (the holder, the waiting w2); the third is free
    # although two more tasks wait for res:fifo: tasks on other resources run.
    others = [c.send("dwrite", f"other{i}", f"o{i}") for i in range(4)]
    for r in others:
        r.get(timeout=60)
    assert not c.data.llen("e2e:done:fifo-h"), "the holder finished early"
    assert d1.state == "DEFERRED" and d3.state == "DEFERRED"

    c.go("fifo-h")
    holder.get(timeout=60)
    # Each is handed the lock by the release before it (pushed), before any
    # fallback (its first re-attempt, its own next try) could have served it.
    for r, since in ((d1, d1_parked), (w2, w2_queued), (d3, d3_parked)):
        r.get(timeout=_by(since))
    assert c.data.lrange("e2e:order:fifo", 0, -1) == ["fifo-h", "d1", "w2", "d3"]
    assert [_runs(c, t) for t in ("d1", "w2", "d3")] == [1, 1, 1]
    assert d1.state == "SUCCESS" and d3.state == "SUCCESS"
    assert c.data.lrange("e2e:violations", 0, -1) == []
    wait_for(lambda: not c.namespace_keys("lock"), 30, "locks released", on_timeout=c.report)
    assert c.lock_redis.zcard(c.key("deferred")) == 0
    # Each record is marked done once its task's result is stored.
    records: dict[str, Any] = {}

    def all_done() -> bool:
        records.update({k: c.lock_redis.hget(k, "state") for k in c.namespace_keys("defer")})
        return set(records.values()) == {"done"}

    wait_for(all_done, 30, "every park record done", on_timeout=lambda: str(records))
    # A prefork child logged each park as parked, not as Celery's "ignored".
    logs = [ln for w in c.processes for ln in w.log_lines(d1.id)]
    assert any("parked (on_busy='defer'): it runs when its locks are free" in ln for ln in logs)
    assert any("locked.deferred" in ln and "parked; it runs" in ln for ln in logs), logs
    assert not any(ln.rstrip().endswith(f"[{d1.id}] ignored") for ln in logs), logs


def test_an_adopted_deferred_body_re_enters_its_lock_and_names_its_task_and_node(
    shared: Cluster,
) -> None:
    c = shared
    holder, d = _parked_behind(c, "dreenter", "dre")
    c.go("dre-h")
    holder.get(timeout=60)
    wait_for(lambda: c.data.llen("e2e:held-log:dre-d"), 60, "adopted body", on_timeout=c.report)
    info = json.loads(c.data.lindex("e2e:held-log:dre-d", 0) or "{}")
    # The nested @locked call re-entered the adopted grant (same fence).
    assert info["inner_fence"] == info["outer_fence"] is not None, info
    # The adopted grant carries the task's holder record, naming the node
    # whose child runs it: what the operator sees (redislock locks).
    node = next(p.nodename for p in c.processes if getattr(p, "nodename", "").startswith("defer-"))
    operator = LockManager(c.lock_url, c.namespace, heartbeat=False, eviction_check="ignore")
    try:
        [held] = Inspector(operator).locks(["res:dre"])[0].holders
    finally:
        operator.close()
    assert (held.token, held.task_name, held.task_id, held.node) == (
        info["token"],
        "e2e.dreenter",
        d.id,
        node,
    )
    c.go("dre-d")
    assert d.get(timeout=60)["outer_fence"] == info["outer_fence"]
    wait_for(lambda: not c.namespace_keys("lock"), 30, "locks released", on_timeout=c.report)
    # The holder record goes with the grant (its registry, no key of its own).
    assert not c.namespace_keys("holder") and not c.namespace_keys("held")


def test_revoking_a_parked_task_takes_it_out_of_the_queue(shared: Cluster) -> None:
    c = shared
    _holding(c, "rv", "rv-h")
    doomed = _parked(c, "dwrite", "rv", "rv-doomed")
    parked = float(doomed.info["parked_at"])
    assert len(_queue(c, "res:rv")) == 1
    c.producer.control.revoke(doomed.id)
    # Withdrawn by an upkeep that read the revoke, not by its first re-attempt.
    wait_for(lambda: not _queue(c, "res:rv"), _by(parked), "left the queue", on_timeout=c.report)
    wait_for(lambda: doomed.state == "REVOKED", 30, "REVOKED", on_timeout=c.report)
    assert "revoked" in str(doomed.result), repr(doomed.result)
    signal_key = f"e2e:revoked-signal:{doomed.id}"
    wait_for(lambda: c.data.llen(signal_key), 30, "task_revoked", on_timeout=c.report)
    assert [json.loads(x) for x in c.data.lrange(signal_key, 0, -1)] == [{"expired": False}]
    assert not c.lock_redis.exists(c.key("defer", doomed.id))
    c.go("rv-h")
    after = c.send("dwrite", "rv", "rv-after")
    after.get(timeout=60)
    assert _runs(c, "rv-after") == 1  # the counter is read where the task writes it
    assert _runs(c, "rv-doomed") == 0
    assert c.data.lrange("e2e:order:rv", 0, -1) == ["rv-h", "rv-after"]


def _redeliver(c: Cluster, payload: bytes) -> None:
    """Put a task message back on the shared queue as kombu's Redis transport
    does for a message whose worker died before the ack (``redelivered``)."""
    msg = json.loads(payload)
    msg["headers"]["redelivered"] = True
    info = msg["properties"]["delivery_info"]
    info.update({"redelivered": True, "routing_key": c.queue, "exchange": ""})
    c.data.lpush(c.queue, json.dumps(msg))


def test_a_redelivered_copy_of_a_task_that_parked_and_ran_is_dropped_not_run_again(
    shared: Cluster,
) -> None:
    """D2: the broker gives back a message that parked (its worker died before
    the ack) after the parked task ran; the lock is free, yet the copy must not
    run the task again: the park record (done) says it ran."""
    c = shared
    _holding(c, "rd", "rd-h")
    task = _parked(c, "dwrite", "rd", "rd-1")
    # The message as the broker held it: the same task id sent to a queue no
    # worker consumes, taken off it raw.
    c.producer.send_task("e2e.dwrite", args=("rd", "rd-1"), task_id=task.id, queue="rd-capture")
    payload = wait_for(lambda: c.data.rpop("rd-capture"), 30, "the captured message")
    c.go("rd-h")
    assert task.get(timeout=60)
    record = c.key("defer", task.id)
    wait_for(lambda: c.lock_redis.hget(record, "state") == "done", 30, "record done")
    assert _runs(c, "rd-1") == 1
    _redeliver(c, payload)
    # The lock is free: a copy that tries it first runs the task again; one
    # that asks the park record is dropped as a duplicate of the done task.
    worker = c.processes[0]

    def handled() -> bool:
        dropped = worker.log_lines("defer.duplicate", task.id)
        return bool(dropped) or _runs(c, "rd-1") > 1

    wait_for(handled, 60, "the redelivered copy handled", on_timeout=c.report)
    assert _runs(c, "rd-1") == 1
    assert worker.log_lines("defer.redelivered", task.id)
    assert c.lock_redis.hget(record, "state") == "done"
    assert task.state == "SUCCESS"


def test_a_redelivered_copy_of_a_waiting_task_that_parked_in_its_place_and_ran_is_dropped(
    shared: Cluster,
) -> None:
    """T3 + D2: a waiting task (``on_busy="wait"``) that parked in its place
    behind a grant in transit is a deferred task from then on; its worker's
    main process killed before the ack of that delivery (``Ignore``), the
    broker gives the message back after the task ran from its grant. The
    lock is free, yet the copy must not run again: the park record (done)
    says it ran. Here the record is made by the engine's own steps."""
    from celery_redislock.worker.defer import adopt, mark_done, park

    c = shared
    task = c.producer.send_task("e2e.wwrite", args=("wr", "wr-1"), queue="wr-capture")
    payload = wait_for(lambda: c.data.rpop("wr-capture"), 30, "the captured message")
    mgr = LockManager(c.lock_url, c.namespace, heartbeat=False, eviction_check="ignore")
    try:
        message = {"name": "e2e.wwrite", "args": ["wr", "wr-1"], "kwargs": {}, "options": {}}
        message.update(resources=["res:wr"], modes="x", park_ttl=60, grant_ttl=60)
        parked = park(mgr, task.id, mgr.request(["res:wr"], []), message, park_ttl=60, grant_ttl=60)
        assert parked.outcome == "granted"
        _, leases = adopt(mgr, task.id, parked.life)
        leases[0].release()
        mark_done(mgr, task.id, leases[0].owner_id)
    finally:
        mgr.close()
    assert c.lock_redis.hget(c.key("defer", task.id), "state") == "done"
    _redeliver(c, payload)
    worker = c.processes[0]
    wait_for(
        lambda: worker.log_lines("defer.duplicate", task.id) or _runs(c, "wr-1"),
        60,
        "the redelivered copy handled",
        on_timeout=c.report,
    )
    assert _runs(c, "wr-1") == 0
    assert worker.log_lines("locked.wait-redelivered", task.id)


def test_a_redelivered_copy_meeting_an_adopter_not_yet_seen_dead_looks_again_and_runs_once(
    cluster: Callable[..., Cluster],
) -> None:
    """D13: a child SIGKILLed mid-body gives its message back at once
    (``task_reject_on_worker_lost``), before its liveness is gone: the
    redelivered copy finds the task ``adopted`` by an owner that still looks
    alive. Dropping it would lose the task; it is published again,
    record-first, due once a dead adopter's liveness ran out, and then runs
    once. The adopter here is an engine of this process that stops beating."""
    from celery_redislock.worker.defer import park

    c = cluster(owner_ttl=2, heartbeat=0.5)
    worker = c.start_worker("look-again", concurrency=2)
    task = c.producer.send_task("e2e.dwrite", args=("la", "la-1"), queue="la-capture")
    payload = wait_for(lambda: c.data.rpop("la-capture"), 30, "the captured message")
    adopter = LockManager(c.lock_url, c.namespace, owner_ttl=2, heartbeat=False)
    try:
        message = {"name": "e2e.dwrite", "args": ["la", "la-1"], "kwargs": {}, "options": {}}
        message.update(resources=["res:la"], modes="x", park_ttl=60, grant_ttl=60)
        req = adopter.request(["res:la"], [])
        parked = park(adopter, task.id, req, message, park_ttl=60, grant_ttl=60)
        assert parked.outcome == "granted" and parked.leases  # adopted: the body "runs"
        assert c.lock_redis.hget(c.key("defer", task.id), "state") == "adopted"
        _redeliver(c, payload)  # at once, the adopter's liveness still there
        task.get(timeout=60)
        assert _runs(c, "la-1") == 1
        assert worker.log_lines("defer.look-again", task.id)
    finally:
        adopter.close()


def test_a_redelivered_copy_finding_no_park_record_of_a_task_that_started_or_ran_is_dropped(
    cluster: Callable[..., Cluster],
) -> None:
    """D12 (stale copies): the lock Redis lost a deferred task's park record
    (here: deleted) and a redelivered copy of its message arrives. With no
    record the lock is free to take, yet the result backend says the task
    started (the adoption marker of a dispatched grant, its body running) or
    ran (SUCCESS): the copy is dropped (``defer.stale-copy``), never run."""
    c = cluster(owner_ttl=5, heartbeat=0.5, defer_guard=60)  # guards on, none due here
    worker = c.start_worker("stale-copy", concurrency=2)
    c.send("dhold", "sc", "sc-h")
    c.wait_held("sc-h")
    task = c.send("dhold", "sc", "sc-d")
    wait_for(lambda: _deferred(c, task), 60, "parked", on_timeout=c.report)
    c.producer.send_task("e2e.dhold", args=("sc", "sc-d"), task_id=task.id, queue="sc-capture")
    payload = wait_for(lambda: c.data.rpop("sc-capture"), 30, "the captured message")
    c.go("sc-h")
    c.wait_held("sc-d")  # adopted: its body runs
    record = c.key("defer", task.id)
    for copies, why in enumerate(("adopted", "SUCCESS"), start=1):
        c.lock_redis.delete(record)  # the lock Redis lost the record
        _redeliver(c, payload)
        wait_for(
            lambda n=copies: (
                len(worker.log_lines("defer.stale-copy", task.id)) == n
                or c.data.llen("e2e:held-log:sc-d") > 1
            ),
            60,
            f"the copy handled ({why})",
            on_timeout=c.report,
        )
        assert c.data.llen("e2e:held-log:sc-d") == 1  # not run again
        assert f"why={why}" in worker.log_lines("defer.stale-copy", task.id)[-1]
        if why == "adopted":
            c.go("sc-d")
            task.get(timeout=60)  # no record to mark done: none is left
    assert c.data.llen("e2e:held-log:sc-d") == 1  # the body ran once
    assert task.state == "SUCCESS"


def test_a_parked_task_whose_expires_passes_is_revoked_as_expired_and_one_granted_in_time_runs(
    shared: Cluster,
) -> None:
    c = shared
    holder = _holding(c, "ex", "ex-h")
    now = datetime.datetime.now(datetime.timezone.utc)
    doomed = c.producer.send_task(
        "e2e.dwrite",
        args=("ex", "ex-doomed"),
        queue=c.queue,
        expires=now + datetime.timedelta(seconds=3),
    )
    lasting = c.producer.send_task(
        "e2e.dwrite",
        args=("ex", "ex-lasting"),
        queue=c.queue,
        expires=now + datetime.timedelta(seconds=300),
    )
    wait_for(lambda: _deferred(c, doomed), 60, "doomed parked", on_timeout=c.report)
    wait_for(lambda: _deferred(c, lasting), 60, "lasting parked", on_timeout=c.report)
    # Its expires ends the park: REVOKED (expired), as for an expired message,
    # with Celery's task_revoked signal; not a LockTimeout failure.
    wait_for(lambda: doomed.state != "DEFERRED", 60, "doomed withdrawn", on_timeout=c.report)
    assert doomed.state == "REVOKED", (doomed.state, doomed.result)
    assert "expired" in str(doomed.result), repr(doomed.result)
    signal_key = f"e2e:revoked-signal:{doomed.id}"
    wait_for(lambda: c.data.llen(signal_key), 30, "task_revoked", on_timeout=c.report)
    assert [json.loads(x) for x in c.data.lrange(signal_key, 0, -1)] == [{"expired": True}]
    assert [m.split("|")[0][1:] for m in _queue(c, "res:ex")] == [f"defer:{lasting.id}"]
    # The other one's expires is far: it is handed the lock, re-published
    # with its expires, and runs.
    c.go("ex-h")
    holder.get(timeout=60)
    lasting.get(timeout=60)
    assert _runs(c, "ex-lasting") == 1 and _runs(c, "ex-doomed") == 0
    assert c.data.lrange("e2e:order:ex", 0, -1) == ["ex-h", "ex-lasting"]


def test_a_parked_task_that_times_out_fails_with_lock_timeout_and_calls_its_errbacks(
    shared: Cluster,
) -> None:
    c = shared
    holder = _holding(c, "to", "to-h")
    app = c.producer
    short = app.send_task(
        "e2e.dshort",
        args=("to", "to-d"),
        queue=c.queue,
        link_error=[app.signature("e2e.derrback"), app.signature("e2e.derrback_id")],
    )
    wait_for(lambda: _deferred(c, short), 60, "parked", on_timeout=c.report)
    wait_for(lambda: short.state != "DEFERRED", 60, "timed out", on_timeout=c.report)
    assert short.state == "FAILURE", (short.state, short.result)
    assert "LockTimeout" in repr(short.result) or type(short.result).__name__ == "LockTimeout"
    key = f"e2e:errback:{short.id}"
    wait_for(lambda: c.data.llen(key) == 2, 60, "both errbacks", on_timeout=c.report)
    calls = sorted((json.loads(x) for x in c.data.lrange(key, 0, -1)), key=lambda d: d["kind"])
    assert [d["kind"] for d in calls] == ["id", "request"]
    assert calls[1]["exc"] == "LockTimeout"
    assert not _queue(c, "res:to") and _runs(c, "to-d") == 0
    c.go("to-h")
    holder.get(timeout=60)


def test_a_child_killed_after_the_adopted_body_before_its_result_is_stored_runs_it_again(
    shared: Cluster,
) -> None:
    # D8: the park record is marked done only once Celery has stored the
    # result. A child killed between the body's end and the store leaves it
    # 'adopted' by a dead owner: the redelivered copy (acks_late,
    # task_reject_on_worker_lost) runs the task again, as for any acks_late
    # task, and it ends SUCCESS, never left DEFERRED.
    c = shared
    holder, d = _parked_behind(c, "dwrite", "bs")
    c.data.set(f"e2e:stop-before-store:{d.id}", "1")
    c.go("bs-h")
    holder.get(timeout=60)
    pid = int(wait_for(lambda: c.data.get(f"e2e:stopped:{d.id}"), 60, "the stop before the store"))
    wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().split()[2] == "T", 30, "SIGSTOP")
    # The adopted body ran and released its lock; its result is not stored.
    assert _runs(c, "bs-d") == 1 and d.state == "DEFERRED"
    assert c.lock_redis.hget(c.key("defer", d.id), "state") == "adopted"
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: d.state == "SUCCESS", 90, "the task to end SUCCESS", on_timeout=c.report)
    assert _runs(c, "bs-d") == 2  # at least once: the copy ran it again
    # Marked done by the second run once its result was stored.
    wait_for(lambda: c.lock_redis.hget(c.key("defer", d.id), "state") == "done", 30, "done")
    assert c.data.lrange("e2e:order:bs", 0, -1) == ["bs-h", "bs-d", "bs-d"]
    assert c.data.lrange("e2e:violations", 0, -1) == []


def test_a_parked_task_that_retries_runs_every_attempt_and_parks_again_while_busy(
    shared: Cluster,
) -> None:
    c = shared
    [worker] = [p for p in c.processes if getattr(p, "nodename", "").startswith("defer-shared@")]
    _holding(c, "rt", "rt-h")
    d = _parked(c, "dretry", "rt", "rt-d", retries=2, countdown=0.5, what="rt-d parked")
    behind = _parked(c, "dhold", "rt", "rt-w", what="rt-w parked")  # in line behind rt-d
    c.go("rt-h")
    # The first attempt runs and retries; its lock goes to rt-w when it ends,
    # so the retry finds the resource busy and parks again: a new life,
    # in line behind rt-w.
    wait_for(lambda: c.data.llen("e2e:held-log:rt-w"), 60, "rt-w runs", on_timeout=c.report)
    wait_for(
        lambda: [m.partition("|")[2] for m in _queue(c, "res:rt")] == [f"task:{d.id}"],
        60,
        "the retry parked again",
        on_timeout=c.report,
    )
    assert _queue(c, "res:rt") == [f"xdefer+1:{d.id}|task:{d.id}"]  # its second life
    # The park writes the DEFERRED state after it queued the request.
    wait_for(lambda: d.state == "DEFERRED", 30, "DEFERRED again", on_timeout=c.report)
    c.go("rt-w")
    behind.get(timeout=60)
    # The second retry runs too (the resource is free, or freed by then).
    assert d.get(timeout=60) == 2
    assert c.data.lrange("e2e:attempts-log:rt-d", 0, -1) == ["0", "1", "2"]
    assert _runs(c, "rt-d") == 3
    assert c.data.lrange("e2e:order:rt", 0, -1) == ["rt-h", "rt-d", "rt-w", "rt-d", "rt-d"]
    assert worker.log_lines("defer.duplicate", d.id) == []
    wait_for(lambda: not c.namespace_keys("lock"), 30, "locks released", on_timeout=c.report)


def test_a_parked_unique_task_keeps_its_key_runs_at_the_hand_off_and_frees_it_when_withdrawn(
    shared: Cluster, unique_defer: Any
) -> None:
    c, task = shared, unique_defer
    key = "unique:ud:u1"
    _holding(c, "ud", "ud-h")
    u = task.delay("ud", "u1")
    wait_for(lambda: _deferred(c, u), 60, "parked", on_timeout=c.report)
    # While parked the key stays with the message's task owner, whose
    # liveness now covers the park (redislock_defer_ttl, a day), not only
    # unique_ttl (an hour): a duplicate gets the parked task.
    assert list(c.lock_holders(key)) == [f"task:{u.id}|task:{u.id}"]
    assert c.alive_pttl(f"task:{u.id}") > 3_600_000
    assert task.delay("ud", "u1").id == u.id
    c.go("ud-h")
    # Handed the lock, it runs at once (its grant is not hidden by its key's
    # adoption), holding its key in the process that runs it.
    raw = wait_for(lambda: c.data.lindex("e2e:ud-log:u1", 0), 60, "u1 runs", on_timeout=c.report)
    info = json.loads(raw)
    [token] = c.lock_holders(key)
    assert token == info["key_token"] and token.endswith(f"|task:{u.id}")
    assert not token.startswith(("task:", "task+"))  # adopted by the running process
    assert task.delay("ud", "u1").id == u.id
    c.go("u1")
    assert u.get(timeout=60)["id"] == u.id
    wait_for(lambda: not c.lock_holders(key), 30, "the key after success", on_timeout=c.report)
    assert _runs(c, "u1") == 1

    # Revoked while parked: withdrawn, and its key is freed with it.
    _holding(c, "ud", "ud-h2", what="holder 2")
    v = task.delay("ud", "v1")
    wait_for(lambda: _deferred(c, v), 60, "v1 parked", on_timeout=c.report)
    assert list(c.lock_holders("unique:ud:v1")) == [f"task:{v.id}|task:{v.id}"]
    c.producer.control.revoke(v.id)
    wait_for(lambda: v.state == "REVOKED", 60, "REVOKED", on_timeout=c.report)
    wait_for(lambda: not c.lock_holders("unique:ud:v1"), 30, "the key freed", on_timeout=c.report)
    again = task.delay("ud", "v1")
    assert again.id != v.id
    c.go("ud-h2")
    wait_for(lambda: c.data.llen("e2e:ud-log:v1"), 60, "the new v1 runs", on_timeout=c.report)
    c.go("v1")
    again.get(timeout=60)
    assert _runs(c, "v1") == 1


def test_waiting_tasks_in_every_pool_slot_give_them_up_to_a_grant_in_transit(
    pair: Cluster,
) -> None:
    """-c 2: H holds; D parks; W1 (on_busy="wait") waits in the other slot;
    W2 (wait) is still in the broker. H ends: the lock is handed to D, whose
    message is published behind W2; the freed slot takes W2. Both slots
    would wait for D while D's message waits for a slot, until the grant
    TTL. A waiter parks in its place instead (which one is a matter of
    timing): D runs at once, then W1, then W2, and D's grant is never
    handed on unadopted."""
    c = pair
    h = _holding(c, "mix", "mix-h")
    d = _parked(c, "dwrite", "mix", "mix-d", what="D parked")
    w1 = c.send("wwrite", "mix", "mix-w1")
    wait_for(lambda: len(_queue(c, "res:mix")) == 2, 60, "W1 waits", on_timeout=c.report)
    w2 = c.send("wwrite", "mix", "mix-w2")
    # Both slots are taken (H, W1; prefetch 1 with acks_late): W2 stays in the broker.
    assert w2.state == "PENDING" and _runs(c, "mix-w2") == 0

    c.go("mix-h")
    results = (h, d, w1, w2)
    wait_for(
        lambda: all(r.state == "SUCCESS" for r in results),
        90,
        "all four SUCCESS",
        on_timeout=c.report,
    )
    assert c.data.lrange("e2e:order:mix", 0, -1) == ["mix-h", "mix-d", "mix-w1", "mix-w2"]
    assert [_runs(c, t) for t in ("mix-d", "mix-w1", "mix-w2")] == [1, 1, 1]
    [worker] = c.processes
    # D's grant was adopted in its first life: never freed unadopted and
    # parked again (which only the grant TTL does).
    assert not worker.log_lines("defer.regrant"), worker.tail()
    assert c.lock_redis.hget(c.key("defer", d.id), "life") == "0"
    # A slot was freed for D by parking a waiter, not by the grant TTL. Which
    # waiter parks depends on timing and both are correct: W2 meets the
    # grant in transit on arrival and parks, and D takes its slot (W1 may
    # then be served before it is ever nudged); or W1 is nudged first and
    # parks, its slot takes W2 and H's takes D. Whichever parked, at least
    # one did, or D's message would have waited for a slot until the grant
    # TTL (the regrant checks above).
    parked = [w for w in (w1, w2) if worker.log_lines("locked.wait-parked", w.id)]
    assert parked, worker.tail()
    # Marked done once its result is stored (task_postrun, just after).
    wait_for(
        lambda: c.lock_redis.hget(c.key("defer", w1.id), "state") == "done",
        30,
        "W1's record done",
        on_timeout=c.report,
    )
    assert c.data.lrange("e2e:violations", 0, -1) == []
    wait_for(lambda: not c.namespace_keys("lock"), 30, "locks released", on_timeout=c.report)
    assert c.lock_redis.zcard(c.key("deferred")) == 0


def test_parked_task_outlives_its_sigkilled_worker_and_runs_once_on_another(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(owner_ttl=2, heartbeat=0.5)
    w1 = c.start_worker("park-w1", concurrency=2)
    c.send("hold", "pk", "pk-h")
    c.wait_held("pk-h")
    parked = _parked(c, "dwrite", "pk", "pk-d")
    w1.kill_group(signal.SIGKILL)
    w1.wait(30)
    # The holder died with the worker; the parked request does not depend on it.
    c.start_worker("park-w2", concurrency=2)
    parked.get(timeout=90)
    assert _runs(c, "pk-d") == 1
    assert c.data.lrange("e2e:order:pk", 0, -1) == ["pk-d"]


def _upkeeps(c: Cluster, count: int) -> None:
    """Wait until the dispatcher's upkeep ran ``count`` times from now: each
    run refreshes its liveness key (its PTTL goes up)."""
    [key] = c.namespace_keys("dispatcher")
    seen = {"n": 0, "last": int(c.lock_redis.pttl(key))}

    def ran() -> bool:
        now = int(c.lock_redis.pttl(key))
        if now > seen["last"]:
            seen["n"] += 1
        seen["last"] = now
        return seen["n"] >= count

    wait_for(ran, 60, f"{count} upkeeps", interval=0.01, on_timeout=c.report)


def test_an_adopting_child_stalled_past_the_grant_deadline_runs_the_task_once(
    cluster: Callable[..., Cluster],
) -> None:
    # D8: the adopting child stalls (SIGSTOP) right after its adoption until
    # the grant deadline has passed and the upkeep has looked at the task;
    # shorter than the owner TTL, so the child keeps its lease.
    grant_ttl = 3
    c = cluster(owner_ttl=15, heartbeat=0.5, defer_grant_ttl=grant_ttl)
    w = c.start_worker("stall-w", concurrency=2)
    _, stalled = _parked_behind(c, "dwrite", "ts")
    c.data.set(f"e2e:stall-after-adopt:{stalled.id}", "1")
    c.go("ts-h")
    pid = int(wait_for(lambda: c.data.get(f"e2e:stalled:{stalled.id}"), 60, "the stall"))
    wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().split()[2] == "T", 30, "SIGSTOP")
    # The hand-off came before the stall: its deadline is within grant_ttl.
    deadline = redis_ms(c) + grant_ttl * 1000
    wait_for(lambda: redis_ms(c) > deadline, grant_ttl + 30, "the grant deadline")
    _upkeeps(c, 2)  # the first one after the deadline has handled its due ids
    record = c.lock_redis.hgetall(c.key("defer", stalled.id))
    assert (record.get("state"), record.get("life")) == ("adopted", "0"), record
    assert _queue(c, "res:ts") == []  # not parked again behind its own grant
    os.kill(pid, signal.SIGCONT)
    stalled.get(timeout=60)
    wait_for(lambda: not c.namespace_keys("lock"), 30, "locks released", on_timeout=c.report)
    key = c.key("defer", stalled.id)
    wait_for(lambda: c.lock_redis.hget(key, "state") == "done", 30, "the record done")
    assert c.lock_redis.zscore(c.key("deferred"), stalled.id) is None
    assert _queue(c, "res:ts") == [] and _runs(c, "ts-d") == 1
    assert not w.log_lines("defer.regrant", stalled.id), w.tail()


def test_grant_in_transit_survives_a_sigkilled_adopting_child_or_worker_and_runs_once(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    c = cluster(owner_ttl=2, heartbeat=0.5, defer_grant_ttl=4)
    w1 = c.start_worker("transit-w1", concurrency=2)

    # D7: the child that receives the re-dispatched task dies before adopting.
    _, child_victim = _parked_behind(c, "dwrite", "tc")
    c.data.set(f"e2e:kill-before-adopt:{child_victim.id}", "child")
    c.go("tc-h")
    child_victim.get(timeout=90)
    assert not c.data.exists(f"e2e:kill-before-adopt:{child_victim.id}"), "the hook never fired"
    assert _runs(c, "tc-d") == 1

    # D6: the whole worker dies while the grant is in transit.
    _, worker_victim = _parked_behind(c, "dwrite", "tw")
    c.data.set(f"e2e:kill-before-adopt:{worker_victim.id}", "worker")
    c.go("tw-h")
    w1.wait(60)  # the hook killed the worker's process group
    assert not c.data.exists(f"e2e:kill-before-adopt:{worker_victim.id}")
    w2 = c.start_worker("transit-w2", concurrency=2)
    worker_victim.get(timeout=90)
    assert w2.log_lines("defer.regrant", worker_victim.id), w2.tail()
    assert _runs(c, "tw-d") == 1
    assert c.data.lrange("e2e:order:tw", 0, -1) == ["tw-h", "tw-d"]
    assert w1.log_lines("defer.dispatch", worker_victim.id)


@pytest.mark.parametrize("pool", ["threads", "solo", "gevent"])
def test_other_pools_park_dispatch_and_adopt_deferred_tasks(
    cluster: Callable[..., Cluster], pool: str
) -> None:
    c = cluster(owner_ttl=SHARED_OWNER_TTL, heartbeat=0.5)
    c.start_worker(f"defer-{pool}", pool=pool, concurrency=2)
    holder = LockManager(c.lock_url, c.namespace, owner_ttl=SHARED_OWNER_TTL)
    try:
        lease = holder.acquire("res:p", timeout=5)
        parked, since = [], []
        for i in range(2):  # one after the other: their order in line is known
            parked.append(c.send("dwrite", "p", f"{pool}-{i}"))
            wait_for(lambda: _deferred(c, parked[-1]), 60, "parked", on_timeout=c.report)
            since.append(float(parked[-1].info["parked_at"]))
        # A waiting task behind them holds a slot (solo: the only one); once
        # the first grant is in transit it gives the slot up and parks.
        waiting = c.send("wwrite", "p", f"{pool}-w")
        wait_for(lambda: len(_queue(c, "res:p")) == 3, 60, "waiting", on_timeout=c.report)
        lease.release()
        # Dispatched by push (the release's hand-off), not by a re-attempt.
        for r, at in zip(parked, since):
            r.get(timeout=_by(at))
        waiting.get(timeout=60)
    finally:
        holder.close()
    assert c.data.lrange("e2e:order:p", 0, -1) == [f"{pool}-0", f"{pool}-1", f"{pool}-w"]
    assert [_runs(c, f"{pool}-{t}") for t in ("0", "1", "w")] == [1, 1, 1]
