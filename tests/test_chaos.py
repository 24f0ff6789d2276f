"""The chaos harness (tests/chaos): its checker, its store, and a short seeded run.

The checker tests feed it hand-written timelines, so each check is seen to
fire on the pattern it names and to stay quiet on the look-alikes that are
not violations (the harness must have no false positives). The short run
(marker ``chaos_short``) is part of the default run; ``make chaos`` is the
long one (docs/chaos.md).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

from chaos import checker
from chaos import participants as celery_participants
from chaos.faults import ALL_FAULTS, KNOWN_TO_FAIL, SHORT_RUN_FAULTS, parse_faults, short_run_faults
from chaos.runner import Config, Runner
from chaos.store import ANOMALIES, Store

TTL = 1.0


class Timelines:
    """Writes a run folder by hand: run.json, faults.jsonl, timelines, audit."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.faults: list[dict[str, Any]] = []
        self.audit: dict[str, Any] = {"keys": [], "store": {}, "anomalies": []}
        self.fence = 1000

    def ev(self, proc: str, ev: str, t: float, **fields: Any) -> None:
        self.events[proc].append(
            {"ev": ev, "p": proc, "pid": 1, "th": "T0", "t": t, "w": t, **fields}
        )

    def section(
        self,
        proc: str,
        op: str,
        t: float,
        *,
        x: tuple[str, ...] = (),
        s: tuple[str, ...] = (),
        hold: float = 1.0,
        fence: int | None = None,
        ok1: bool = True,
        ok2: bool = True,
        lost: bool = False,
        owner: str | None = None,
        limited: dict[str, int] | None = None,
    ) -> None:
        """acquire at t, granted t+0.01, section [t+0.02, t+0.02+hold], release after."""
        if fence is None:
            self.fence += 1
            fence = self.fence
        lim = {"l": limited} if limited else {}
        self.ev(proc, "acq", t, op=op, x=list(x), s=list(s), timeout=5.0, **lim)
        self.ev(proc, "granted", t + 0.01, op=op, fence=fence, owner=owner or f"owner-{proc}")
        self.ev(proc, "cs_begin", t + 0.02, op=op, ok=ok1, tc=t + 0.015)
        self.ev(proc, "cs_end", t + 0.03 + hold, op=op, ok=ok2, tc=t + 0.02 + hold)
        self.ev(proc, "released", t + 0.04 + hold, op=op, lost=lost)

    def waiter(self, proc: str, op: str, t0: float, t1: float, res: str) -> None:
        self.ev(proc, "acq", t0, op=op, x=[res], s=[], timeout=t1 - t0)
        self.ev(proc, "timeout", t1, op=op)

    def fault(self, kind: str, t0: float, t1: float | None = None, **fields: Any) -> None:
        self.faults.append({"kind": kind, "t0": t0, "t1": t0 if t1 is None else t1, **fields})

    def check(self) -> list[checker.Violation]:
        (self.folder / "timelines").mkdir(exist_ok=True)
        (self.folder / "run.json").write_text(
            json.dumps({"config": {"owner_ttl": TTL, "seed": 1, "duration": 60}, "t0": 0.0})
        )
        (self.folder / "faults.jsonl").write_text(
            "".join(json.dumps(f) + "\n" for f in self.faults)
        )
        for proc, evs in self.events.items():
            lines = sorted(evs, key=lambda e: e["t"])
            (self.folder / "timelines" / f"{proc}.jsonl").write_text(
                "".join(json.dumps(e) + "\n" for e in lines)
            )
        (self.folder / "audit.json").write_text(json.dumps(self.audit))
        return checker.check(self.folder).violations


@pytest.fixture
def tl(tmp_path: Path) -> Timelines:
    return Timelines(tmp_path)


def kinds(violations: list[checker.Violation]) -> list[str]:
    return sorted(v.kind for v in violations)


# -- overlap ----------------------------------------------------------------


def test_two_clean_exclusive_sections_overlapping_are_an_overlap(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",))
    tl.section("b", "b.0.1", 10.5, x=("r1",))
    found = tl.check()
    assert kinds(found) == ["overlap"]
    assert "a.0.1" in found[0].summary and "b.0.1" in found[0].summary
    assert any(line.startswith("a.0.1") for line in found[0].trace)


def test_an_exclusive_and_a_shared_section_overlapping_are_an_overlap(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, s=("r1", "r2"))
    tl.section("b", "b.0.1", 10.5, x=("r2",))
    assert kinds(tl.check()) == ["overlap"]


def test_shared_sections_and_sections_on_other_resources_may_overlap(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, s=("r1",))
    tl.section("b", "b.0.1", 10.5, s=("r1",))
    tl.section("c", "c.0.1", 10.5, x=("r2",))
    tl.section("d", "d.0.1", 11.5, x=("r1",))
    assert tl.check() == []


def test_an_overlap_is_excused_when_a_lease_was_lost_at_release(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), lost=True)
    tl.section("b", "b.0.1", 10.5, x=("r1",))
    assert "overlap" not in kinds(tl.check())


def test_an_overlap_is_excused_when_a_check_failed(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), ok2=False)
    tl.section("b", "b.0.1", 10.5, x=("r1",))
    assert "overlap" not in kinds(tl.check())


def test_a_killed_holder_is_never_part_of_an_overlap(tl: Timelines) -> None:
    tl.ev("a", "acq", 10.0, op="a.0.1", x=["r1"], s=[], timeout=1.0)
    tl.ev("a", "granted", 10.01, op="a.0.1", fence=5, owner="oa")
    tl.ev("a", "cs_begin", 10.02, op="a.0.1", ok=True, tc=10.015)
    tl.fault("kill_worker", 10.2, target="a")
    tl.section("b", "b.0.1", 10.1, x=("r1",))
    assert "overlap" not in kinds(tl.check())


# -- over limit: slots of a limited resource ----------------------------------

SLOT = {"lim": 3}


def test_more_clean_slot_sections_at_once_than_the_limit_are_over_limit(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, limited=SLOT, hold=2.0)
    tl.section("b", "b.0.1", 10.3, limited=SLOT, hold=2.0, x=("r1",))
    tl.section("c", "c.0.1", 10.6, limited=SLOT, hold=2.0)
    tl.section("d", "d.0.1", 11.0, limited=SLOT, hold=0.5)  # the fourth, inside all three
    tl.section("e", "e.0.1", 11.1, limited=SLOT, hold=0.2)  # the same stretch: not again
    found = tl.check()
    assert kinds(found) == ["over_limit"]
    assert "4 sections" in found[0].summary and "limit 3" in found[0].summary
    assert set(found[0].ops) == {"a.0.1", "b.0.1", "c.0.1", "d.0.1"}
    assert any(line.startswith("d.0.1") and "l={'lim': 3}" in line for line in found[0].trace)


def test_slot_sections_up_to_the_limit_and_excused_ones_are_no_violation(tl: Timelines) -> None:
    # Three at once, a fourth only once the first ended; a fourth during the
    # three whose lease was lost at release, one whose second check failed and
    # one killed while it held: each of them was told (or could not act).
    tl.section("a", "a.0.1", 10.0, limited=SLOT, hold=1.0)
    tl.section("b", "b.0.1", 10.3, limited=SLOT, hold=2.0)
    tl.section("c", "c.0.1", 10.6, limited=SLOT, hold=2.0)
    tl.section("d", "d.0.1", 11.1, limited=SLOT, hold=1.0, x=("r1",))
    tl.section("e", "e.0.1", 11.2, limited=SLOT, hold=0.3, lost=True)
    tl.section("f", "f.0.1", 11.3, limited=SLOT, hold=0.3, ok2=False)
    tl.ev("g", "acq", 11.4, op="g.0.1", x=[], s=[], l=SLOT, timeout=1.0)
    tl.fence += 1
    tl.ev("g", "granted", 11.41, op="g.0.1", fence=tl.fence, owner="og")
    tl.ev("g", "cs_begin", 11.42, op="g.0.1", ok=True, tc=11.415)
    tl.fault("kill_worker", 11.6, target="g")
    # Exclusive sections on the limited name's neighbour never count as slots.
    tl.section("h", "h.0.1", 14.0, x=("r2",), hold=0.5)
    found = tl.check()
    assert found == [], [v.render() for v in found]
    report = checker.check(tl.folder)
    assert report.stats["most_slots_at_once"] == {"lim": 3}, report.stats
    assert report.stats["slot_sections"] == 7, report.stats


def test_two_limits_for_one_resource_may_hold_up_to_the_larger(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, limited={"lim": 2}, hold=2.0)
    tl.section("b", "b.0.1", 10.3, limited={"lim": 2}, hold=2.0)
    tl.section("c", "c.0.1", 10.6, limited={"lim": 3}, hold=2.0)
    assert tl.check() == []
    tl.section("d", "d.0.1", 11.0, limited={"lim": 3}, hold=0.5)
    assert kinds(tl.check()) == ["over_limit"]


# -- stale check --------------------------------------------------------------


def test_a_check_passing_after_a_later_conflicting_grant_is_a_stale_check(tl: Timelines) -> None:
    # a is paused in its section; b is granted (higher fence) and told so
    # before a's second check, which still passes: a learned only at release.
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=3.0, lost=True, fence=10)
    tl.section("b", "b.0.1", 11.5, x=("r1",), hold=0.1, fence=11)
    tl.fault("stop_worker", 10.1, 12.9, target="a")
    found = tl.check()
    assert kinds(found) == ["stale_check"]
    assert "a.0.1's second check()" in found[0].summary
    assert any("stop_worker" in line for line in found[0].trace)


def test_a_stale_check_is_excused_for_owner_ttl_after_a_lock_server_restart(
    tl: Timelines,
) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=1.5, lost=True, fence=10)
    tl.section("b", "b.0.1", 11.3, x=("r1",), hold=0.1, fence=11)
    tl.fault("redis_restart", 11.0, 11.2)
    assert tl.check() == []  # a's second check at 11.52: within 1 s of the restart
    tl.faults[0].update(t0=10.1, t1=10.3)  # 1.22 s after it: a should have known
    assert kinds(tl.check()) == ["stale_check"]


def test_a_stale_check_is_excused_by_a_forced_cleanup_of_that_owner_only(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=1.5, lost=True, fence=10, owner="oa")
    tl.section("b", "b.0.1", 11.3, x=("r1",), hold=0.1, fence=11, owner="ob")
    tl.fault("force_cleanup", 11.0, 11.1, owner="oa")
    assert tl.check() == []
    tl.faults[0]["owner"] = "someone-else"
    assert kinds(tl.check()) == ["stale_check"]


def test_checks_made_before_the_later_grant_was_told_are_not_stale(tl: Timelines) -> None:
    # a's lease was lost while it held it (lost at release), but both its
    # checks ran before b's first check returned: nothing proves a was told late.
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=1.0, lost=True, fence=10)
    tl.section("b", "b.0.1", 11.01, x=("r1",), hold=0.1, fence=11)
    assert tl.check() == []


# -- fences -------------------------------------------------------------------


def test_a_fence_not_above_an_earlier_returned_grant_is_fence_backwards(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=0.1, fence=500)
    tl.section("b", "b.0.1", 11.0, x=("r2",), hold=0.1, fence=499)
    found = tl.check()
    assert kinds(found) == ["fence_backwards"]
    assert "got fence 499" in found[0].summary


def test_grants_racing_each_other_may_return_in_any_fence_order(tl: Timelines) -> None:
    # b began before a returned: either may have been granted first in Redis.
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=0.1, fence=500)
    tl.section("b", "b.0.1", 10.005, x=("r2",), hold=0.1, fence=499)
    assert tl.check() == []


# -- store -------------------------------------------------------------------


def test_store_anomalies_and_lost_updates_are_reported(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=0.1)
    tl.audit["anomalies"] = [
        json.dumps({"res": "r1", "op": "a.0.1", "fence": "7", "expected": "3", "found": "4"})
    ]
    tl.audit["store"] = {"r1": {"v": "4", "writes": "5"}, "r2": {"v": "2", "writes": "2"}}
    found = tl.check()
    assert kinds(found) == ["stale_write_accepted", "stale_write_accepted"]
    assert "lost update" in found[0].summary and "r1" in found[1].summary


def test_store_refuses_stale_fences_and_records_lost_updates(redis_url: str) -> None:
    store = Store(redis_url)
    try:
        assert store.read("r", 10, "x") == (True, 0)
        assert store.write("r", 10, 0, 1, "op1") == (True, 0)
        assert store.read("r", 9, "x") == (False, 10)  # older exclusive holder
        assert store.write("r", 9, 1, 2, "op0") == (False, 10)
        assert store.read("r", 9, "s") == (False, 10)  # older shared reader
        assert store.read("r", 12, "s") == (True, 1)
        assert store.read("r", 11, "s") == (True, 1)  # shared readers coexist
        assert store.write("r", 11, 1, 2, "op2") == (False, 12)  # exclusive older than a reader
        assert store.read("r", 1796059049896324, "x") == (True, 1)  # fences near TIME in us
        assert store.read("r", 1796059049896323, "x") == (False, 1796059049896324)
        assert store.anomalies() == []
        assert store.write("r", 1796059049896324, 0, 5, "op3") == (True, 1)  # read 0, was 1
        assert [json.loads(a)["op"] for a in store.anomalies()] == ["op3"]
        assert store.snapshot(["r"])["r"]["writes"] == "2"
    finally:
        store.client.delete(ANOMALIES)
        store.close()


# -- stalled waiters -------------------------------------------------------------


def test_a_waiter_timing_out_on_a_long_free_and_quiet_resource_is_stalled(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=0.5)
    tl.waiter("b", "b.0.1", 10.2, 17.0, "r1")  # r1 free from 10.54 to 17.0
    found = tl.check()
    assert kinds(found) == ["waiter_stalled"]
    assert "b.0.1 timed out" in found[0].summary


def test_a_waiter_is_not_stalled_while_others_use_its_resources(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=0.5)
    tl.section("c", "c.0.1", 12.0, s=("r1",), hold=0.1)
    tl.section("c", "c.0.2", 14.0, s=("r1",), hold=0.1)
    tl.waiter("d", "d.0.1", 15.0, 16.5, "r1")  # another waiter
    tl.waiter("b", "b.0.1", 10.2, 17.0, "r1")  # never 3 s free
    assert tl.check() == []


def test_a_waiter_is_not_stalled_when_a_fault_or_error_settles_meanwhile(tl: Timelines) -> None:
    tl.section("a", "a.0.1", 10.0, x=("r1",), hold=0.5)
    tl.waiter("b", "b.0.1", 10.2, 15.0, "r1")  # free from 10.54: 4.46 s > 3 s
    assert kinds(tl.check()) == ["waiter_stalled"]
    tl.fault("script_flush", 12.8)  # quiet: 10.54-12.8, 13.8-15.0
    assert tl.check() == []
    tl.faults = []
    tl.ev("c", "acq", 12.5, op="c.0.1", x=["r9"], s=[], timeout=0)
    tl.ev("c", "acq_error", 12.6, op="c.0.1", err="RedisUnavailable()")
    assert tl.check() == []


def test_a_killed_waiter_blocks_until_it_was_killed(tl: Timelines) -> None:
    tl.ev("a", "acq", 10.0, op="a.0.1", x=["r1"], s=[], timeout=30.0)
    tl.fault("kill_worker", 12.0, target="a")
    tl.waiter("b", "b.0.1", 10.2, 20.0, "r1")
    found = tl.check()  # free and quiet from 13.0 (kill + owner_ttl) to 20.0
    assert kinds(found) == ["waiter_stalled"]
    assert "from +13.000" in found[0].summary


# -- waiter errors ---------------------------------------------------------------


def test_a_waiter_raising_while_the_server_runs_is_a_waiter_error(tl: Timelines) -> None:
    tl.ev("a", "acq", 10.0, op="a.0.1", x=["r1"], s=[], timeout=2.0)
    tl.ev("a", "acq_error", 10.5, op="a.0.1", err="RedisUnavailable('u', 'Connection closed')")
    tl.ev("a", "acq", 11.0, op="a.0.2", x=["r1"], s=[], timeout=0)  # tried once: not a waiter
    tl.ev("a", "acq_error", 11.1, op="a.0.2", err="RedisUnavailable('u', 'Connection closed')")
    tl.fault("client_kill", 10.49, 10.5)
    found = tl.check()
    assert kinds(found) == ["waiter_error"]
    assert "a.0.1" in found[0].summary and "client_kill" in found[0].trace[-1]


def test_a_waiter_raising_during_a_lock_server_restart_is_excused(tl: Timelines) -> None:
    tl.ev("a", "acq", 10.0, op="a.0.1", x=["r1"], s=[], timeout=2.0)
    tl.ev("a", "acq_error", 10.5, op="a.0.1", err="RedisUnavailable('u', 'Connection refused')")
    tl.fault("redis_restart", 10.3, 10.45)
    assert tl.check() == []


# -- leftover keys -------------------------------------------------------------


def test_keys_left_in_the_namespace_are_reported_except_allowed_ones(tl: Timelines) -> None:
    tl.audit["keys"] = [
        {"key": "{chaos}:fence", "type": "string", "pttl": -1, "allowed": True},
        {"key": "{chaos}:lost:o1", "type": "list", "pttl": 900, "allowed": True},
        {"key": "{chaos}:q:r3", "type": "zset", "pttl": -1, "members": ["xo|1"], "allowed": False},
    ]
    found = tl.check()
    assert kinds(found) == ["leftover_key"]
    assert found[0].trace == ["{chaos}:q:r3 type=zset pttl=-1 members=['xo|1']"]


# -- fault selection ------------------------------------------------------------


def test_fault_sets_parse_and_the_short_run_leaves_out_known_failures() -> None:
    assert parse_faults("all") == ALL_FAULTS
    assert parse_faults("none") == ()
    assert parse_faults("kill_worker, script_flush") == ("kill_worker", "script_flush")
    with pytest.raises(ValueError, match="unknown fault kinds"):
        parse_faults("kill_worker,meteor")
    assert set(KNOWN_TO_FAIL) <= set(ALL_FAULTS)
    assert not set(SHORT_RUN_FAULTS) & set(KNOWN_TO_FAIL)


# -- the short seeded run ------------------------------------------------------

SHORT_SEED = int(os.environ.get("CHAOS_SHORT_SEED", "20261130"))
SHORT_DURATION = float(os.environ.get("CHAOS_SHORT_DURATION", "30"))


@pytest.mark.chaos_short
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_short_seeded_chaos_run_finds_no_violation(tmp_path: Path) -> None:
    """~30 s of load and faults (the short run's fault set), then every check.

    Replay a failure with ``make chaos SEED=<seed> DURATION=30 FAULTS=<faults>``
    (the message gives both); ``CHAOS_SHORT_FAULTS=all`` runs every fault here.
    """
    faults = short_run_faults()
    cfg = Config(
        seed=SHORT_SEED,
        duration=SHORT_DURATION,
        processes=3,
        threads=3,
        owner_ttl=1.0,
        faults=faults,
        long_timeout=(5.0, 7.0),
        asyncio_every=3,  # w2 (and any third worker started) is an asyncio service
        out=str(tmp_path / "run"),
    )
    outcome = Runner(cfg).run()
    stats = outcome.stats
    assert stats["sections"] > 50, stats  # the run did lock things
    assert stats["slot_sections"] > 10, stats  # and took slots of the limited resource
    assert stats["asyncio_sections"] > 10, stats  # and the asyncio service took part
    assert sum(stats["faults"].values()) >= 5 or not faults, stats
    assert outcome.ok, (
        f"seed={SHORT_SEED} faults={','.join(faults)}; replay: make chaos SEED={SHORT_SEED} "
        f"DURATION={SHORT_DURATION:g} FAULTS={','.join(faults) or 'none'}\n"
        + checker.render(checker.Report(stats, outcome.violations))
    )


def test_redis_client_of_the_store_is_separate_from_the_lock_namespace(redis_url: str) -> None:
    store = Store(redis_url)
    try:
        store.write("r1", 1, 0, 1, "op")
        keys = {k for k in store.client.keys("*")}
        assert keys == {"store:r1"}
        assert not any(k.startswith("{") for k in keys)
    finally:
        store.close()
    redis.Redis.from_url(redis_url).flushall()


# -- the Celery participants' checks (chaos.celery_runner) ------------------------

CELERY_CONFIG = {
    "seed": 1,
    "duration": 30,
    "participants": ["defer"],
    "owner_ttl": 2.0,
    "heartbeat": 0.25,
    "grant_ttl": 3.0,
    "visibility": 10.0,
    "concurrency": 2,
    "drain": 30.0,
    "idle_bound": 1.0,
}


class CeleryHistory:
    """Writes a Celery run's folder by hand: sends, faults, bodies' stamps, final states."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sent: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.stamps: dict[int, list[dict[str, Any]]] = defaultdict(list)
        self.states: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.end = 100.0
        self.fence = 1000
        # two workers of two slots, up from t=1
        for node in ("cw0@e2e", "cw1@e2e"):
            self.faults.append(
                {"kind": "worker_up", "t0": 1.0, "t1": 1.0, "node": node, "slots": 2}
            )

    def send(self, tid: str, t: float, *, res: str = "r0", mode: str = "x", kind: str = "defer",
             key: str | None = None, dup_of: str | None = None, state: str = "SUCCESS") -> None:  # fmt: skip
        rec: dict[str, Any] = {"id": tid, "kind": kind, "res": res, "mode": mode, "t0": t,
                               "t1": t + 0.01, "dup_of": dup_of}  # fmt: skip
        if key:
            rec["key"] = key
        self.sent.append(rec)
        if not dup_of:
            self.states[tid] = state

    def stamp(self, pid: int, ev: str, t: float, **fields: Any) -> None:
        self.stamps[pid].append({"ev": ev, "pid": pid, "t": t, "w": t, **fields})

    def body(self, tid: str, t0: float, t1: float | None, *, pid: int = 11, res: str = "r0",
             mode: str = "x", attempt: int = 0, lost: bool = False, retrying: bool = False,
             node: str = "cw0@e2e", kind: str = "defer", fence: int | None = None) -> None:  # fmt: skip
        """A pool child takes the message at t0 - 0.01, runs the body [t0, t1]."""
        if fence is None:
            self.fence += 1
            fence = self.fence
        task = f"chaos.{kind}_{mode}"
        base = {"id": tid, "retries": attempt, "kind": kind, "mode": mode, "res": res,
                "node": node, "fence": fence}  # fmt: skip
        self.stamp(pid, "prerun", t0 - 0.01, id=tid, task=task, retries=attempt, node=node,
                   res=res, redispatch=False)  # fmt: skip
        self.stamp(pid, "begin", t0, **base)
        if t1 is not None:
            self.stamp(pid, "end", t1, **base, lost=lost, retrying=retrying)
            self.stamp(pid, "postrun", t1 + 0.01, id=tid, state="SUCCESS")

    def fault(self, kind: str, t0: float, t1: float | None = None, **fields: Any) -> None:
        self.faults.append({"kind": kind, "t0": t0, "t1": t0 if t1 is None else t1, **fields})

    def check(self) -> list[checker.Violation]:
        f = self.folder
        (f / "bodies").mkdir(exist_ok=True)
        meta = {"config": CELERY_CONFIG, "t0": 0.0, "celery": True}
        (f / "run.json").write_text(json.dumps(meta))
        (f / "sent.jsonl").write_text("".join(json.dumps(s) + "\n" for s in self.sent))
        (f / "faults.jsonl").write_text("".join(json.dumps(x) + "\n" for x in self.faults))
        for pid, evs in self.stamps.items():
            lines = sorted(evs, key=lambda e: e["t"])
            (f / "bodies" / f"{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
        final = {"states": self.states, "errors": self.errors, "drained": True, "drain_s": 2.0,
                 "t_end": self.end}  # fmt: skip
        (f / "final.json").write_text(json.dumps(final))
        return checker.check(f).violations


@pytest.fixture
def ch(tmp_path: Path) -> CeleryHistory:
    return CeleryHistory(tmp_path)


def test_celery_a_clean_history_has_no_violation(ch: CeleryHistory) -> None:
    ch.send("a", 10.0)
    ch.body("a", 10.05, 10.3)
    ch.send("b", 10.1)  # parked behind a, runs right after it
    ch.body("b", 10.5, 10.7, pid=12)
    ch.send("c", 10.2, mode="s", res="r1")
    ch.send("d", 10.2, mode="s", res="r1")
    ch.body("c", 10.25, 10.6, mode="s", res="r1", pid=21, node="cw1@e2e")
    ch.body("d", 10.3, 10.5, mode="s", res="r1", pid=22, node="cw1@e2e")
    assert ch.check() == []


def test_celery_a_sent_task_whose_body_never_ran_is_flagged_and_left_pending(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0, state="DEFERRED")
    found = ch.check()
    assert sorted(v.kind for v in found) == ["left_pending", "never_ran", "resource_idle"]
    assert "a (defer on r0) attempt 0: the body never ran" in found[0].summary


def test_celery_a_task_failed_by_a_lock_server_outage_is_counted_not_reported(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0, state="FAILURE")
    ch.errors["a"] = "RedisUnavailable"
    ch.fault("lock_restart", 10.02, 10.2)
    ch.end = 12.0
    assert ch.check() == []
    assert checker.check_celery(ch.folder).stats["failed_lock_down"] == 1
    ch.faults.pop()  # no outage: the task should have run
    assert kinds(ch.check()) == ["never_ran", "resource_idle"]


def test_celery_a_retry_failed_by_a_lock_server_outage_is_counted_not_reported(
    ch: CeleryHistory,
) -> None:
    # Attempt 0 ran and retried; attempt 1 started while the lock server
    # restarted and failed with RedisUnavailable before its body.
    ch.send("a", 10.0, kind="retry", state="FAILURE")
    ch.errors["a"] = "RedisUnavailable"
    ch.body("a", 10.05, 10.3, retrying=True)
    ch.fault("lock_restart", 10.4, 10.5)
    ch.end = 12.0
    assert ch.check() == []
    assert checker.check_celery(ch.folder).stats["failed_lock_down"] == 1
    ch.faults.pop()  # no outage: attempt 1 should have run
    assert "never_ran" in kinds(ch.check())


def _assert_counted_as_broker_lost(ch: CeleryHistory) -> None:
    """The history, ended at 12 s, checks clean: its one lost message is
    counted as the broker's loss (a kill explains it), not reported."""
    ch.end = 12.0
    assert ch.check() == []
    assert checker.check_celery(ch.folder).stats["broker_lost"] == 1


def test_celery_a_message_lost_by_the_broker_at_a_main_process_kill_is_counted_not_reported(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0, state="PENDING")
    ch.fault("kill_main", 10.3, 10.3, node="cw0@e2e")
    _assert_counted_as_broker_lost(ch)
    ch.faults[-1]["t0"] = ch.faults[-1]["t1"] = 11.5  # the kill came too late to explain it
    assert {"left_pending", "never_ran"} <= set(kinds(ch.check()))
    ch.faults[-1]["t0"] = ch.faults[-1]["t1"] = 10.3
    ch.states["a"] = "DEFERRED"  # it reached @locked: not the broker's loss
    assert {"left_pending", "never_ran"} <= set(kinds(ch.check()))
    ch.states["a"] = "PENDING"
    ch.stamp(11, "prerun", 10.2, id="a", task="chaos.defer_x", retries=0, node="cw0@e2e",
             res="r0", redispatch=False)  # fmt: skip
    assert "left_pending" in kinds(ch.check())  # a pool child had it


def test_celery_a_retry_message_lost_by_the_broker_at_a_main_process_kill_is_counted_not_reported(
    ch: CeleryHistory,
) -> None:
    # Attempt 0 ran and sent its retry at 10.3; a worker's main process was
    # SIGKILLed 1 ms later, between its BRPOP of the retry and kombu's
    # unacked bookkeeping: no pool child ever had attempt 1, the task stays
    # RETRY (seed 712835664 had such a task).
    ch.send("a", 10.0, kind="retry", state="RETRY")
    ch.body("a", 10.05, 10.3, retrying=True)
    ch.fault("kill_main", 10.301, 11.3, node="cw1@e2e")
    _assert_counted_as_broker_lost(ch)
    ch.faults[-1]["t0"] = ch.faults[-1]["t1"] = 11.5  # the kill came too late to explain it
    assert {"left_pending", "never_ran"} <= set(kinds(ch.check()))
    ch.faults[-1]["t0"], ch.faults[-1]["t1"] = 10.301, 11.3
    ch.body("a", 10.6, None, attempt=1)  # attempt 1 reached a child, never ended: not lost
    assert "never_ran" in kinds(ch.check())


def test_celery_a_message_sent_while_a_worker_kill_is_under_way_is_counted_as_broker_lost(
    ch: CeleryHistory,
) -> None:
    # The kill's start is stamped before the SIGKILL goes out, and the broker
    # serves a dead consumer's blocking pop until it sees the connection
    # closed: a send 4 ms after the start can still be popped and lost.
    ch.send("a", 10.0, state="PENDING")
    ch.fault("kill_worker", 9.996, 11.2, node="cw1@e2e")
    _assert_counted_as_broker_lost(ch)
    ch.faults[-1]["t1"] = 9.998  # the kill was over before the send
    assert {"left_pending", "never_ran"} <= set(kinds(ch.check()))


def test_celery_a_task_that_retries_must_run_its_second_attempt(ch: CeleryHistory) -> None:
    ch.send("a", 10.0, kind="retry", state="RETRY")
    ch.body("a", 10.05, 10.3, retrying=True)
    found = ch.check()
    assert "never_ran" in kinds(found) and "left_pending" in kinds(found)
    assert any("attempt 1" in v.summary for v in found if v.kind == "never_ran")
    ch.states["a"] = "SUCCESS"
    ch.body("a", 10.5, 10.6, attempt=1, pid=12)
    assert ch.check() == []


def test_celery_a_body_run_twice_is_flagged_unless_a_kill_explains_it(ch: CeleryHistory) -> None:
    ch.send("a", 10.0)
    ch.body("a", 10.05, 10.3)
    ch.body("a", 10.5, 10.7, pid=12)
    found = ch.check()
    assert kinds(found) == ["ran_twice"]
    assert "2 not explained by a kill" in found[0].summary
    # The first run's child SIGKILLed mid-body (acks_late redelivers): the
    # at-least-once corner, counted and not reported.
    ch.stamps[11] = [e for e in ch.stamps[11] if e["ev"] != "end"]
    ch.fault("kill_child", 10.2, pid=11, node="cw0@e2e")
    ch.end = 30.0
    assert ch.check() == []
    assert checker.check_celery(ch.folder).stats["at_least_once"] == 1
    # A kill of another child explains nothing.
    ch.faults[-1]["pid"] = 99
    assert "ran_twice" in kinds(ch.check())


def test_celery_a_kill_of_the_main_process_after_the_body_explains_a_rerun(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0)
    ch.body("a", 10.05, 10.3)  # ended, but its ack went with the main process
    ch.fault("kill_main", 10.5, 11.0, node="cw0@e2e", pid=5)
    ch.body("a", 25.0, 25.2, pid=21, node="cw1@e2e")  # restored after the visibility timeout
    assert ch.check() == []
    ch.faults[-1]["t0"] = 12.0  # long after the ack: no excuse
    assert kinds(ch.check()) == ["ran_twice"]


def test_celery_bodies_of_tasks_never_sent_or_attempts_never_made_are_unexpected(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0)
    ch.body("a", 10.05, 10.3)
    ch.body("a", 10.5, 10.6, attempt=1, pid=12)
    ch.body("ghost", 11.0, 11.1, res="r2", pid=13)
    assert kinds(ch.check()) == ["unexpected_run", "unexpected_run"]


def test_celery_incompatible_bodies_overlapping_are_flagged(ch: CeleryHistory) -> None:
    ch.send("a", 10.0)
    ch.send("b", 10.0, mode="s")
    ch.body("a", 10.05, 10.5)
    ch.body("b", 10.3, 10.6, mode="s", pid=21, node="cw1@e2e")
    found = ch.check()
    assert kinds(found) == ["body_overlap"]
    assert "a (x) and b (s) ran bodies on r0 at once" in found[0].summary


def test_celery_an_overlap_is_excused_by_a_lost_lease_or_a_lock_server_restart(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0)
    ch.send("b", 10.0)
    ch.body("a", 10.05, 10.5, lost=True)
    ch.body("b", 10.3, 10.6, pid=21, node="cw1@e2e")
    assert ch.check() == []
    ch.stamps[11][2]["lost"] = False
    assert kinds(ch.check()) == ["body_overlap"]
    ch.fault("lock_restart", 9.0, 9.2)  # 0.85 s before: within owner_ttl (2 s)
    assert ch.check() == []


def test_celery_a_lower_fence_running_after_a_higher_one_is_flagged(ch: CeleryHistory) -> None:
    ch.send("a", 10.0)
    ch.send("b", 10.0)
    ch.body("a", 10.05, 10.3, fence=600)
    ch.body("b", 10.4, 10.6, pid=21, node="cw1@e2e", fence=500)
    found = ch.check()
    assert kinds(found) == ["fence_order"]
    assert "b (fence 500) ran on r0 after a (fence 600)" in found[0].summary


def test_celery_a_resource_idle_while_a_task_waits_and_a_slot_is_free_is_flagged(
    ch: CeleryHistory,
) -> None:
    ch.send("h", 10.0)
    ch.body("h", 10.05, 10.5)
    ch.send("d", 10.1)  # parked behind h; its grant sat in transit until 13.5
    ch.body("d", 13.5, 13.6, pid=12)
    found = ch.check()
    assert kinds(found) == ["resource_idle"]
    assert "r0 ran no body for 3.00s" in found[0].summary and found[0].ops == ("d",)
    assert any(line.startswith("last body before: body h") for line in found[0].trace)


def test_celery_an_idle_resource_is_excused_while_every_slot_works_elsewhere(
    ch: CeleryHistory,
) -> None:
    ch.send("h", 10.0)
    ch.body("h", 10.05, 10.5)
    ch.send("d", 10.1)
    ch.body("d", 13.5, 13.6, pid=12)
    for i, pid in enumerate((31, 32, 33)):  # three slots run bodies on r1, r2
        ch.send(f"o{i}", 10.0, res=f"r{1 + i % 2}", mode="s")
        ch.body(f"o{i}", 10.4, 13.6, res=f"r{1 + i % 2}", mode="s", pid=pid)
    assert "resource_idle" in kinds(ch.check())  # one slot is still free
    ch.stamp(
        34, "prerun", 10.45, id="w", task="chaos.wait_x", node="cw1@e2e", res="r2", retries=0
    )  # fmt: skip  the fourth waits in its slot for r2
    ch.send("w", 10.4, res="r2", kind="wait")
    ch.body("w", 13.7, 13.8, res="r2", pid=34, kind="wait")
    assert "resource_idle" not in kinds(ch.check())


def test_celery_an_idle_resource_is_excused_while_a_fault_settles_or_an_adoption_stalls(
    ch: CeleryHistory,
) -> None:
    ch.send("h", 10.0)
    ch.body("h", 10.05, 10.5)
    ch.send("d", 10.1)
    ch.body("d", 13.5, 13.6, pid=12)
    ch.fault("kill_child", 10.4, pid=11, node="cw0@e2e")  # settles for 5.5 s
    assert ch.check() == []
    ch.faults.pop()
    ch.stamp(12, "stall", 10.6, id="d", res="r0", where="pre", until=13.0)
    assert ch.check() == []  # stalled to 13.0 (+ 2 heartbeats): 0.0 s left idle
    ch.stamps[12][-1]["until"] = 11.0
    assert kinds(ch.check()) == ["resource_idle"]


def test_celery_a_second_unique_send_while_the_first_has_not_ended_is_flagged(
    ch: CeleryHistory,
) -> None:
    ch.send("a", 10.0, kind="unique", key="k1")
    ch.send("a", 10.2, kind="unique", key="k1", dup_of="a")  # the duplicate got a's handle
    ch.send("b", 10.4, kind="unique", key="k1")  # a new task: a was still parked
    ch.body("a", 10.8, 11.0)
    ch.body("b", 11.1, 11.2, pid=12)
    found = ch.check()
    assert kinds(found) == ["unique_duplicate"]
    assert "sent b although a" in found[0].summary
    ch.fault("lock_restart", 10.1, 10.15)  # the key went with the lock server's data
    assert "unique_duplicate" not in kinds(ch.check())


def test_celery_participants_parse_and_the_short_run_leaves_out_known_failures() -> None:
    p = celery_participants
    assert p.parse_participants("all") == p.ALL_PARTICIPANTS
    assert p.parse_participants("none") == ()
    assert p.parse_participants("defer, kill_child") == ("defer", "kill_child")
    with pytest.raises(ValueError, match="unknown participants"):
        p.parse_participants("defer,meteor")
    assert set(p.KNOWN_TO_FAIL) <= set(p.ALL_PARTICIPANTS)
    assert not set(p.SHORT_RUN_PARTICIPANTS) & set(p.KNOWN_TO_FAIL)
    assert "defer" in p.SHORT_RUN_PARTICIPANTS


CELERY_SHORT_SEED = int(os.environ.get("CHAOS_CELERY_SHORT_SEED", "20261201"))
CELERY_SHORT_DURATION = float(os.environ.get("CHAOS_CELERY_SHORT_DURATION", "20"))


@pytest.mark.chaos_short
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_short_seeded_celery_chaos_run_finds_no_violation(tmp_path: Path) -> None:
    """~20 s of @locked tasks on two real prefork workers under the short run's
    participants (every one not in participants.KNOWN_TO_FAIL), then every check.

    Replay a failure with ``make chaos CELERY=only SEED=<seed> DURATION=20
    PARTICIPANTS=<participants>`` (the message gives it);
    ``CHAOS_CELERY_SHORT=all`` runs every participant here.
    """
    from chaos.celery_runner import CeleryConfig, CeleryRunner

    chosen = celery_participants.short_run_participants()
    cfg = CeleryConfig(
        seed=CELERY_SHORT_SEED,
        duration=CELERY_SHORT_DURATION,
        participants=chosen,
        out=str(tmp_path / "celery"),
        verbose=False,
    )
    outcome = CeleryRunner(cfg).run()
    stats = outcome.stats
    assert stats["bodies"] >= 10, stats  # the run did run tasks (never_ran checks each)
    faulty = set(chosen) & set(celery_participants.FAULT_PARTICIPANTS)
    assert sum(stats["faults"].values()) >= 2 or not faulty, stats
    assert outcome.ok, (
        f"seed={CELERY_SHORT_SEED} participants={','.join(chosen)}; replay: make chaos "
        f"CELERY=only SEED={CELERY_SHORT_SEED} DURATION={CELERY_SHORT_DURATION:g} "
        f"PARTICIPANTS={','.join(chosen) or 'none'}\n"
        + checker.render(checker.Report(stats, outcome.violations))
    )
