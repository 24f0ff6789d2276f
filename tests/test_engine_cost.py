"""Keys touched (invariant 6): cleanup, reconcile and a first acquire cost the
same number of Redis commands with 100 or 50,000 unrelated keys, and never
SCAN or KEYS.

Commands are counted with ``INFO commandstats``, which also counts the
commands a Lua script runs. The module uses a redis-server of its own, so
the heartbeats of managers from other test modules cannot add to the counts;
every manager here uses a long owner_ttl, so its heartbeat does not tick
while we count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_redislock import LockManager, LockTimeout
from engine_helpers import (
    Managers,
    acquire_as_task,
    command_delta,
    commandstats,
    counting,
    queue_requests,
    wait_until,
)
from redis_server import RedisServer

SMALL, LARGE = 100, 50_000
OWNER_TTL = 120.0  # first heartbeat after 40 s: none while counting


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


@pytest.fixture
def managers(redis_server: RedisServer, r: redis.Redis) -> Iterator[Managers]:
    made = Managers(redis_server.url)
    yield made
    made.close_all()


def populate(r: redis.Redis, count: int) -> None:
    """``count`` keys that are none of the owner's business, of several kinds.

    Most come from DEBUG POPULATE (fast); a few hundred look like another
    namespace's locks, registries and owners, in case someone matched keys by
    pattern instead of walking the registry.
    """
    lookalike = min(300, count // 2)
    pipe = r.pipeline(transaction=False)
    for i in range(lookalike // 3):
        pipe.hset(f"{{other}}:lock:r{i}", f"ghost-{i}|x", "x")
        pipe.hset(f"{{other}}:held:ghost-{i}", f"r{i}", "")
        pipe.sadd("{other}:owners", f"ghost-{i}")
    pipe.execute()
    rest = count - r.dbsize()
    if rest > 0:
        r.execute_command("DEBUG", "POPULATE", rest, "unrelated")
    assert r.dbsize() == count


def warm_up(managers: Managers) -> None:
    """Load every script into the server's cache, so neither scenario pays for it."""
    mgr = managers(owner_ttl=OWNER_TTL)
    with mgr.lock(exclusive=["warm"], timeout=0):
        pass
    mgr.cleanup_owner("nobody-0")
    mgr.reconcile()


def measure(
    r: redis.Redis, managers: Managers, keyspace: int, scenario: Callable[..., Any]
) -> dict[str, int]:
    """Commands run by ``scenario`` on an otherwise empty Redis plus ``keyspace`` keys."""
    r.flushall()
    warm_up(managers)
    r.flushall()
    populate(r, keyspace)
    run = scenario(r, managers)  # sets up, returns the operation to count
    with counting(r) as delta:
        run()
    return delta


def dead_owner_with_locks(r: redis.Redis, managers: Managers) -> tuple[LockManager, str]:
    """A dead owner holding three locks (one shared with a live owner), and a
    live manager with its connection open, ready to clean up."""
    dead = managers(owner_ttl=OWNER_TTL)
    live = managers(owner_ttl=OWNER_TTL)
    dead.acquire(exclusive=["a", "b"], shared=["c"], timeout=0)
    live.acquire(shared=["c"], timeout=0)
    dead.heartbeat.stop()  # it dies holding them (close() would release them)
    owner = dead.owner_id
    r.delete("{t}:alive:" + owner)  # what its liveness expiring does
    live.client.ping()  # connection already open, as in a running process
    return live, owner


def cleanup_scenario(r: redis.Redis, managers: Managers) -> Callable[[], Any]:
    live, owner = dead_owner_with_locks(r, managers)

    def run() -> None:
        report = live.cleanup_owner(owner)
        assert (report.status, report.released) == ("cleaned", 3)

    return run


def reconcile_scenario(r: redis.Redis, managers: Managers) -> Callable[[], Any]:
    live, _ = dead_owner_with_locks(r, managers)

    def run() -> None:
        report = live.reconcile()
        assert (report.owners_seen, report.cleaned, report.alive, report.released) == (2, 1, 1, 3)

    return run


def first_acquire_scenario(r: redis.Redis, managers: Managers) -> Callable[[], Any]:
    fresh = managers(owner_ttl=OWNER_TTL)
    fresh.client.ping()
    fresh.check_format()  # once per manager, before its first script (test_format.py)

    def run() -> None:
        lease = fresh.acquire(exclusive=["a", "b"], shared=["c"], timeout=0)
        assert lease.fencing_token > 0

    return run


SCENARIOS = {
    "cleanup_owner": cleanup_scenario,
    "reconcile": reconcile_scenario,
    "first_acquire": first_acquire_scenario,
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cost_is_the_same_with_100_or_50000_unrelated_keys_and_never_scans(
    r: redis.Redis, managers: Managers, name: str
) -> None:
    scenario = SCENARIOS[name]
    small = measure(r, managers, SMALL, scenario)
    large = measure(r, managers, LARGE, scenario)

    assert small == large, f"{name}: {small} vs {large}"
    for delta in (small, large):
        assert delta.get("scan", 0) == 0 and delta.get("keys", 0) == 0
        assert not {"dbsize", "randomkey"} & set(delta)
    # one round trip from the client: one EVALSHA (reconcile adds its SSCAN
    # of the owners set and one EXISTS per owner, pipelined)
    assert small.get("evalsha") == 1
    if name == "reconcile":
        assert small.get("sscan") == 1
    else:
        assert "sscan" not in small


#: Commands Redis runs for one uncontended acquire+release of a registered
#: owner (two EVALSHA, one round trip each), by resources per request. Each
#: one is accounted for in docs/design.md ("Redis cost"): acquire.lua runs
#: PEXPIRE (liveness), EXISTS (locks and queues: nobody holds or waits),
#: TIME + SET (fence), HSET per lock, one HSET (registry); release.lua runs
#: HDEL per lock, one HDEL (registry), one EXISTS (queues and contended
#: streams: nobody to serve).
UNCONTENDED_CYCLE = {
    1: {"evalsha": 2, "pexpire": 1, "exists": 2, "time": 1, "set": 1, "hset": 2, "hdel": 2},
    5: {"evalsha": 2, "pexpire": 1, "exists": 2, "time": 1, "set": 1, "hset": 6, "hdel": 6},
}


def uncontended_cycle_scenario(resources: int) -> Callable[..., Callable[[], Any]]:
    names = [f"r{i}" for i in range(resources)]

    def scenario(r: redis.Redis, managers: Managers) -> Callable[[], Any]:
        mgr = managers(owner_ttl=OWNER_TTL)
        with mgr.lock(names):  # registers the owner (and lists it in {ns}:owners)
            pass

        def run() -> None:
            with mgr.lock(names) as lease:
                assert lease.fencing_token > 0

        return run

    return scenario


def task_cycle_scenario(r: redis.Redis, managers: Managers) -> Callable[[], Any]:
    mgr = managers(owner_ttl=OWNER_TTL)
    with mgr.lock("r0"):  # registers the owner (and lists it in {ns}:owners)
        pass

    def run() -> None:
        info = "proj.sync\n0b7e4a2c-7b1e-4bd5-9f3e-6a1d0c2f9e41\ncelery@w1"
        acquire_as_task(mgr, info, "r0", timeout=None).release()

    return run


def test_a_task_grant_runs_the_same_commands_as_a_plain_one(
    r: redis.Redis, managers: Managers
) -> None:
    # The holder record rides in the registry HSET every grant makes (and
    # goes with its HDEL): no SET of a key of its own, no DEL at release.
    assert measure(r, managers, SMALL, task_cycle_scenario) == UNCONTENDED_CYCLE[1]


@pytest.mark.parametrize("resources", [1, 5])
def test_uncontended_cycle_runs_a_pinned_set_of_commands_whatever_the_keyspace(
    r: redis.Redis, managers: Managers, resources: int
) -> None:
    # Before: 19 commands for one resource (HGET and HMGET idempotency reads,
    # the holders' HLEN, the queue scan, SADD and DEL of request keys on every
    # grant; HLEN, ZRANGE, DEL of the contended stream and of request keys on
    # every release), 55 for five.
    scenario = uncontended_cycle_scenario(resources)
    small = measure(r, managers, SMALL, scenario)
    large = measure(r, managers, LARGE, scenario)

    assert small == large == UNCONTENDED_CYCLE[resources], f"{small} vs {large}"
    assert r.dbsize() == LARGE + 5  # format, fence, born, owners, the liveness key: no more


def test_commandstats_counts_commands_run_inside_scripts(
    r: redis.Redis, managers: Managers
) -> None:
    """The counter the cost tests rely on sees a script's own commands."""
    before = commandstats(r)
    r.eval("redis.call('SET', KEYS[1], '1'); return redis.call('GET', KEYS[1])", 1, "k")
    delta = command_delta(before, commandstats(r))
    assert delta == {"eval": 1, "set": 1, "get": 1}


# -- queue and holder scans ---------------------------------------------------


def exclusive_try_against_shared_holders(
    r: redis.Redis, managers: Managers, holders: int
) -> dict[str, int]:
    """Commands of one try-once exclusive attempt on a resource held shared
    ``holders`` times (a steady-state attempt: the owner is registered)."""
    r.flushall()
    many = managers(owner_ttl=OWNER_TTL)
    for _ in range(holders):
        # nested=False: separate grants, not a reentry of the first lease
        many.acquire(shared="R", timeout=0, nested=False)
    writer = managers(owner_ttl=OWNER_TTL)
    with pytest.raises(LockTimeout):
        writer.acquire("R", timeout=0)  # registers the owner, loads the script
    with counting(r) as delta:
        with pytest.raises(LockTimeout):
            writer.acquire("R", timeout=0)
    assert r.hlen("{t}:lock:R") == holders
    return delta


def test_exclusive_attempt_against_shared_holders_costs_the_same_for_20_or_400(
    r: redis.Redis, managers: Managers
) -> None:
    # Before: every attempt signalled each holder's own contend list and
    # checked each holder's liveness: 4N + 9 commands. Now it stops at the
    # first live holder and signals the resource's one contended stream, if
    # a holder watches it (none here: one EXISTS, no XADD).
    # (20 holders fit a listpack hash, 400 make a hashtable: both encodings.)
    small = exclusive_try_against_shared_holders(r, managers, 20)
    large = exclusive_try_against_shared_holders(r, managers, 400)
    assert small == large, f"{small} vs {large}"
    assert small.get("evalsha") == 2  # the attempt, and release.lua on its exit path
    assert "xadd" not in small
    # The holders' first page is read at once (no HLEN before it).
    assert "hlen" not in small and small.get("hscan") == 1, small


SCAN_LIMIT = 4  # dead entries below: 5, 10, 15, all past the scan limit


def dead_entries_ahead(r: redis.Redis, managers: Managers, dead: int) -> tuple[Any, Any]:
    """R held by a dead owner, ``dead`` dead entries queued for it, then one
    live entry (nobody waits for it: counting only). Returns the dead
    holder's lease and the live manager."""
    r.flushall()
    holder = managers(owner_ttl=OWNER_TTL, queue_scan_limit=SCAN_LIMIT)
    lease = holder.acquire("R", timeout=0)
    dying = managers(owner_ttl=OWNER_TTL, queue_scan_limit=SCAN_LIMIT)
    queue_requests(dying, dead, exclusive="R")
    live = managers(owner_ttl=OWNER_TTL, queue_scan_limit=SCAN_LIMIT)
    queue_requests(live, 1, exclusive="R")
    r.delete("{t}:alive:" + dying.owner_id)
    assert r.zcard("{t}:q:R") == dead + 1
    return lease, live


def release_past_dead_entries(r: redis.Redis, managers: Managers, dead: int) -> dict[str, int]:
    """Commands of the release that hands R to the live waiter behind them."""
    lease, live = dead_entries_ahead(r, managers, dead)
    with counting(r) as delta:
        lease.release()
    assert r.zcard("{t}:q:R") == 0
    assert [t.decode() for t in r.hkeys("{t}:lock:R")][0].startswith(live.owner_id)
    return delta


def try_once_past_dead_entries(r: redis.Redis, managers: Managers, dead: int) -> dict[str, int]:
    """Commands of a try-once request that reclaims R from its dead holder
    and is granted past the dead entries (the live entry left first)."""
    lease, live = dead_entries_ahead(r, managers, dead)
    r.zremrangebyrank("{t}:q:R", -1, -1)  # the live entry leaves (not a dead one)
    r.delete("{t}:alive:" + lease.owner_id)
    newcomer = managers(owner_ttl=OWNER_TTL, queue_scan_limit=SCAN_LIMIT)
    with newcomer.lock("warm", timeout=0):  # registered, script loaded
        pass
    with counting(r) as delta:
        got = newcomer.acquire("R", timeout=0)
    assert r.zcard("{t}:q:R") == 0
    got.release()
    return delta


@pytest.mark.parametrize("operation", [try_once_past_dead_entries, release_past_dead_entries])
def test_each_dead_queue_entry_removed_costs_the_same_few_commands(
    r: redis.Redis, managers: Managers, operation: Callable[..., dict[str, int]]
) -> None:
    # Before: a script removed at most queue_scan_limit dead entries, so the
    # try-once request failed on its free lock and the release woke nobody.
    # Now dead entries have their own budget, and each costs a constant
    # number of commands (its liveness, ZREM, its request's keys).
    totals = [sum(operation(r, managers, dead).values()) for dead in (5, 10, 15)]
    steps = [totals[1] - totals[0], totals[2] - totals[1]]  # 5 more dead entries each
    assert abs(steps[1] - steps[0]) <= 1, totals  # linear (pages of 4 round a little)
    assert all(0 < step <= 5 * 6 for step in steps), totals  # at most 6 commands each


# -- the deferred-task upkeep -------------------------------------------------


def upkeep_with_due_deadlines(
    r: redis.Redis, managers: Managers, backlog: int, due: int
) -> dict[str, int]:
    """Commands of one dispatcher upkeep pass with ``backlog`` tasks parked on
    ``busy`` (none due) and ``due`` tasks whose park deadline passed, each
    parked on a resource of its own behind a live holder."""
    from celery_redislock.worker.defer import Dispatcher, park

    r.flushall()
    mgr = managers(owner_ttl=OWNER_TTL)
    holders = [mgr.acquire(f"r{i}", timeout=0) for i in range(due)]
    holders.append(mgr.acquire("busy", timeout=0))

    def park_on(task_id: str, resource: str, park_ttl: float) -> None:
        message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
        req = mgr.request([resource], [])
        assert park(mgr, task_id, req, message, park_ttl=park_ttl, grant_ttl=60).outcome == (
            "parked"
        )

    for i in range(backlog):
        park_on(f"b{i}", "busy", 600)
    dispatcher = Dispatcher(mgr, "inc1", publish=lambda *a: None, on_withdrawn=lambda *a: None)
    dispatcher.upkeep()  # its format check and script loads are not counted
    for i in range(due):
        park_on(f"d{i}", f"r{i}", 0.05)
    deadlines = "{t}:deadlines"

    def now_ms() -> int:
        sec, usec = r.time()
        return int(sec) * 1000 + int(usec) // 1000

    wait_until(
        lambda: (
            r.zcount(deadlines, "-inf", now_ms()) == due
            and not any(r.exists(f"{{t}}:alive:defer:d{i}") for i in range(due))
        ),
        what="the deadlines passed",
    )
    with counting(r) as delta:
        assert dispatcher.upkeep() is False
    assert r.zcard(deadlines) == backlog and r.zcard("{t}:q:busy") == backlog
    assert not any(r.exists(f"{{t}}:defer:d{i}") for i in range(due))
    for lease in holders:
        lease.release()
    return delta


def test_the_upkeeps_cost_grows_with_the_deadlines_due_not_with_the_tasks_parked(
    r: redis.Redis, managers: Managers
) -> None:
    small = upkeep_with_due_deadlines(r, managers, 20, 4)
    large = upkeep_with_due_deadlines(r, managers, 2000, 4)
    assert small == large, f"{small} vs {large}"
    assert small.get("evalsha") == 1  # one round trip: the withdrawals are in its script
    totals = [sum(upkeep_with_due_deadlines(r, managers, 20, n).values()) for n in (2, 6)]
    totals.insert(1, sum(small.values()))
    step = totals[1] - totals[0]
    assert step > 0 and totals[2] - totals[1] == step, totals  # the same for each one due
