"""Limited resources (``limited={name: N}``): at most N holders, first come
first served with the requests ahead counted, crash-safe, refused when mixed
with the other kinds, and a cost that does not grow with the holders.

Real redis-server; real processes where a process must die.
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis

from celery_redislock import InvalidResource, Lease, LockManager, LockTimeout
from celery_redislock.protocol.request import MAX_LIMIT
from engine_helpers import (
    DEADLINE,
    Child,
    Managers,
    _guard,
    assert_registry_truth,
    counting,
    kinds,
    namespace_keys,
    wait_until,
)
from redis_server import RedisServer

#: Keeps count of the holders inside a limited section and of the most seen
#: at once (KEYS: current, peak). Not a lock key: a key of its own.
ENTER = """
local v = redis.call('INCR', KEYS[1])
local p = tonumber(redis.call('GET', KEYS[2]) or '0')
if v > p then redis.call('SET', KEYS[2], v) end
return v
"""

CUR, PEAK = "limited-test:cur", "limited-test:peak"


def _queue_len(r: redis.Redis, resource: str, namespace: str = "t") -> int:
    return int(r.zcard("{" + namespace + "}:q:" + resource))


def _leftovers(r: redis.Redis, namespace: str = "t") -> set[str]:
    """The kinds of key left in the namespace besides its counters."""
    return kinds(namespace_keys(r, namespace), namespace) - {"fence", "born", "format", "seq"}


def _queue(mgr: LockManager, nested: bool = False, **request: Any) -> str:
    """One acquire.lua run of ``mgr``'s owner that queues the request: a
    waiter that never runs its script again by itself, so what a release
    hands it (or the wake-up it pushes) stays there to read. Its token."""
    ident = mgr.liveness.identity.current()
    req = mgr.request(request.get("exclusive"), request.get("shared"), request.get("limited"))
    token = f"{ident.owner_id}|{uuid.uuid4().hex}"
    reply = mgr.acquirer.attempt(ident, token, req, True, nested)
    assert int(reply[0]) == 0, reply
    ident.registered = True
    return token


def _holders(r: redis.Redis, resource: str) -> set[str]:
    """The tokens holding ``resource``."""
    return {k.decode() for k in r.hkeys("{t}:lock:" + resource)}


def _wakes(r: redis.Redis, token: str) -> list[str]:
    """What releases pushed to the request's wake list ('g<fence>': a hand-off)."""
    return [v.decode() for v in r.lrange("{t}:wake:" + token, 0, -1)]


# -- validation, before any Redis call ---------------------------------------


@pytest.mark.parametrize(
    "limited",
    [
        {"api": 0},
        {"api": -1},
        {"api": MAX_LIMIT + 1},
        {"api": 1.5},
        {"api": True},
        {"api": "3"},
        {"api": None},
        ["api"],
        "api",
        {"bad\nname": 2},
    ],
)
def test_a_bad_limit_or_shape_is_refused_before_any_redis_call(limited: Any) -> None:
    # Port 1 answers nobody: an error from Redis would be RedisUnavailable.
    mgr = LockManager("redis://127.0.0.1:1/0", namespace="t")
    try:
        with pytest.raises(InvalidResource):
            mgr.acquire(limited=limited, timeout=0)
    finally:
        mgr.close()


def test_a_name_both_limited_and_exclusive_or_shared_in_one_request_is_refused() -> None:
    mgr = LockManager("redis://127.0.0.1:1/0", namespace="t")
    try:
        with pytest.raises(InvalidResource, match="both exclusive and limited"):
            mgr.acquire(exclusive="api", limited={"api": 2}, timeout=0)
        with pytest.raises(InvalidResource, match="both shared and limited"):
            mgr.acquire(shared=["x", "api"], limited={"api": 2}, timeout=0)
    finally:
        mgr.close()


def test_the_highest_limit_is_accepted(managers: Managers) -> None:
    mgr = managers()
    with mgr.lock(limited={"api": MAX_LIMIT}, timeout=0) as lease:
        assert lease.limited == {"api": MAX_LIMIT}
        assert lease.resources == ("api",)


# -- at most N ---------------------------------------------------------------


def test_n_requests_hold_at_once_and_the_next_is_refused(
    managers: Managers, r: redis.Redis
) -> None:
    leases = [managers().acquire(limited={"api": 3}, timeout=0, nested=False) for _ in range(3)]
    assert managers().try_acquire(limited={"api": 3}) is None
    holders = managers().holders("api")
    assert [(h.mode, h.limit) for h in holders] == [("limited", 3)] * 3
    leases[0].release()
    again = managers().try_acquire(limited={"api": 3})
    assert again is not None
    for lease in [*leases[1:], again]:
        lease.release()
    assert _leftovers(r) - {"alive", "owners"} == set()


def _hammer(conn: Connection, url: str, rounds: int, threads: int, limit: int) -> None:
    """A process whose threads each take a slot ``rounds`` times, counting
    the holders inside (ENTER), then report ``("done", grants)``."""

    def body() -> None:
        mgr = LockManager(url, namespace="t", owner_ttl=30.0)
        client = redis.Redis.from_url(url)
        enter = client.register_script(ENTER)
        grants: list[int] = []

        def loop() -> None:
            for _ in range(rounds):
                with mgr.lock(limited={"api": limit}, timeout=DEADLINE) as lease:
                    enter(keys=[CUR, PEAK])
                    grants.append(lease.fencing_token)
                    client.decr(CUR)

        workers = [threading.Thread(target=loop) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        conn.send(("done", len(grants)))
        mgr.close()

    _guard(conn, body)


def test_eight_processes_of_two_threads_never_hold_more_than_n(
    redis_url: str, r: redis.Redis
) -> None:
    r.delete(CUR, PEAK)
    children = [Child(_hammer, redis_url, 12, 2, 3) for _ in range(8)]
    try:
        done = [c.expect("done", timeout=120) for c in children]
    finally:
        for c in children:
            c.close()
    assert sum(d[1] for d in done) == 8 * 2 * 12
    assert int(r.get(PEAK) or 0) <= 3
    assert int(r.get(CUR) or 0) == 0
    assert _leftovers(r) - {"alive", "owners"} == set()
    r.delete(CUR, PEAK)


def test_n_threads_inside_at_once_is_reached(managers: Managers, r: redis.Redis) -> None:
    """The limit is not a lock in disguise: N holders are inside together."""
    mgr = managers()
    inside = threading.Barrier(3, timeout=DEADLINE)
    peak: list[int] = []
    enter = r.register_script(ENTER)
    r.delete(CUR, PEAK)

    def run() -> None:
        with mgr.lock(limited={"api": 3}, timeout=DEADLINE):
            enter(keys=[CUR, PEAK])
            inside.wait()  # all three hold their slot at this point
            peak.append(int(r.get(PEAK) or 0))
            r.decr(CUR)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == [3, 3, 3]
    r.delete(CUR, PEAK)


# -- first come, first served ------------------------------------------------


class _Waiter:
    """A thread that takes a slot, records its turn and holds until told."""

    def __init__(self, mgr: LockManager, index: int, order: list[int], **request: Any) -> None:
        self.index = index
        self.go = threading.Event()
        self.error: BaseException | None = None
        self.lease: Lease | None = None
        self.thread = threading.Thread(target=self._run, args=(mgr, order, request))
        self.thread.start()

    def _run(self, mgr: LockManager, order: list[int], request: dict[str, Any]) -> None:
        try:
            with mgr.lock(timeout=DEADLINE, **request) as lease:
                self.lease = lease
                order.append(self.index)
                self.go.wait(DEADLINE)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def finish(self) -> None:
        self.go.set()
        self.thread.join(DEADLINE)
        assert self.error is None, self.error


def test_waiters_for_a_slot_are_served_in_arrival_order_by_push(
    managers: Managers, r: redis.Redis
) -> None:
    # owner_ttl 30 s: a waiter re-runs its script by itself only after that,
    # so every grant below within the 20 s deadline came by hand-off.
    holders = [managers().acquire(limited={"api": 2}, timeout=0, nested=False) for _ in range(2)]
    mgr = managers()
    order: list[int] = []
    waiters = []
    for i in range(5):
        waiters.append(_Waiter(mgr, i, order, limited={"api": 2}))
        wait_until(lambda i=i: _queue_len(r, "api") == i + 1, what=f"waiter {i} queued")
    assert holders[0].contenders() == 5
    holders[0].release()
    wait_until(lambda: order == [0], what="first waiter served")
    holders[1].release()
    wait_until(lambda: order == [0, 1], what="second waiter served")
    for step, w in enumerate(waiters):
        w.finish()
        if step + 2 < len(waiters):
            wait_until(lambda n=step + 3: len(order) == n, what="next waiter served")
    assert order == [0, 1, 2, 3, 4]
    assert _leftovers(r) - {"alive", "owners"} == set()


def test_a_waiter_for_a_slot_and_an_exclusive_lock_keeps_its_place_on_both(
    managers: Managers, r: redis.Redis
) -> None:
    """W1 needs a slot of A (N = 2) and B, which H holds: it waits as one
    request. A later request may take A's other slot, but not W1's: a third
    one is refused while W1 waits, and B goes to W1 before a later exclusive
    waiter of B."""
    h = managers().acquire(exclusive="B", timeout=0)
    mgr = managers()
    order: list[int] = []
    w1 = _Waiter(mgr, 1, order, exclusive="B", limited={"A": 2})
    wait_until(lambda: _queue_len(r, "A") == 1 and _queue_len(r, "B") == 1, what="W1 queued")
    x = _Waiter(mgr, 9, order, exclusive="B")
    wait_until(lambda: _queue_len(r, "B") == 2, what="X queued behind W1")
    w2 = managers().try_acquire(limited={"A": 2})
    assert w2 is not None  # 0 holders + 1 ahead + itself = 2
    assert managers().try_acquire(limited={"A": 2}) is None  # W1's slot stays W1's
    h.release()
    wait_until(lambda: order == [1], what="W1 handed A and B")
    assert managers().try_acquire(limited={"A": 2}) is None  # W2 and W1 hold A
    w1.finish()
    wait_until(lambda: order == [1, 9], what="X handed B after W1")
    x.finish()
    w2.release()
    assert_registry_truth(r)
    assert _leftovers(r) - {"alive", "owners"} == set()


def test_a_fresh_request_does_not_pass_waiters_that_a_release_woke(
    managers: Managers, r: redis.Redis
) -> None:
    hold = managers().acquire(limited={"api": 1}, timeout=0)
    mgr = managers()
    order: list[int] = []
    w = _Waiter(mgr, 1, order, limited={"api": 1})
    wait_until(lambda: _queue_len(r, "api") == 1, what="waiter queued")
    hold.release()
    wait_until(lambda: order == [1], what="waiter handed the slot")
    assert managers().try_acquire(limited={"api": 1}) is None
    w.finish()


def test_a_waiter_granted_by_its_own_run_hands_no_slot_to_the_next(
    managers: Managers, r: redis.Redis
) -> None:
    """N = 2, held by a live owner and one whose liveness is gone. W1's
    own run frees the dead slot and takes it: the resource is full again,
    so W2 behind it is handed nothing (and gets the next slot freed)."""
    ghost = managers()
    _hold_slots(ghost, "api", 1, 2)
    live = managers().acquire(limited={"api": 2}, timeout=0, nested=False)
    m1 = managers()
    w1 = _queue(m1, limited={"api": 2})
    w2 = _queue(managers(), limited={"api": 2})
    r.delete("{t}:alive:" + ghost.liveness.identity.current().owner_id)
    ident = m1.liveness.identity.current()
    reply = m1.acquirer.attempt(ident, w1, m1.request(None, None, {"api": 2}), True, False)
    assert int(reply[0]) == 1, reply
    assert _holders(r, "api") == {live.token, w1}
    assert _wakes(r, w2) == [] and _queue_len(r, "api") == 1
    live.release()
    assert _holders(r, "api") == {w1, w2}


def test_a_hand_off_does_not_pass_a_waiter_of_a_smaller_limit(
    managers: Managers, r: redis.Redis
) -> None:
    """Two limits for one name (a rolling deploy): three hold it under N = 3;
    a waiter of N = 2, then one of N = 3. A release leaves 2 holders: the
    first waiter does not fit its own N, and the pass ends there, so the
    later waiter is not handed the slot past it."""
    leases = [managers().acquire(limited={"api": 3}, timeout=0, nested=False) for _ in range(3)]
    small = _queue(managers(), limited={"api": 2})
    large = _queue(managers(), limited={"api": 3})
    leases[0].release()
    assert _holders(r, "api") == {x.token for x in leases[1:]}
    assert _wakes(r, small) == [] and _wakes(r, large) == []
    leases[1].release()  # one holder left: the smaller limit fits now
    assert _holders(r, "api") == {leases[2].token, small}
    leases[2].release()


def test_slots_freed_together_are_handed_to_as_many_waiters(
    managers: Managers, r: redis.Redis
) -> None:
    """A dead owner held two of three slots: its cleanup hands both to the
    two first waiters in one pass, and the third waits on."""
    ghost = managers()
    _hold_slots(ghost, "api", 2, 3)
    live = managers().acquire(limited={"api": 3}, timeout=0, nested=False)
    w1, w2, w3 = (_queue(managers(), limited={"api": 3}) for _ in range(3))
    owner = ghost.liveness.identity.current().owner_id
    r.delete("{t}:alive:" + owner)
    report = managers().cleanup_owner(owner)
    assert report.status == "cleaned" and report.released == 2, report
    assert _holders(r, "api") == {live.token, w1, w2}
    assert _wakes(r, w1)[0].startswith("g") and _wakes(r, w2)[0].startswith("g")
    assert _wakes(r, w3) == []
    live.release()


def test_a_pass_past_the_scan_limit_wakes_the_next_waiter_to_carry_on(
    managers: Managers, r: redis.Redis
) -> None:
    """Ten slots freed at once, queue_scan_limit 2: the pass hands two
    waiters their slot and wakes the third, whose own run goes on."""
    ghost = managers()
    _hold_slots(ghost, "api", 10, 10)
    mgr = managers(queue_scan_limit=2)
    ws = [_queue(mgr, limited={"api": 10}) for _ in range(4)]
    owner = ghost.liveness.identity.current().owner_id
    r.delete("{t}:alive:" + owner)
    mgr.cleanup_owner(owner)
    assert _holders(r, "api") == set(ws[:2])
    assert _wakes(r, ws[2]) == ["1"] and _wakes(r, ws[3]) == []


def test_a_waiter_of_two_limited_resources_is_handed_each_by_its_own_limit(
    managers: Managers, r: redis.Redis
) -> None:
    """W asks for a slot of A (N = 5) and of B (N = 1), B held: another
    waiter of B leaving wakes B's queue, and W does not fit B's limit of 1
    (A's 5 is not B's)."""
    b = managers().acquire(limited={"B": 1}, timeout=0, nested=False)
    m = managers()
    x = _queue(m, limited={"B": 1})
    w = _queue(managers(), limited={"A": 5, "B": 1})
    m.releaser.run_release(x.split("|")[0], x, m.request(None, None, {"B": 1}))
    assert _holders(r, "B") == {b.token} and _holders(r, "A") == set()
    b.release()
    assert _holders(r, "B") == {w} and _holders(r, "A") == {w}


def test_a_hand_off_takes_no_slot_of_another_full_limited_resource(
    managers: Managers, r: redis.Redis
) -> None:
    """A nested waiter (it skips the queue's entries, not the holders) of a
    slot of A and of B, both full: A's release wakes it, and hands it
    nothing while B is full."""
    a = managers().acquire(limited={"A": 1}, timeout=0, nested=False)
    b = managers().acquire(limited={"B": 1}, timeout=0, nested=False)
    w = _queue(managers(), nested=True, limited={"A": 1, "B": 1})
    a.release()
    assert _holders(r, "B") == {b.token} and _holders(r, "A") == set()
    assert _wakes(r, w) == ["1"]
    b.release()
    assert _holders(r, "A") == {w} and _holders(r, "B") == {w}


def test_a_hand_off_takes_no_slot_an_earlier_waiter_of_another_resource_is_owed(
    managers: Managers, r: redis.Redis
) -> None:
    """V waits for a slot of B (N = 2, one held) and for C; W, later, for A
    and a slot of B. A's release may not hand W the slot of B that V, ahead
    of it there, is owed: V gets it once C is free."""
    c = managers().acquire(exclusive="C", timeout=0)
    a = managers().acquire(limited={"A": 1}, timeout=0, nested=False)
    b = managers().acquire(limited={"B": 2}, timeout=0, nested=False)
    v = _queue(managers(), exclusive="C", limited={"B": 2})
    _queue(managers(), limited={"A": 1, "B": 2})
    a.release()
    assert _holders(r, "B") == {b.token}
    c.release()
    assert _holders(r, "B") == {b.token, v}
    b.release()


def test_dead_entries_ahead_do_not_take_a_slot(managers: Managers, r: redis.Redis) -> None:
    """Entries of an owner whose liveness is gone count for nothing: the
    request behind them is granted and removes them."""
    hold = managers().acquire(limited={"api": 2}, timeout=0, nested=False)
    hold2 = managers().acquire(limited={"api": 2}, timeout=0, nested=False)
    ghost = managers()
    ident = ghost.liveness.identity.current()
    req = ghost.request(None, None, {"api": 2})
    for _ in range(3):
        token = f"{ident.owner_id}|{uuid.uuid4().hex}"
        reply = ghost.acquirer.attempt(ident, token, req, True, False)
        assert int(reply[0]) == 0, reply
        ident.registered = True
    assert _queue_len(r, "api") == 3
    r.delete("{t}:alive:" + ident.owner_id)  # the ghost died
    hold2.release()
    got = managers().try_acquire(limited={"api": 2})
    assert got is not None
    assert _queue_len(r, "api") == 0
    got.release()
    hold.release()


def test_dead_entries_ahead_blocked_elsewhere_do_not_take_a_slot(
    managers: Managers, r: redis.Redis
) -> None:
    """Entries that fit A but wait for B, whose owner then died: a new
    request for a slot of A is granted past them (and removes them)."""
    hold = managers().acquire(exclusive="B", timeout=0)
    ghost = managers()
    for _ in range(2):
        _queue(ghost, exclusive="B", limited={"api": 2})
    r.delete("{t}:alive:" + ghost.liveness.identity.current().owner_id)
    got = managers().try_acquire(limited={"api": 2})
    assert got is not None
    assert _queue_len(r, "api") == 0
    got.release()
    hold.release()


def test_two_limits_of_one_name_from_one_manager_keep_their_own(managers: Managers) -> None:
    mgr = managers()
    with mgr.lock(limited={"api": 2}, timeout=0) as two:
        assert two.limited == {"api": 2}
    with mgr.lock(limited={"api": 3}, timeout=0) as three:
        assert three.limited == {"api": 3}
        assert [h.limit for h in mgr.holders("api")] == [3]


# -- kinds do not mix --------------------------------------------------------


def test_a_limited_request_meeting_an_exclusive_holder_is_refused_by_name(
    managers: Managers,
) -> None:
    with managers().lock(exclusive="db", timeout=0):
        with pytest.raises(InvalidResource, match="'db' is held or waited for exclusive"):
            managers().acquire(limited={"db": 3}, timeout=DEADLINE)


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_an_exclusive_or_shared_request_meeting_limited_holders_is_refused(
    managers: Managers, r: redis.Redis, mode: str
) -> None:
    with managers().lock(limited={"api": 3}, timeout=0):
        with managers().lock(limited={"api": 3}, timeout=0, nested=False):
            with pytest.raises(InvalidResource, match="as a limited resource"):
                managers().acquire(timeout=DEADLINE, **{mode: "api"})
    assert _queue_len(r, "api") == 0


def test_a_request_meeting_a_queued_entry_of_the_other_kind_is_refused(
    managers: Managers, r: redis.Redis
) -> None:
    hold = managers().acquire(exclusive="B", timeout=0)
    order: list[int] = []
    w = _Waiter(managers(), 1, order, exclusive="B", limited={"A": 2})
    wait_until(lambda: _queue_len(r, "A") == 1, what="limited waiter queued on A")
    with pytest.raises(InvalidResource, match="'A' is held or waited for as a limited"):
        managers().acquire(exclusive="A", timeout=DEADLINE)
    hold.release()
    wait_until(lambda: order == [1], what="waiter served")
    w.finish()
    assert _leftovers(r) - {"alive", "owners"} == set()


def test_a_limited_request_meeting_a_queued_exclusive_entry_is_refused(
    managers: Managers, r: redis.Redis
) -> None:
    """W waits for A (free) and B (held) exclusive: a request for a slot
    of A meets W's entry, not a holder, and is refused by name."""
    hold = managers().acquire(exclusive="B", timeout=0)
    _queue(managers(), exclusive=["A", "B"])
    with pytest.raises(InvalidResource, match="'A' is held or waited for exclusive"):
        managers().acquire(limited={"A": 2}, timeout=DEADLINE)
    assert _queue_len(r, "A") == 1
    hold.release()


@pytest.mark.parametrize("kind", ["limited", "exclusive", "shared"])
def test_a_nested_request_meeting_a_queued_entry_of_the_other_kind_is_refused(
    managers: Managers, r: redis.Redis, kind: str
) -> None:
    """A nested request (its thread holds another lock) waits only for
    holders, yet a name is still taken in one kind. W waits for A (free)
    and B (held): a nested request of the other kind for A is refused, so
    A never has W's exclusive grant (or a slot) next to the other kind."""
    hold = managers().acquire(exclusive="B", timeout=0)
    w_kind = "exclusive" if kind == "limited" else "limited"
    w_request: dict[str, Any] = {"exclusive": "B"}
    w_request.update({"exclusive": ["A", "B"]} if w_kind == "exclusive" else {"limited": {"A": 2}})
    w = _queue(managers(), **w_request)
    request: dict[str, Any] = {"limited": {"A": 2}} if kind == "limited" else {kind: "A"}
    mgr = managers()
    with mgr.lock("C", timeout=0):
        with pytest.raises(InvalidResource, match=f"'A' is held or waited for .*{w_kind[:3]}"):
            mgr.acquire(timeout=1, **request)  # nested: the thread holds C
        assert _queue_len(r, "A") == 1
    hold.release()  # W is handed B, and A
    assert _holders(r, "A") == {w}
    assert _wakes(r, w)[0].startswith("g")
    assert_registry_truth(r)


def test_a_thread_holding_a_slot_re_enters_it_and_may_not_take_it_exclusive(
    managers: Managers,
) -> None:
    mgr = managers()
    with mgr.lock(limited={"api": 1}, timeout=0) as outer:
        with mgr.lock(limited={"api": 1}, timeout=0) as inner:
            assert inner.fencing_token == outer.fencing_token
        with pytest.raises(InvalidResource, match="held limited"):
            mgr.acquire(exclusive="api", timeout=1)


def test_a_nested_acquire_re_entering_a_slot_lists_every_resource_of_its_request(
    managers: Managers,
) -> None:
    mgr = managers()
    with mgr.lock(limited={"api": 2}, timeout=0) as outer:
        with mgr.lock("db", limited={"api": 2}, timeout=1) as inner:
            assert inner.exclusive == ("db",) and inner.limited == {"api": 2}
            assert inner.resources == ("db", "api")
            assert inner.fencing_token != outer.fencing_token


# -- crash safety ------------------------------------------------------------


def _slot_holder(conn: Connection, url: str, owner_ttl: float, limit: int) -> None:
    def body() -> None:
        mgr = LockManager(url, namespace="t", owner_ttl=owner_ttl)
        lease = mgr.acquire(limited={"api": limit}, timeout=DEADLINE)
        conn.send(("held", lease.owner_id))
        conn.recv()

    _guard(conn, body)


def test_a_killed_holders_slot_goes_to_the_next_waiter_once_its_liveness_ends(
    redis_url: str, managers: Managers, r: redis.Redis
) -> None:
    """The resource is full; one holder is SIGKILLed. The waiter (owner_ttl
    30 s of its own) is granted once the dead owner's liveness (1 s) runs
    out: its own script reclaims the slot, well before its own fallback."""
    children = [Child(_slot_holder, redis_url, 1.0, 3) for _ in range(3)]
    try:
        owners = [c.expect("held")[1] for c in children]
        assert managers().try_acquire(limited={"api": 3}) is None
        children[1].signal(signal.SIGKILL)
        children[1].proc.join(DEADLINE)
        lease = managers().acquire(limited={"api": 3}, timeout=DEADLINE)
        tokens = {h.owner_id for h in managers().holders("api")}
        assert owners[1] not in tokens and owners[0] in tokens and owners[2] in tokens
        lease.release()
    finally:
        for c in children:
            c.close()


def test_reconcile_frees_the_slots_of_dead_owners_and_leaves_nothing(
    redis_url: str, managers: Managers, r: redis.Redis
) -> None:
    children = [Child(_slot_holder, redis_url, 1.0, 5) for _ in range(2)]
    try:
        owners = [c.expect("held")[1] for c in children]
        for c in children:
            c.signal(signal.SIGKILL)
            c.proc.join(DEADLINE)
    finally:
        for c in children:
            c.close()
    wait_until(
        lambda: not any(r.exists("{t}:alive:" + o) for o in owners),
        what="the dead owners' liveness ran out",
    )
    report = managers().reconcile()
    cleaned = sorted(x.owner_id for x in report.reports if x.status == "cleaned")
    assert cleaned == sorted(owners) and report.released == 2, report
    assert not r.exists("{t}:lock:api")
    # The owners' tombstones and lost lists are all that is left: they expire.
    assert _leftovers(r) - {"alive", "dead", "lost"} == set()
    for key in namespace_keys(r):
        if key.startswith(("{t}:dead:", "{t}:lost:")):
            assert r.pttl(key) > 0, key


# -- cost ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cost_server(private_redis_server: RedisServer) -> RedisServer:
    """Commands are counted: a server no other module uses."""
    return private_redis_server


@pytest.fixture
def cost_managers(cost_server: RedisServer) -> Iterator[Managers]:
    made = Managers(cost_server.url, owner_ttl=120.0)
    yield made
    made.close_all()


def _hold_slots(mgr: LockManager, resource: str, count: int, limit: int) -> None:
    """``count`` grants of ``resource`` to ``mgr``'s owner, each its own token."""
    ident = mgr.liveness.identity.current()
    req = mgr.request(None, None, {resource: limit})
    for _ in range(count):
        reply = mgr.acquirer.attempt(
            ident, f"{ident.owner_id}|{uuid.uuid4().hex}", req, False, True
        )
        assert int(reply[0]) == 1, reply
        ident.registered = True


def _cycle_cost(cost_managers: Managers, resource: str, holders: int) -> dict[str, int]:
    client = redis.Redis.from_url(cost_managers.url)
    _hold_slots(cost_managers(), resource, holders, 1000)
    mgr = cost_managers()
    with mgr.lock(limited={"warm": 1000}, timeout=0):
        pass  # registers the owner and loads the scripts
    with counting(client) as delta:
        with mgr.lock(limited={resource: 1000}, timeout=0):
            pass
    client.close()
    return delta


def test_a_slot_costs_the_same_commands_with_3_holders_and_with_500(
    cost_managers: Managers,
) -> None:
    small = _cycle_cost(cost_managers, "few", 3)
    large = _cycle_cost(cost_managers, "many", 500)
    assert small == large, (small, large)
    assert "hscan" not in small and "hgetall" not in small


def test_a_waiter_for_a_slot_that_times_out_leaves_nothing_behind(
    managers: Managers, r: redis.Redis
) -> None:
    hold = managers().acquire(limited={"api": 1}, timeout=0)
    waiter = managers()
    with pytest.raises(LockTimeout):
        waiter.acquire(limited={"api": 1}, timeout=0.2)
    assert _queue_len(r, "api") == 0
    assert not [k for k in namespace_keys(r) if k.startswith(("{t}:req:", "{t}:wake:"))]
    assert not r.exists("{t}:waits:" + waiter.liveness.identity.current().owner_id)
    hold.release()
    assert not r.exists("{t}:lock:api")


def test_an_owner_refused_for_the_other_kind_is_registered_and_its_next_cycle_costs_as_usual(
    managers: Managers, r: redis.Redis
) -> None:
    """The refused call registered the owner (its liveness step runs first):
    the next acquire is a registered owner's, not a second registration."""
    from engine_helpers import command_delta, commandstats

    hold = managers().acquire(exclusive="db", timeout=0)
    mgr = managers()
    with pytest.raises(InvalidResource):
        mgr.acquire(limited={"db": 3}, timeout=DEADLINE)
    hold.release()
    before = commandstats(r)
    mgr.acquire(exclusive="other", timeout=0).release()
    delta = command_delta(before, commandstats(r))
    # A registered owner's cycle: the acquire's and the release's probes and
    # the fence's SET; a registration adds the tombstone's EXISTS and SET NX.
    assert (delta.get("exists"), delta.get("set")) == (2, 1), delta
