"""Limited resources (``limited={name: N}``) as operators see them: the
Inspector, ``redislock locks / waiters / status`` (tables and ``--json``).

Against the real redis-server fixture, with engine-level managers holding
slots; a slot taken "as a task" carries its holder record (the thread's
holder for the call, as ``@locked`` sets it).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redislock import LockManager, LockTimeout
from celery_redislock.integration.cli import redislock
from celery_redislock.lease import Lease
from celery_redislock.ops.inspector import (
    Inspector,
    LimitedInfo,
    limit_of_slots,
    request_modes,
)
from engine_helpers import wait_until
from test_inspect import DEADLINE, NS, dead_owner

API = "api:github"
TASK = "proj.call_github\n7c1d2e3f-0000-4000-8000-000000000001\ncelery@w1"


@pytest.fixture
def insp(redis_url: str) -> Iterator[Inspector]:
    mgr = LockManager(redis_url, NS, heartbeat=False)
    yield Inspector(mgr, batch_size=2)  # small batches: the walks must page
    mgr.close()


@pytest.fixture
def cli(redis_url: str) -> Callable[..., Result]:
    """``celery -A app redislock <args>``, in-process."""
    app = Celery("limitedcli", set_as_current=False)
    app.conf.redislock_url = redis_url
    app.conf.redislock_namespace = NS

    def invoke(*args: str) -> Result:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        result = CliRunner().invoke(redislock, list(args), obj=obj)
        assert result.exit_code == 0, (args, result.output, result.exception)
        return result

    return invoke


def slot(
    mgr: LockManager, limit: int, holder: str | None = None, timeout: float = 5, **kw: Any
) -> Lease:
    """One slot of API (and ``kw``'s other resources), as a task when ``holder``."""
    if holder is None:
        return mgr.acquire(limited={API: limit}, timeout=timeout, **kw)
    with mgr.context.using(holder=holder):
        return mgr.acquire(limited={API: limit}, timeout=timeout, **kw)


def waiting_for_slot(mgr: LockManager, limit: int, holder: str | None = None) -> threading.Thread:
    """A thread that waits for a slot of API, releasing it once granted."""

    def run() -> None:
        try:
            slot(mgr, limit, holder, timeout=DEADLINE).release()
        except LockTimeout:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def rows(output: str) -> list[list[str]]:
    """A table's lines, cells split on runs of two spaces or more."""
    return [re.split(r"\s{2,}", line.strip()) for line in output.splitlines() if line.strip()]


# -- pure helpers ---------------------------------------------------------------


def test_the_limit_shown_is_the_most_recent_grant_s_and_every_limit_is_listed() -> None:
    assert limit_of_slots([]) == (None, ())
    assert limit_of_slots([(10, 5), (12, 3), (11, 5)]) == (3, (3, 5))
    assert limit_of_slots([(10, 5), (None, None)]) == (5, (5,))


def test_a_modes_spec_gives_each_resource_its_mode_and_limit() -> None:
    assert request_modes("xl:5", ["a", "b"]) == {"a": ("x", None), "b": ("l", 5)}
    assert request_modes("lsl:3,8", ["a", "b", "c"]) == {
        "a": ("l", 3),
        "b": ("s", None),
        "c": ("l", 8),
    }
    assert request_modes("x", ["a"]) == {"a": ("x", None)}


# -- Inspector ------------------------------------------------------------------


def test_locks_show_the_slots_held_their_limit_and_who_holds_each(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    plain, task, third = managers(name="celery@w0"), managers(), managers()
    leases = [slot(plain, 5), slot(task, 5, TASK, exclusive=["repo:1"]), slot(third, 5)]
    [info] = insp.locks([API])
    assert (info.limit, info.limits, info.slots) == (5, (5,), "3/5")
    assert {h.token for h in info.holders} == {x.token for x in leases}
    assert all(h.mode == "limited" and h.limit == 5 and h.alive for h in info.holders)
    by_owner = {h.owner_id: h for h in info.holders}
    t = by_owner[task.owner_id]
    assert (t.task_name, t.task_id, t.node) == tuple(TASK.split("\n"))
    assert by_owner[plain.owner_id].task_name is None
    assert by_owner[plain.owner_id].node == "celery@w0"  # from its liveness value
    assert {h.fence for h in info.holders} == {x.fencing_token for x in leases}
    # The other resource of the task's request is an ordinary exclusive grant.
    [repo] = insp.locks(["repo:1"])
    assert repo.limit is None and repo.slots is None and repo.limits == ()
    assert repo.holders[0].mode == "exclusive" and repo.holders[0].limit is None
    # Walking the registries finds both.
    assert [(i.resource, i.slots) for i in insp.locks()] == [(API, "3/5"), ("repo:1", None)]
    d = info.as_dict()
    assert list(d)[-2:] == ["limit", "limits"] and d["limits"] == [5]
    assert d["holders"][0]["limit"] == 5


def test_during_a_rolling_deploy_the_most_recent_grant_s_limit_is_shown_with_both(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    old = [slot(managers(), 3) for _ in range(3)]
    raised = slot(managers(), 5)  # the new release's limit lets a fourth in
    info = insp.lock_info(API)
    assert (info.slots, info.limits) == ("4/5", (3, 5))
    raised.release()
    old[0].release()
    lowered_again = slot(managers(), 3)
    info = insp.lock_info(API)
    assert (info.slots, info.limits) == ("3/3", (3,))
    assert lowered_again.fencing_token == max(h.fence or 0 for h in info.holders)


def test_waiters_of_a_limited_resource_show_the_limit_each_asked_for(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    held = [slot(managers(), 2), slot(managers(), 2)]
    w1, w2 = managers(name="first"), managers(name="second")
    t1 = waiting_for_slot(w1, 2, TASK)
    wait_until(lambda: len(insp.waiters(API)) == 1, what="first waiter queued")
    t2 = waiting_for_slot(w2, 2)
    ws = wait_until(
        lambda: (lambda x: x if len(x) == 2 else None)(insp.waiters(API)),
        what="second waiter queued",
    )
    assert [(w.position, w.owner_id, w.mode, w.limit, w.state) for w in ws] == [
        (1, w1.owner_id, "limited", 2, "queued"),
        (2, w2.owner_id, "limited", 2, "queued"),
    ]
    assert (ws[0].task_name, ws[0].task_id) == tuple(TASK.split("\n")[:2])
    assert list(ws[0].as_dict())[-1] == "limit"
    assert insp.lock_info(API).waiting == 2
    held[0].release()
    held[1].release()
    t1.join(DEADLINE)
    t2.join(DEADLINE)
    assert insp.waiters(API) == []


def test_status_and_limited_count_limited_resources_slots_and_waiters(
    insp: Inspector, managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead_owner(redis_url, [(["plain"], [])])
    held = [slot(managers(), 2), slot(managers(), 2, exclusive=["other"])]
    other = managers().acquire(limited={"api:stripe": 4}, shared=["s"], timeout=5)
    waiter = waiting_for_slot(managers(), 2)
    wait_until(lambda: insp.status().limited_waiting == 1, what="the waiter queued")
    st = insp.status()
    assert (st.limited_resources, st.limited_slots, st.limited_waiting) == (2, 3, 1)
    assert st.registered_locks == 6 and st.waiting_requests == 1  # the others unchanged
    assert list(st.as_dict())[-3:] == ["limited_resources", "limited_slots", "limited_waiting"]
    assert insp.limited() == [
        LimitedInfo(API, 2, 2, (2,), 1),  # busiest first: it has a queue
        LimitedInfo("api:stripe", 1, 4, (4,), 0),
    ]
    summary = insp.summary(max_owners=1)
    assert summary.status.truncated and summary.status.owners == 1
    for lease in held:
        lease.release()
    waiter.join(DEADLINE)
    other.release()
    assert insp.status().limited_resources == 0 and insp.limited() == []


def test_limited_resources_are_listed_busiest_first(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    """Most requests queued first, then most slots held, then by name."""
    held = [managers().acquire(limited={"api:a": 3}, timeout=5) for _ in range(3)]
    held += [managers().acquire(limited={"api:c": 2}, timeout=5), slot(managers(), 1)]
    waiter = waiting_for_slot(managers(), 1)
    wait_until(lambda: insp.status().limited_waiting == 1, what="the waiter queued")
    assert [(x.resource, x.slots, x.waiting) for x in insp.limited()] == [
        (API, 1, 1),
        ("api:a", 3, 0),
        ("api:c", 1, 0),
    ]
    for lease in held:
        lease.release()
    waiter.join(DEADLINE)


def test_a_dead_holder_s_slot_counts_until_it_is_freed(
    insp: Inspector, managers: Callable[..., LockManager]
) -> None:
    dead = managers(owner_ttl=0.3, heartbeat=False)
    # Its id as it took the slot: once its deadline passes, the manager
    # itself goes on under a new one.
    dead_id = slot(dead, 2).owner_id
    live = slot(managers(), 2)
    wait_until(lambda: not insp.liveness([dead_id])[dead_id].alive, what="dead")
    info = insp.lock_info(API)
    assert info.slots == "2/2"
    assert {(h.owner_id, h.alive) for h in info.holders} >= {(dead_id, False)}
    assert insp.limited()[0].slots == 2
    insp.manager.reconcile()
    assert insp.lock_info(API).slots == "1/2"
    live.release()


# -- CLI ------------------------------------------------------------------------


def test_cli_locks_shows_slots_over_limit_and_each_slot_s_task_and_node(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    task, plain = managers(), managers(name="celery@w0")
    slot(task, 5, TASK)
    slot(plain, 5)
    slot(managers(), 5)
    table = rows(cli("locks").output)
    assert table[0][:3] == ["RESOURCE", "MODE", "OWNER"]
    lines = [r for r in table[1:] if r[0] == API]
    assert len(lines) == 3 and all(r[1] == "limited 3/5" for r in lines)
    mine = next(r for r in lines if r[2] == task.owner_id)
    assert mine[5] == "proj.call_github[7c1d2e3f-0000-4000-8000-000000000001]"
    assert mine[6] == "celery@w1"
    assert next(r for r in lines if r[2] == plain.owner_id)[6] == "celery@w0"
    [data] = json.loads(cli("locks", API, "--json").stdout)
    assert (data["limit"], data["limits"], len(data["holders"])) == (5, [5], 3)
    assert {h["limit"] for h in data["holders"]} == {5}
    assert {h["task_name"] for h in data["holders"]} == {"proj.call_github", None}


def test_cli_locks_names_both_limits_during_a_rolling_deploy(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    slot(managers(), 3)
    slot(managers(), 5)
    lines = [r for r in rows(cli("locks", API).output)[1:] if r[0] == API]
    assert {r[1] for r in lines} == {"limited 2/5 (limits 3,5)"}
    [data] = json.loads(cli("locks", API, "--json").stdout)
    assert (data["limit"], data["limits"]) == (5, [3, 5])


def test_cli_waiters_shows_mode_limited_with_the_limit_asked_for(
    cli: Callable[..., Result], managers: Callable[..., LockManager], insp: Inspector
) -> None:
    held = slot(managers(), 1)
    waiter = managers()
    t = waiting_for_slot(waiter, 1, TASK)
    wait_until(lambda: insp.waiters(API), what="queued")
    table = rows(cli("waiters", API).output)
    assert table[0][:2] == ["POS", "MODE"]
    assert table[1][:3] == ["1", "limited (limit 1)", waiter.owner_id]
    assert "proj.call_github 7c1d2e3f-0000-4000-8000-000000000001" in table[1]
    [data] = json.loads(cli("waiters", API, "--json").stdout)
    assert (data["mode"], data["limit"], data["state"]) == ("limited", 1, "queued")
    assert json.loads(cli("waiters", "--json").stdout) == [{"resource": API, "waiting": 1}]
    held.release()
    t.join(DEADLINE)


def test_cli_status_counts_limited_resources_slots_and_waiters(
    cli: Callable[..., Result], managers: Callable[..., LockManager], insp: Inspector
) -> None:
    held = [slot(managers(), 2), slot(managers(), 2)]
    managers().acquire("plain", timeout=5)
    t = waiting_for_slot(managers(), 2)
    wait_until(lambda: insp.waiters(API), what="queued")
    lines = [" ".join(line.split()) for line in cli("status").output.splitlines()]
    assert "limited 1 resource(s), 2 slot(s) held, 1 request(s) queued" in lines
    data = json.loads(cli("status", "--json").stdout)
    assert (data["limited_resources"], data["limited_slots"], data["limited_waiting"]) == (1, 2, 1)
    assert data["registered_locks"] == 3 and data["waiting_requests"] == 1
    for lease in held:
        lease.release()
    t.join(DEADLINE)
    lines = [" ".join(line.split()) for line in cli("status").output.splitlines()]
    assert "limited 0 resource(s), 0 slot(s) held, 0 request(s) queued" in lines
