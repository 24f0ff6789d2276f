"""Fair, push-woken waiting across processes (invariant 9 of docs/design.md).

Each test pins one behaviour and says, in a comment, which naive
implementation it catches. Waiters run in forked processes (their own
LockManager, hence their own owner id) or in threads of the test process.
Every wait is on a condition in Redis (ZCARD of a queue, a log entry, a
client blocked in BLPOP), never a sleep. The only timing bounds are the ones
the design promises (a pushed wake-up is prompt; a dead holder or waiter costs
at most its liveness TTL), with wide margins: a re-check that is not pushed
would take ~30 s in these set-ups (no socket timeout, owner_ttl 30 s).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_redislock import LockManager, LockTimeout
from fairness_helpers import (
    NS,
    PREFIX,
    Procs,
    ThreadWaiter,
    blocked_in_blpop,
    child_waiter,
    client,
    entry_owner,
    entry_token,
    keys,
    log,
    logged,
    manager,
    owner_of_child,
    pid_of_owner,
    queue_entries,
    queue_len,
    wait_until,
)

# ---------------------------------------------------------------- fixtures


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.kill_all()


@pytest.fixture
def make(redis_url: str, closing: list[LockManager]):  # type: ignore[no-untyped-def]
    """make(owner_ttl=30.0) -> a LockManager (no socket timeout), closed after the test."""

    def _make(owner_ttl: float = 30.0) -> LockManager:
        m = manager(redis_url, owner_ttl=owner_ttl)
        closing.append(m)
        return m

    return _make


def _lock_holders(rs: redis.Redis, resource: str) -> dict[str, str]:
    """{holder token: mode} (the stored value is the mode, then the fence)."""
    return {t: v[:1] for t, v in rs.hgetall(f"{PREFIX}lock:{resource}").items()}


# ------------------------------------------------------- identity per process


def test_forked_children_get_owner_ids_distinct_from_each_other_and_the_parent(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: an owner id made once (at import or first use) and cached
    # without a pid check is inherited by every fork, so the parent and all
    # its children register as one contender (the defect fairness.md describes).
    mgr = make()
    with mgr.lock("parent-used-it-first"):
        parent_id = mgr.owner_id

    def child(i: int) -> None:
        c = client(redis_url)
        c.rpush("ids", mgr.owner_id)  # the manager object inherited from the parent
        with mgr.lock(f"child-{i}"):
            c.rpush("pids", os.getpid())

    kids = [procs.start(child, i) for i in range(2)]
    for k in kids:
        procs.join_ok(k)
    ids = rs.lrange("ids", 0, -1)
    assert len(set(ids)) == 2 and parent_id not in ids
    assert sorted(pid_of_owner(i) for i in ids) == sorted(int(p) for p in rs.lrange("pids", 0, -1))
    # Three distinct owners registered their liveness in Redis.
    assert len(keys(rs, "alive")) == 3
    assert mgr.owner_id == parent_id  # the parent keeps its own


# ------------------------------------------------------------ contenders()


def test_contenders_counts_every_waiting_request_from_processes_and_threads(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive (incident 3): waiters register one member per owner (or one
    # inherited member for all forks), so a second registration changes
    # nothing and the holder counts 1, and threads of the holder's own
    # process are not counted at all (same owner as the lease).
    holder = make()
    lease = holder.acquire("R")
    assert lease.contenders() == 0

    kids = [procs.start(child_waiter, redis_url, f"p{i}", "R") for i in range(2)]
    wait_until(lambda: queue_len(rs, "R") == 2, what="two processes queued")
    assert lease.contenders() == 2

    # Two threads of one other process (one owner, two requests).
    def two_threads() -> None:
        m = manager(redis_url)
        ts = [ThreadWaiter(m, "R", name=f"t{i}") for i in range(2)]
        for t in ts:
            t.join(60)
            assert t.error is None, t.error

    kids.append(procs.start(two_threads))
    wait_until(lambda: queue_len(rs, "R") == 4, what="two threads of another process queued")
    assert lease.contenders() == 4

    # Two threads of the holder's own process, even using the holder's manager.
    local = [ThreadWaiter(holder, "R", name=f"own{i}") for i in range(2)]
    wait_until(lambda: queue_len(rs, "R") == 6, what="two threads of the holder's process")
    assert lease.contenders() == 6
    owners = {entry_owner(m) for m in queue_entries(rs, "R")}
    assert len(owners) == 4  # 2 processes + 1 two-thread process + the holder's own

    lease.release()
    for k in kids:
        procs.join_ok(k)
    for t in local:
        t.join()
        assert t.error is None
    assert queue_len(rs, "R") == 0


def test_contenders_never_counts_the_lease_itself_and_counts_a_request_once(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: the lease's own queue entry (it waited before being granted)
    # stays or is counted; a request waiting for two of the lease's
    # resources counts twice.
    first = make()
    second = make()
    blocker = first.acquire(["A", "B"])
    waited = ThreadWaiter(second, ["A", "B"], release=False)
    wait_until(lambda: queue_len(rs, "A") == 1)
    blocker.release()
    assert waited.granted.wait(20)
    lease = waited.lease
    assert lease.contenders() == 0
    kid = procs.start(child_waiter, redis_url, "both", ["A", "B"])
    wait_until(lambda: queue_len(rs, "A") == 1 and queue_len(rs, "B") == 1)
    assert lease.contenders() == 1
    lease.release()
    procs.join_ok(kid)


# ------------------------------------------------ one waiter leaving, others stay


def test_one_thread_leaving_keeps_the_other_threads_of_its_process_queued(
    rs: redis.Redis, make
) -> None:
    # Naive: one queue entry per process (member = owner id). The first
    # thread to time out or be cancelled removes the process's only entry,
    # so the other threads of that process lose their place (incident 3's
    # second fault) and are never woken by the release.
    holder = make()
    waiters = make()  # one owner, several waiting threads
    lease = holder.acquire("R")

    cancel = threading.Event()
    real_block = waiters.acquirer.block

    def block(token: str, seconds: float) -> None:
        # Thread "cancelled" stops listening and is interrupted on demand,
        # as a signal (soft time limit, KeyboardInterrupt) would do.
        if threading.current_thread().name == "cancelled":
            if cancel.wait(seconds):
                raise KeyboardInterrupt
            return
        real_block(token, seconds)

    waiters.acquirer.block = block  # type: ignore[method-assign]

    cancelled = ThreadWaiter(waiters, "R", name="cancelled", rs=rs)
    wait_until(lambda: queue_len(rs, "R") == 1)
    stays = ThreadWaiter(waiters, "R", name="stays", rs=rs)
    wait_until(lambda: queue_len(rs, "R") == 2)
    times_out = ThreadWaiter(waiters, "R", name="times-out", timeout=1.0, rs=rs)
    times_out.join()
    assert isinstance(times_out.error, LockTimeout)
    cancel.set()
    cancelled.join()
    assert isinstance(cancelled.error, KeyboardInterrupt)

    left = queue_entries(rs, "R")
    assert len(left) == 1
    assert entry_owner(left[0]) == waiters.owner_id
    assert rs.hget(f"{PREFIX}req:{entry_token(left[0])}", "state") == "q"
    assert not stays.done.is_set()

    lease.release()
    stays.join()
    assert stays.error is None
    assert log(rs) == ["stays"]
    assert queue_len(rs, "R") == 0


def test_one_process_leaving_keeps_the_other_processes_queued(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: a leaving waiter clears a shared member or the whole queue
    # (e.g. DEL of a waiters key), so the others are forgotten; or the head
    # leaves without waking the next one and the queue stalls.
    holder = make()
    lease = holder.acquire("R")
    head = procs.start(child_waiter, redis_url, "head", "R")
    wait_until(lambda: queue_len(rs, "R") == 1)
    stays = procs.start(child_waiter, redis_url, "stays", "R")
    wait_until(lambda: queue_len(rs, "R") == 2)
    stays_owner = owner_of_child(rs, "stays")
    procs.start(child_waiter, redis_url, "gives-up", "R", timeout=1.0)
    wait_until(lambda: logged(rs, "gives-up:timeout"), what="third waiter timed out")

    os.kill(head.pid, signal.SIGINT)  # KeyboardInterrupt while blocked in BLPOP
    wait_until(lambda: logged(rs, "head:interrupted"), what="head waiter interrupted")
    procs.join_ok(head)

    left = queue_entries(rs, "R")
    assert [entry_owner(m) for m in left] == [stays_owner]
    lease.release()
    procs.join_ok(stays)
    assert [e for e in log(rs) if not e.startswith("owner:")] == [
        "gives-up:timeout",
        "head:interrupted",
        "stays",
        "stays:releasing",
        "stays:released",
    ]


# ------------------------------------------------------- cancelled waiters


def _interrupt_attempt_after(mgr: LockManager, code: int) -> None:
    """Make ``mgr``'s acquire attempts raise KeyboardInterrupt once their
    script answered ``code`` (0: queued, 1: granted): an interrupt landing
    after the script committed, before the caller saw its reply."""
    real_attempt = mgr.acquirer.attempt

    def attempt(*args, **kwargs):  # type: ignore[no-untyped-def]
        reply = real_attempt(*args, **kwargs)
        if int(reply[0]) == code:
            raise KeyboardInterrupt
        return reply

    mgr.acquirer.attempt = attempt  # type: ignore[method-assign]


def _assert_no_request_state(rs: redis.Redis, owner: str) -> None:
    """No queue entry at all, and no request state or wake list of ``owner``."""
    assert keys(rs, "q") == []
    assert [k for k in keys(rs, "req") if f":{owner}|" in k] == []
    assert [k for k in keys(rs, "wake") if f":{owner}|" in k] == []


def test_waiter_interrupted_right_after_its_script_queued_it_leaves_no_entry(
    rs: redis.Redis, make
) -> None:
    # Naive: the client dequeues only what it knows it queued. An interrupt
    # that lands after the script committed the queue entries but before the
    # reply is read strands an entry that blocks every later request.
    holder = make()
    lease = holder.acquire("R")
    waiter = make()
    _interrupt_attempt_after(waiter, 0)  # the script has queued the request
    with pytest.raises(KeyboardInterrupt):
        waiter.acquire("R", shared=["S"], timeout=30)
    _assert_no_request_state(rs, waiter.owner_id)
    assert _lock_holders(rs, "S") == {}
    lease.release()
    # The resource is not blocked by anything left behind.
    with make().lock(["R", "S"], timeout=0):
        pass


def test_waiter_thread_interrupted_while_blocked_leaves_no_entry(rs: redis.Redis, make) -> None:
    # Naive: a waiter interrupted inside its blocking wait (an async
    # exception: KeyboardInterrupt, a gevent kill, a soft time limit) exits
    # without running the dequeue, leaving its entries at the head.
    holder = make()
    lease = holder.acquire("R")
    w = ThreadWaiter(make(), ["R", "S"], name="interrupted")
    wait_until(lambda: queue_len(rs, "R") == 1 and blocked_in_blpop(rs))
    token = entry_token(queue_entries(rs, "R")[0])
    tid = w.thread.ident
    assert tid is not None
    hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(tid), ctypes.py_object(KeyboardInterrupt)
    )
    assert hit == 1
    rs.lpush(f"{PREFIX}wake:{token}", "1")  # return from BLPOP so the exception lands
    w.join()
    assert isinstance(w.error, KeyboardInterrupt)
    _assert_no_request_state(rs, w.mgr.owner_id)
    lease.release()


# ------------------------------------------------------------------- FIFO


def test_grants_follow_arrival_order_across_eight_staggered_processes(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: every waiter wakes on release and races (thundering herd), or
    # waiters poll on their own timers: grants then follow scheduling luck,
    # not arrival order.
    holder = make()
    lease = holder.acquire("R")
    kids = []
    for i in range(8):
        kids.append(procs.start(child_waiter, redis_url, f"w{i}", "R"))
        wait_until(lambda i=i: queue_len(rs, "R") == i + 1, what=f"w{i} queued")
    lease.release()
    for k in kids:
        procs.join_ok(k)
    grants = [e for e in log(rs) if e.startswith("w") and ":" not in e]
    assert grants == [f"w{i}" for i in range(8)]


def test_earlier_exclusive_waiter_is_not_overtaken_by_later_shared_requests(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: a shared request is granted whenever the holders are shared
    # (compatible), so a steady stream of readers starves a waiting writer.
    holder = make()
    lease = holder.acquire(shared="R")
    writer = procs.start(child_waiter, redis_url, "writer", "R")
    wait_until(lambda: queue_len(rs, "R") == 1)
    with pytest.raises(LockTimeout):
        make().acquire(shared="R", timeout=0)  # compatible with the holder, but behind the writer
    readers = []
    for i in range(2):
        readers.append(procs.start(child_waiter, redis_url, f"reader{i}", shared="R"))
        wait_until(lambda i=i: queue_len(rs, "R") == 2 + i)
    assert list(_lock_holders(rs, "R").values()) == ["s"]  # only the first holder
    lease.release()
    procs.join_ok(writer)
    for k in readers:
        procs.join_ok(k)
    # ':released' is logged after release() returns; with hand-off the next
    # holder may already be in, so order by what happens inside the lock.
    events = [e for e in log(rs) if not e.startswith("owner:") and not e.endswith(":released")]
    assert events[:2] == ["writer", "writer:releasing"]
    assert sorted(events[2:]) == sorted(
        ["reader0", "reader0:releasing", "reader1", "reader1:releasing"]
    )


def test_non_conflicting_requests_are_not_held_up_by_the_queue(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: a single global queue, or a per-resource queue that blocks
    # every later request regardless of modes, serialises unrelated work.
    holder = make()
    other = make()
    lease = holder.acquire(["R", "B"])
    # A shared request for S waits for B (held): it is queued on S and B.
    kid = procs.start(child_waiter, redis_url, "s-and-b", ["B"], shared=["S"])
    wait_until(lambda: queue_len(rs, "S") == 1 and queue_len(rs, "B") == 1)
    # A different resource proceeds at once.
    with other.lock("elsewhere", timeout=0):
        pass
    # Shared behind a queued shared request proceeds at once.
    with other.lock(shared="S", timeout=0):
        pass
    # A conflicting one (exclusive behind the queued shared) does not.
    with pytest.raises(LockTimeout):
        other.acquire("S", timeout=0)
    lease.release()
    procs.join_ok(kid)


# ------------------------------------------------------------ dead waiters


def test_dead_head_waiter_costs_at_most_its_liveness_ttl(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: the release wakes (or hands the lock to) the head entry only;
    # a SIGKILLed head never takes it, so the queue stalls for ever, or
    # until the next waiter's own timeout.
    holder = make()
    lease = holder.acquire("R")
    dead = procs.start(child_waiter, redis_url, "dead", "R", owner_ttl=1.0)
    wait_until(lambda: queue_len(rs, "R") == 1)
    nxt = procs.start(child_waiter, redis_url, "next", "R", owner_ttl=30.0)
    wait_until(lambda: queue_len(rs, "R") == 2)
    dead.kill()
    dead.join(10)
    t0 = time.monotonic()
    lease.release()
    wait_until(lambda: logged(rs, "next"), what="next waiter served")
    # The dead waiter's liveness (1 s) is all it may cost; a re-check on the
    # next waiter's own timer would take ~30 s.
    assert time.monotonic() - t0 < 6.0
    procs.join_ok(nxt)
    assert queue_len(rs, "R") == 0


def test_release_after_dead_waiters_liveness_is_gone_serves_the_next_at_once(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: the release script wakes the head entry without checking its
    # owner is alive. Here the dead head's liveness was removed by cleanup
    # (as a worker's child reaper does), so no timer of the next waiter is
    # due soon: only skipping dead entries at release serves it promptly.
    holder = make()
    lease = holder.acquire("R")
    dead = procs.start(child_waiter, redis_url, "dead", "R", owner_ttl=30.0)
    wait_until(lambda: queue_len(rs, "R") == 1)
    dead_owner = owner_of_child(rs, "dead")
    nxt = procs.start(child_waiter, redis_url, "next", "R", owner_ttl=30.0)
    wait_until(lambda: queue_len(rs, "R") == 2 and blocked_in_blpop(rs, 2))
    dead.kill()
    dead.join(10)
    holder.cleanup_owner(dead_owner, force=True)
    assert not rs.exists(f"{PREFIX}alive:{dead_owner}")
    t0 = time.monotonic()
    lease.release()
    wait_until(lambda: logged(rs, "next"), what="next waiter served")
    assert time.monotonic() - t0 < 5.0  # not the ~30 s of any timer
    procs.join_ok(nxt)
    assert queue_len(rs, "R") == 0


# ----------------------------------------------------------------- nested


def test_nested_acquire_does_not_deadlock_against_a_waiter_that_needs_both(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: the nested request queues like any other, behind the waiter
    # for A+B, which waits for A held by the nesting task: each waits for
    # the other (deadlock, broken only by a timeout).
    task1 = make()
    a = task1.acquire("A")
    task2 = procs.start(child_waiter, redis_url, "task2", ["A", "B"])
    wait_until(lambda: queue_len(rs, "A") == 1 and queue_len(rs, "B") == 1)
    # Another thread of task1's process is not nested: it queues behind task2.
    other_thread = ThreadWaiter(task1, "B", timeout=0)
    other_thread.join()
    assert isinstance(other_thread.error, LockTimeout)
    with pytest.raises(ValueError, match="finite"):
        task1.acquire("B", timeout=None)  # nested without a timeout
    b = task1.acquire("B", timeout=10)  # nested: waits only for holders
    b.release()
    a.release()
    procs.join_ok(task2)
    assert logged(rs, "task2")


# ------------------------------------------------------------ push wake-up


def test_waiter_behind_a_live_holder_is_woken_by_push_on_release(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: waiters re-check on a timer (sleep/poll, or BLPOP until their
    # liveness deadline): with owner_ttl 30 s and no socket timeout the next
    # re-check is ~30 s away, so only a pushed wake-up is prompt.
    holder = make(owner_ttl=30.0)
    lease = holder.acquire("R")
    kid = procs.start(child_waiter, redis_url, "waiter", "R", owner_ttl=30.0)
    wait_until(lambda: queue_len(rs, "R") == 1 and blocked_in_blpop(rs))
    t0 = time.monotonic()
    lease.release()
    wait_until(lambda: logged(rs, "waiter"), what="waiter granted")
    assert time.monotonic() - t0 < 5.0
    procs.join_ok(kid)


def test_holder_liveness_expiry_wakes_the_waiter_without_its_own_timeout(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: nothing fires when a liveness key expires; a waiter that only
    # wakes on its own timeout (python-redis-lock) or liveness period waits
    # ~30 s here. The acquire script returns the holder's remaining PTTL.
    holder = procs.start(child_waiter, redis_url, "holder", "R", owner_ttl=1.0, hold=True)
    wait_until(lambda: logged(rs, "holder"))
    waiter = ThreadWaiter(make(owner_ttl=30.0), "R", timeout=120, rs=rs)
    wait_until(lambda: queue_len(rs, "R") == 1)
    holder.kill()
    holder.join(10)
    t0 = time.monotonic()
    waiter.join(30)
    assert waiter.error is None
    assert time.monotonic() - t0 < 8.0  # the holder's 1 s liveness, not 30 s


def test_waiter_survives_waiting_longer_than_redis_py_default_socket_timeout(
    redis_url: str, rs: redis.Redis, closing: list[LockManager]
) -> None:
    # Naive: one BLPOP for the whole wait on a client built from a URL
    # (redis-py 8: 5 s socket timeout) dies with a TimeoutError after 5 s.
    # The wait below is the point of the test: it must outlast 5 s.
    holder = LockManager(redis_url, NS)
    waiter_mgr = LockManager(redis_url, NS)  # default owner_ttl 30, URL client
    closing.extend([holder, waiter_mgr])
    lease = holder.acquire("R")
    waiter = ThreadWaiter(waiter_mgr, "R", timeout=120)
    t0 = time.monotonic()
    wait_until(
        lambda: waiter.done.is_set() or time.monotonic() - t0 > 6.5,
        timeout=30,
        what="6.5 s of waiting",
    )
    assert waiter.error is None and not waiter.done.is_set()
    lease.release()
    waiter.join()
    assert waiter.error is None


# ------------------------------------------------------ wait_for_contender


def test_wait_for_contender_is_woken_when_another_process_starts_waiting(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: a holder that polls contenders() on a timer, or never learns
    # about a waiter from another process (registrations invisible).
    holder = make()
    lease = holder.acquire("R")
    result: list[tuple[bool, float]] = []

    def wait() -> None:
        ok = lease.wait_for_contender(60)
        result.append((ok, time.monotonic()))

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    wait_until(lambda: blocked_in_blpop(rs, command="xread"))
    kid = procs.start(child_waiter, redis_url, "contender", "R")
    wait_until(lambda: queue_len(rs, "R") == 1)
    t0 = time.monotonic()
    t.join(20)
    assert result and result[0][0] is True
    assert result[0][1] - t0 < 5.0  # pushed: not the 30 s cap of one BLPOP
    lease.release()
    procs.join_ok(kid)


def test_wait_for_contender_wakes_every_shared_holder_of_the_resource(
    rs: redis.Redis, make
) -> None:
    # Naive: one signal list per resource that the holders block on: a push
    # wakes one blocked reader only, and the other holders sleep on. (Before
    # that, a list per holder: every blocked attempt pushed to each of the N
    # holders' lists, O(N) per try.)
    holders = [make() for _ in range(3)]
    leases = [h.acquire(shared="R") for h in holders]
    woken: list[threading.Event] = []
    for lease in leases:
        event = threading.Event()
        woken.append(event)

        def wait(lease=lease, event=event) -> None:  # type: ignore[no-untyped-def]
            if lease.wait_for_contender(60):  # no timer within the test's deadline
                event.set()

        threading.Thread(target=wait, daemon=True).start()
    wait_until(lambda: blocked_in_blpop(rs, 3, command="xread"), what="holders blocked")
    writer = ThreadWaiter(make(), "R", release=True)

    for event in woken:
        assert event.wait(20), "a shared holder was not woken by the waiting writer"
    assert all(lease.contenders() == 1 for lease in leases)
    for lease in leases:
        lease.release()
    writer.join()
    assert writer.error is None


def test_a_contended_stream_exists_only_while_a_holder_waits_for_a_contender(
    rs: redis.Redis, make
) -> None:
    # Before: every request blocked by a live holder wrote the resource's
    # contended stream (about 4.7 KB: one stream node) for 90 s, watched or
    # not. Now it is written only while a holder waits in wait_for_contender.
    stream = f"{PREFIX}contended:R"
    holder = make()
    lease = holder.acquire("R")
    with pytest.raises(LockTimeout):
        make().acquire("R", timeout=0)  # blocked by a live holder nobody watches
    assert not rs.exists(stream)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(lease.wait_for_contender(60)), daemon=True)
    t.start()
    wait_until(lambda: blocked_in_blpop(rs, command="xread"), what="holder blocked")
    assert rs.type(stream) == "stream" and rs.pttl(stream) > 0  # expires if left
    writer = ThreadWaiter(make(), "R", release=True)
    t.join(20)
    assert result == [True]
    lease.release()  # no holder left: the stream goes with the grant
    writer.join()
    assert writer.error is None
    assert not rs.exists(stream)


def test_wait_for_contender_is_false_on_timeout_when_nobody_waits(rs: redis.Redis, make) -> None:
    # Naive: any signal ever pushed to the holder counts, so a request that
    # only tried (timeout=0) or already gave up still reads as a contender.
    holder = make()
    lease = holder.acquire("R")
    assert lease.wait_for_contender(0.2) is False
    with pytest.raises(LockTimeout):
        make().acquire("R", timeout=0)  # tried and left: nobody waits
    assert lease.contenders() == 0
    assert lease.wait_for_contender(0.3) is False
    lease.release()


# ---------------------------------------------- a grant meeting a give-up


def test_grant_landing_as_the_waiter_gives_up_is_released_not_leaked(
    redis_url: str, rs: redis.Redis, make, procs: Procs
) -> None:
    # Naive: the script grants the lock (its own attempt, or a release handing
    # it over) but the waiter is interrupted (soft time limit,
    # KeyboardInterrupt) before it sees the reply or the pushed grant; nothing
    # releases the grant and the resource stays locked until the owner dies.
    holder = make()
    lease = holder.acquire("R")
    quitter = make()
    real_block = quitter.acquirer.block

    def block(*args, **kwargs):  # type: ignore[no-untyped-def]
        fence = real_block(*args, **kwargs)
        if fence is not None:
            raise KeyboardInterrupt  # gives up as the handed-off grant arrives
        return fence

    _interrupt_attempt_after(quitter, 1)  # gives up as the grant arrives
    quitter.acquirer.block = block  # type: ignore[method-assign]
    gives_up = ThreadWaiter(quitter, "R")
    wait_until(lambda: queue_len(rs, "R") == 1)
    after = procs.start(child_waiter, redis_url, "after", "R")
    wait_until(lambda: queue_len(rs, "R") == 2)
    lease.release()
    gives_up.join()
    assert isinstance(gives_up.error, KeyboardInterrupt)
    procs.join_ok(after)  # served: the grant was passed on
    assert logged(rs, "after")
    assert _lock_holders(rs, "R") == {}
    assert rs.hgetall(f"{PREFIX}held:{quitter.owner_id}") == {}
    _assert_no_request_state(rs, quitter.owner_id)


def test_interrupt_after_a_local_grant_does_not_leave_the_thread_nested(
    rs: redis.Redis, make
) -> None:
    # Naive: the lease is counted as held by the thread before the method
    # returns; an interrupt there releases it in Redis but leaves the
    # thread's nesting count up, so every later acquire of that thread is
    # treated as nested: it skips the queue (unfair) and refuses timeout=None.
    mgr = make()
    acquire_log = logging.getLogger("celery_redislock.acquire")

    def interrupt(record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("acquire.granted"):
            raise KeyboardInterrupt
        return True

    old_level = acquire_log.level
    acquire_log.setLevel(logging.DEBUG)
    acquire_log.addFilter(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.acquire("R", timeout=5)
    finally:
        acquire_log.removeFilter(interrupt)
        acquire_log.setLevel(old_level)
    assert _lock_holders(rs, "R") == {}
    # Not nested: timeout=None is accepted and the request queues normally.
    with mgr.lock("R", timeout=None) as lease:
        assert lease.fencing_token > 0
    assert rs.keys(f"{PREFIX}lock:*") == []
