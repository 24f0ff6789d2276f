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
    ) -> None:
        """acquire at t, granted t+0.01, section [t+0.02, t+0.02+hold], release after."""
        if fence is None:
            self.fence += 1
            fence = self.fence
        self.ev(proc, "acq", t, op=op, x=list(x), s=list(s), timeout=5.0)
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
        out=str(tmp_path / "run"),
    )
    outcome = Runner(cfg).run()
    stats = outcome.stats
    assert stats["sections"] > 50, stats  # the run did lock things
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
