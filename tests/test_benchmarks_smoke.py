"""Keep the benchmarks from rotting: run each one very briefly.

No timing assertions: only that every benchmark produces results, that
celery-redislock shows no exclusion violation, and that the cost benchmark
finds equal command counts and no keyspace walk. The full run is
``make bench`` (docs/benchmarks.md). The benchmarks that start real
``celery worker`` subprocesses are marked ``e2e``, like tests/e2e.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis

from redis_server import RedisServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cost, peers  # noqa: E402


@pytest.mark.parametrize("relay", [False, True], ids=["open", "relay"])
@pytest.mark.parametrize("lib", peers.LIBS)
def test_contention_benchmark_runs_and_reports_every_metric(
    redis_url: str, lib: str, relay: bool
) -> None:
    res = peers.run_contention(redis_url, lib, procs=2, duration=0.5, relay=relay)

    assert res.killed == 0
    assert res.grants > 0
    assert len(res.per_process) == 2
    assert 0 < res.jain <= 1.0
    assert res.max_wait_ms >= 0
    table = peers.markdown_table([res])
    assert lib in table and res.mode in table
    if lib == "celery-redislock":
        assert res.errors == 0, res.first_error
        assert res.violations == 0
        assert res.lost_updates == 0
        assert res.handoffs_ms, "two FIFO processes must hand the lock to each other"


def test_contention_ratios_compare_celery_redislock_with_each_peer(redis_url: str) -> None:
    results = [peers.run_contention(redis_url, lib, 2, 0.5, relay=True) for lib in peers.LIBS]

    lines = peers.ratio_lines(results)

    assert len(lines) == len(peers.LIBS) - 1
    assert all("handoff p50" in line for line in lines)


def test_interleaved_trials_are_pooled_per_library_keeping_each_rounds_p50(
    redis_url: str,
) -> None:
    libs = ("celery-redislock", "python-redis-lock")
    seen: list[str] = []

    pooled = peers.run_trials(
        redis_url, 2, 0.4, 2, relay=True, libs=libs, progress=lambda r: seen.append(r.lib)
    )

    # Round 2 runs the libraries in rotated order.
    assert seen == [
        "celery-redislock",
        "python-redis-lock",
        "python-redis-lock",
        "celery-redislock",
    ]
    assert [r.lib for r in pooled] == list(libs)
    for res in pooled:
        assert res.mode == "relay"
        assert len(res.trial_p50s_ms) == 2
        assert res.duration == pytest.approx(0.8)
        assert res.grants == sum(res.per_process) > 0
        assert res.handoffs_ms == sorted(res.handoffs_ms)
    ours = pooled[0]
    assert ours.violations == ours.lost_updates == ours.errors == 0
    assert "per trial" in "\n".join(peers.ratio_lines(pooled))


def test_pooling_refuses_results_of_different_configurations() -> None:
    a = peers.ContentionResult(lib="celery-redislock", procs=2, duration=1.0, mode="relay")
    b = peers.ContentionResult(lib="celery-redislock", procs=4, duration=1.0, mode="relay")

    with pytest.raises(ValueError, match="mixes configurations"):
        peers.pool([a, b])
    with pytest.raises(ValueError, match="at least one"):
        peers.pool([])


def test_cost_benchmark_counts_equal_commands_without_scan(redis_url: str) -> None:
    runs = [cost.measure_costs(redis_url, n) for n in (10, 2000)]

    for op, counts in runs[-1].ops.items():
        if op == cost.SCAN_CONTRAST:
            continue
        assert counts, op
        assert counts == runs[0].ops[op], op
        assert cost.walks(counts) == 0, op
    assert all(run.freed_ok for run in runs)
    assert "acquire+release" in cost.markdown_table(runs)


def test_jain_index_is_one_for_equal_shares_and_lower_otherwise() -> None:
    assert peers.jain_index([5, 5, 5, 5]) == pytest.approx(1.0)
    assert peers.jain_index([10, 0]) == pytest.approx(0.5)
    assert peers.jain_index([]) == 0.0


def test_replica_benchmark_times_acquire_release_with_and_without_wait() -> None:
    from benchmarks import replicas

    res = replicas.run(rounds=2, ops=5)

    assert len(res.without) == len(res.with_wait) == 10
    assert res.ratio > 0
    assert "wait_replicas" in res.markdown()


def test_memory_benchmark_reports_every_scenario_and_key_kind() -> None:
    from benchmarks import memory
    from redis_server import resolve_binary

    # 100 locks in one owner: past REGISTRY_SPILL_AT, so its registry spills.
    report = memory.run(resolve_binary(), locks=100, owners=2, per_owner=2, waiters=3, few=3)

    assert [(r.scenario, r.lib) for r in report.rows] == [
        ("held", memory.OURS),
        ("held", memory.PRL),
        ("held", memory.PRL_EXPIRE),
        ("held", memory.REDIS_PY),
        ("owners", memory.OURS),
        ("few", memory.OURS),
        ("waiters", memory.OURS + " (one owner)"),
        ("waiters", memory.OURS + " (distinct owners)"),
    ]
    assert [r.items for r in report.rows] == [90, 90, 90, 90, 2, 4, 2, 2]
    kinds = {k.kind.split(" (")[0] for k in report.kinds if k.key}
    assert {
        "lock hash",
        "held registry hash",
        "held registry, main hash",
        "held registry, bucket index",
        "liveness key",
        "owners set",
        "wait queue zset",
        "req hash",
        "waits hash",
        "contended stream",
        "python-redis-lock key",
        "redis-py Lock key",
    } <= kinds
    assert any(k.startswith("held registry, one bucket of ") for k in kinds)
    assert all(k.encoding and k.usage > 0 for k in report.kinds if k.key)
    table = memory.markdown(report)
    assert f"redis-server {report.redis_version}" in table
    assert "celery-redislock / python-redis-lock" in table


@pytest.mark.e2e
def test_defer_benchmark_runs_each_mode_against_a_real_worker(
    redis_url: str, tmp_path: Path
) -> None:
    from benchmarks import defer as defer_bench

    results = defer_bench.run(redis_url, tmp_path, n_long=2, n_short=2, long_s=0.1, short_s=0.01)

    assert [r.mode for r in results] == list(defer_bench.MODES)
    for r in results:
        assert sorted(t.tag for t in r.tasks) == ["L0", "L1", "S0", "S1"]
    assert results[0].long_in_order  # defer keeps the FIFO order (a correctness check)
    table = defer_bench.markdown(results)
    assert all(mode in table for mode in defer_bench.MODES)


@pytest.mark.e2e
def test_limited_benchmark_runs_limited_and_unrelated_tasks_against_a_real_worker(
    redis_url: str, tmp_path: Path
) -> None:
    from benchmarks import limited_celery

    runs = limited_celery.run(
        redis_url,
        tmp_path,
        n_limited=5,
        n_plain=3,
        limited_s=0.05,
        plain_s=0.01,
        concurrency=4,
    )
    assert [r.mode for r in runs] == list(limited_celery.MODES)
    for r in runs:
        assert sorted(r.tasks) == sorted([f"L{i}" for i in range(5)] + ["P0", "P1", "P2"])
        assert 1 <= r.peak <= limited_celery.LIMIT  # never more than the limit at once
    table = limited_celery.markdown(runs)
    assert all(f"| {mode} |" in table for mode in limited_celery.MODES)


@pytest.mark.e2e
def test_defer_idle_benchmark_runs_mixed_wait_and_defer_tasks_against_a_real_worker(
    redis_url: str, tmp_path: Path
) -> None:
    from benchmarks import defer_idle

    [result] = defer_idle.run(
        redis_url, tmp_path, tasks=6, resources=2, wait_share=0.5, work=0.01, grant_ttl=30
    )
    assert (result.finished, result.tasks, result.left) == (6, 6, {})
    assert result.regrants == 0  # no grant waited for a pool slot until its TTL
    assert result.idle == pytest.approx(sum(result.gaps))
    assert "| 6/6 |" in defer_idle.markdown([result], "x")
    # The idle stretches: nobody runs a body although a task was sent and not ended.
    assert defer_idle._idle([0.0, 0.0], [1.0, 3.0], 0.5) == [(0.0, 0.5), (1.0, 2.5)]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_celery_contention_benchmark_reports_waits_and_exact_counts_of_a_real_worker(
    redis_url: str, tmp_path: Path
) -> None:
    from benchmarks import celery_e2e

    # One resource: both pool children contend for it.
    cell = celery_e2e.run_cell(redis_url, tmp_path, 1, 2, runs=1, tasks=10, resources=1)

    assert (cell.workers, cell.concurrency) == (1, 2)
    [run] = cell.runs
    assert run.complete
    assert run.expected == {"r0": 10}
    assert run.counts == run.expected  # every increment made under the lock counted
    assert len(run.waits) == 10 and all(w >= 0 for w in run.waits)
    table = celery_e2e.contention_markdown([cell])
    assert "| 1 x 2 | 1 | 10 |" in table
    assert "counts exact in every run: met (1 runs)" in table


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_celery_cost_benchmark_times_interleaved_plain_and_locked_batches(
    redis_url: str, tmp_path: Path
) -> None:
    from benchmarks import celery_e2e

    res = celery_e2e.run_cost(redis_url, tmp_path, "solo", rounds=2, batch=10, cpu_rounds=1)

    assert len(res.plain) == len(res.locked) == len(res.peer) == 2
    assert all(rate > 0 for rate in res.plain + res.locked + res.peer)
    assert res.cpu is None  # solo: no main process apart from the one running the task
    assert "target 3b (@locked costs <= 10% tasks/s): " in celery_e2e.cost_markdown([res])

    # The locks on a redis-server of their own: taken there, not on the broker's;
    # prefork, with the CPU split by process.
    with RedisServer() as own:
        res = celery_e2e.run_cost(
            redis_url,
            tmp_path / "own",
            "prefork",
            rounds=1,
            batch=10,
            lock_url=own.url,
            cpu_rounds=1,
            cpu_batch=30,
        )
        assert res.store == "own" and len(res.locked) == len(res.peer) == 1
        locks = redis.Redis.from_url(own.url)
        try:
            # Every lock was released, so the fencing counter is what is left.
            assert locks.keys("{e2e*}:fence") and not locks.keys("cebench-rp:*")
        finally:
            locks.close()
    text = celery_e2e.cost_markdown([res])
    assert "on a Redis of their own" in text

    cpu = res.cpu
    assert cpu is not None
    if cpu.skipped is not None:  # a kernel without schedstats: said, not measured
        assert "not measured: " in text
        return
    assert cpu.batch == 30 and cpu.rounds == 1
    assert {"main", "child", "locks"} <= set(cpu.processes)
    for kind in "plr":
        assert cpu.intervals[kind] == [9]  # one run of 10 per kind: 9 intervals
        for process in cpu.processes:
            us = cpu.cpu_us(kind, process)
            assert us >= 0, (kind, process, us)  # NaN fails too
        assert cpu.total_us(kind) >= 0
        assert cpu.wall_us(kind) > 0
    assert cpu.read_us >= 0
    assert "CPU by process, prefork -c 1, locks on a Redis of their own: 1 round of 30" in text
    for label in ("worker main process", "pool child", "locks' redis-server", "| total "):
        assert label in text, label
    assert "schedstat" in text


def test_celery_cpu_split_pairs_consecutive_bodies_of_one_kind_and_says_when_skipped() -> None:
    from benchmarks import celery_e2e

    # Two processes; the interval across the change of kind (p -> l) is left out.
    stamps = [
        [0.0, "p", [0, 0]],
        [0.001, "p", [100_000, 10_000]],
        [0.002, "l", [900_000, 90_000]],
        [0.004, "l", [1_200_000, 150_000]],
        [0.006, "l", [1_500_000, 230_000]],
    ]
    cpu, wall, count = celery_e2e.cycle_cpu(stamps, ["main", "child"])

    assert cpu == {"p": {"main": 100, "child": 10}, "l": {"main": 300, "child": 70}}
    assert wall == pytest.approx({"p": 1000, "l": 2000})
    assert count == {"p": 1, "l": 2}
    split = celery_e2e.CpuSplit(30, ["main", "child"], skipped="no schedstat")
    assert "not measured: no schedstat" in celery_e2e.cpu_markdown(split, "own")


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_celery_profile_splits_the_locked_call_and_the_redis_py_lock_call(
    redis_url: str, tmp_path: Path
) -> None:
    from benchmarks import celery_e2e

    prof = celery_e2e.run_profile(redis_url, tmp_path, batch=10)

    assert prof.locked_call > prof.plain_call > 0
    assert prof.acquire > 0 and prof.release > 0 and prof.round_trips > 0
    assert prof.peer_call > prof.plain_call and prof.peer_socket > 0 and prof.peer_server > 0
    table = celery_e2e.profile_markdown(prof)
    assert "the task call inside redis-py's Lock, for contrast" in table


# -- fleet scale (benchmarks/fleet.py): tiny sizes, counts only ---------------


def test_fleet_heartbeats_tick_every_node_and_block_the_watching_children(redis_url: str) -> None:
    from benchmarks import fleet

    (idle,) = fleet.heartbeats(redis_url, [3], window=1.0, interval=0.5, threads=2)
    assert idle.counts["blpop/s"] == 0  # an idle child's watcher sends nothing
    (row,) = fleet.heartbeats(redis_url, [3], window=1.0, interval=0.5, threads=2, watching=2)

    assert row.per_second and row.cost.wall_s > 0
    assert row.counts["owners"] == 3 * fleet.CHILDREN
    # Every child stayed alive: no tick found a dead or lost owner.
    assert row.counts["tick_errors"] == 0
    assert row.counts["evalsha/s"] > 0  # node_heartbeat.lua and defer_tick.lua
    assert row.counts["blpop/s"] > 0  # the lost-owner watchers of children holding a lock
    assert row.counts["blmove/s"] > 0  # the dispatcher's wait
    assert {"pexpire", "hgetall"} <= set(row.cost.calls)  # node_heartbeat.lua ran
    assert row.cost.walks == 0


def test_fleet_reconcile_cleans_exactly_the_dead_owners(redis_url: str) -> None:
    from benchmarks import fleet

    (row,) = fleet.reconcile(redis_url, [100], dead_share=0.05)

    assert row.counts["owners_seen"] == 100
    assert row.counts["dead"] == row.counts["cleaned"] == row.counts["released"] == 5
    assert row.counts["left"] == 95
    assert row.counts["errors"] == 0
    assert row.cost.calls.get("sscan", 0) >= 1
    assert row.cost.walks == 0


def test_fleet_workers_starting_at_once_each_evict_their_predecessor(redis_url: str) -> None:
    from benchmarks import fleet

    at_once = fleet.startups(redis_url, [3], children=2, locks=2)
    paced = fleet.startups(redis_url, [3], children=2, locks=2, concurrency=2)

    assert [r.scenario for r in at_once + paced] == ["startup", "startup (2 threads)"]
    for row in at_once + paced:
        assert row.counts["owners"] == 3  # every worker owns its node record
        assert row.counts["predecessor_grants"] == 12
        assert row.counts["locks_left"] == 0  # every predecessor's lock freed
        assert row.cost.calls["info"] == 3  # each worker's eviction check
        assert row.cost.walks == 0
    # The first run may load scripts the server did not have yet.
    calls = [{k: v for k, v in r.cost.calls.items() if k != "script|load"} for r in at_once + paced]
    assert calls[0] == calls[1]


def test_fleet_cleanup_frees_exactly_the_dead_childrens_locks(redis_url: str) -> None:
    from benchmarks import fleet

    rows = fleet.cleanup(redis_url, [20], children=4)

    assert [r.scenario for r in rows] == ["cleanup (children died)", "cleanup (worker died)"]
    for row in rows:
        assert row.counts["owners"] == 4, row.scenario
        assert row.counts["held"] == row.counts["freed"] == 20, row.scenario
        assert row.counts["ok"], row.scenario
        assert row.cost.walks == 0, row.scenario


def test_fleet_cleanup_commands_do_not_depend_on_unrelated_keys(redis_url: str) -> None:
    from benchmarks import fleet

    plain = fleet.cleanup(redis_url, [8], children=2)
    crowded = fleet.cleanup(redis_url, [8], children=2, unrelated=3000)

    assert [r.cost.calls for r in plain] == [r.cost.calls for r in crowded]


def test_fleet_report_gives_ratios_and_verdicts_per_scenario() -> None:
    from benchmarks import fleet

    def row(scenario: str, size: int, commands: int, per_second: bool = False) -> fleet.Row:
        cost = fleet.Cost(
            {"evalsha": commands // 2, "hset": commands - commands // 2},
            {"evalsha": 10 * commands, "hset": commands},
            cpu_s=commands / 1e5,
            wall_s=2.0,
        )
        return fleet.Row(scenario, size, "n", cost, {}, per_second=per_second)

    run = fleet.FleetRun(
        fleet.QUICK,
        heartbeats=[row("heartbeats", 10, 100, True), row("heartbeats", 20, 200, True)],
        reconcile=[row("reconcile", 100, 300), row("reconcile", 200, 600)],
        # Superlinear: four times the commands for twice the workers.
        startup=[row("startup", 3, 100), row("startup", 6, 400)],
        cleanup=[
            row("cleanup (children died)", 16, 100),
            row("cleanup (worker died)", 16, 100),
            row("cleanup (children died)", 32, 180),
            row("cleanup (worker died)", 32, 180),
        ],
        keyspace=[(row("reconcile", 100, 300), row("reconcile", 100, 300))],
    )

    text = fleet.render(run, "cmd", "7.0.0", ("0", "0"), 1.0)

    assert "1. target 4.x (linear in what it touches: nodes" in text
    assert "2. target 4.x (linear in what it touches: owners): met" in text
    assert "3. target 4.x (linear in what it touches: workers" in text
    assert "NOT met (size x2.00: commands x4.00" in text
    assert "4a. target 4.x (linear in locks): met" in text
    assert "4b. target 4.x (linear in locks): met" in text
    assert "Nodes per Redis core at a 1 s interval" in text
    assert "SCAN + KEYS calls in every measured window: 0 -> met" in text


def test_cycle_benchmark_times_every_library_and_counts_round_trips_and_commands(
    redis_url: str,
) -> None:
    results = cost.measure_cycles(redis_url, rounds=2, ops=5)

    assert [(r.lib, r.resources) for r in results] == [
        (lib, n) for n in (1, 5) for lib in cost.CYCLE_LIBS
    ]
    for r in results:
        assert len(r.samples_us) == 10 and len(r.round_p50s_us) == 2
        assert r.round_trips > 0 and r.commands_per_cycle > 0 and r.server_us > 0
    ours = {r.resources: r for r in results if r.lib == "celery-redislock"}
    assert ours[1].round_trips == ours[5].round_trips == 2  # one call each way
    assert "celery-redislock" in cost.cycle_table(results)
    lines = cost.cycle_target_lines(results)
    assert len(lines) == 2 and all(line.startswith("target 1 (") for line in lines)


def test_zero_length_critical_section_rounds_count_commands_and_state_target_2(
    redis_url: str,
) -> None:
    libs = ("celery-redislock", "python-redis-lock")
    pooled = peers.run_trials(redis_url, 2, 0.4, 2, 0.0, libs=libs, count_commands=True)

    for res in pooled:
        assert res.mode == "open" and res.grants > 0
        assert len(res.trial_throughputs) == 2
        assert res.commands_per_grant > 0
    assert pooled[0].violations == pooled[0].lost_updates == pooled[0].errors == 0
    assert "commands per grant" in "\n".join(peers.throughput_lines(pooled))
    lines = peers.throughput_target_lines(pooled, [])
    assert len(lines) == 1 and lines[0].startswith("target 2 (2 processes")


def test_server_work_counts_each_librarys_instructions_and_commands_per_cycle() -> None:
    from benchmarks import server_work

    with server_work.callgrind_server() as server:
        rows = server_work.measure(server, cycles=3)
        upkeep = server_work.measure_upkeep(server, calls=3)

    by = {(r.lib, r.resources): r for r in rows}
    assert set(by) == set(server_work.ROWS)
    assert all(r.instructions > 0 for r in rows)
    # The commands are exact: a task's grant runs the same ones as a plain lock.
    ours = by[("celery-redislock", 1)].commands
    assert ours == by[("celery-redislock @locked", 1)].commands
    assert ours["evalsha"] == 2 and "set" in ours and "del" not in ours
    assert by[("redis-py Lock", 1)].commands["evalsha"] == 1
    assert by[(server_work.FLOOR, 1)].commands == ours  # the same commands, no logic
    assert set(upkeep) == {"heartbeat.lua, one owner", "node tick, 8 children"}
    assert all(v > 0 for v in upkeep.values())
    text = server_work.markdown(rows)
    assert "| celery-redislock @locked | 1 |" in text and "1.00x" in text


def test_limited_benchmark_runs_every_library_and_prints_its_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import limited

    code = limited.main(["--quick", "--procs", "6", "--duration", "0.3", "--window", "1.2"])

    out = capsys.readouterr().out
    assert code == 0, out  # celery-redislock never had more than N holders
    assert "| hold ms | library | acquisitions/s |" in out
    assert "| library | expiry setting | recovery s, per round |" in out
    for lib in limited.LIBS:
        assert f"| 0 | {lib} |" in out and f"| 5 | {lib} |" in out
    targets = out.split("## Targets", 1)[1]
    assert targets.count("throughput at least each peer's") == 2
    assert "at most 4 holders at once, every library, every run:" in targets
    assert "recovery after a SIGKILLed holder within owner_ttl (1 s):" in targets


def test_limited_benchmark_names_a_library_that_exceeds_the_limit() -> None:
    from benchmarks import limited

    s = limited.Settings(holds=(0.0,))

    def run(lib: str, peak: int) -> limited.Run:
        return limited.Run(
            lib, 0.0, 2, 1.0, [5, 5], [1.0], peak, round_rates=[10.0], recoveries=[0.5]
        )

    throughput = [run(limited.OURS, 4), run(limited.DRAMATIQ, 4), run(limited.LIMITERS, 6)]
    recovery = [run(limited.OURS, 4), run(limited.DRAMATIQ, 4), run(limited.LIMITERS, 4)]
    recovery[1].recoveries = [None]

    lines = limited.target_lines(throughput, recovery, s)

    assert any("NOT met: exceeded by redis-limiters 6" in line for line in lines)
    assert lines[-1].startswith("recovery after a SIGKILLed holder")
    assert "met; 0.50 s" in lines[-1] and "> 8 (not)" in lines[-1]


def test_asyncio_benchmark_runs_and_celery_redislock_serves_in_arrival_order(
    redis_url: str,
) -> None:
    import asyncio

    from benchmarks import asyncio_bench

    cycles, fifos, tputs = asyncio.run(
        asyncio_bench.run_all(redis_url, cycles=20, coros=8, duration=0.3)
    )

    assert [c.lib for c in cycles] == list(asyncio_bench.LIBS)
    assert all(c.p50_us > 0 for c in cycles)
    ours = fifos[0]
    assert ours.lib == "celery-redislock"
    assert ours.inversions == 0 and ours.order == list(range(8))
    assert all(t.grants > 0 for t in tputs)
    assert tputs[0].errors == 0
    table = asyncio_bench.markdown(cycles, fifos, tputs)
    assert "redis.asyncio Lock" in table
