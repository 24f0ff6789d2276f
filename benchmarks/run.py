"""Run every benchmark in one go against one throw-away redis-server.

Usage::

    make bench
    .venv/bin/python -m benchmarks.run [--duration 5] [--procs 4,8] [--out FILE]

Starts redis-server (the one ``tests/redis_server.py`` picks: ``redis-server``
from PATH, or ``REDISLOCK_TEST_REDIS``) on a free loopback port, runs the
contention benchmark (open mode once per library and process count; relay
mode, the handoff measurement, as ``--trials`` interleaved rounds of every
library, pooled; open mode with a zero-length critical section as
``--zero-trials`` interleaved rounds of celery-redislock and
python-redis-lock, with Redis commands per grant), the uncontended cycle
benchmark (``--cycle-rounds`` interleaved rounds of ``--cycle-ops`` cycles
per library, one and five resources) and the cost benchmark, prints a
markdown report with a ``target ...: met`` / ``NOT met`` line per target and
writes it to ``benchmarks/results.md``. Bounded: about ``6 x duration + 6 x
trials x trial-duration + 4 x zero-trials x zero-duration`` seconds plus the
cycles and start-up (about 2.5 minutes with the defaults), then the
fleet-scale benchmark (``benchmarks/fleet.py``, on a redis-server of its
own; ``--fleet quick`` or ``off`` to shorten it).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks import cost, fleet, peers  # noqa: E402
from benchmarks.machine import cpu_model, load_average  # noqa: E402
from redis_server import RedisServer  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results.md"
#: Libraries of the zero-length critical section runs (target 2's pair).
ZERO_CS_LIBS = ("celery-redislock", "python-redis-lock")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per open-mode run")
    parser.add_argument(
        "--trials", type=int, default=5, help="interleaved rounds of every library in relay mode"
    )
    parser.add_argument(
        "--trial-duration", type=float, default=2.0, help="seconds per relay round and library"
    )
    parser.add_argument("--procs", default="4,8", help="contending process counts, comma-separated")
    parser.add_argument("--cs", type=float, default=0.0005, help="critical section sleep, seconds")
    parser.add_argument(
        "--keys", default="100,50000", help="unrelated keyspace sizes for the cost benchmark"
    )
    parser.add_argument(
        "--fleet",
        choices=("default", "quick", "off"),
        default="default",
        help="fleet-scale benchmark sizes (benchmarks/fleet.py)",
    )
    parser.add_argument(
        "--zero-duration",
        type=float,
        default=2.0,
        help="seconds per round of the zero-length critical section open runs",
    )
    parser.add_argument(
        "--zero-trials",
        type=int,
        default=3,
        help="interleaved rounds of the zero-length critical section open runs",
    )
    parser.add_argument(
        "--cycle-rounds", type=int, default=7, help="interleaved rounds of uncontended cycles"
    )
    parser.add_argument(
        "--cycle-ops", type=int, default=300, help="cycles per round, library and shape"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report file")
    args = parser.parse_args(argv)
    procs = [int(p) for p in args.procs.split(",")]
    sizes = [int(k) for k in args.keys.split(",")]
    command = ".venv/bin/python -m benchmarks.run" + (
        " " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else ""
    )

    started = time.monotonic()
    load_before = load_average()
    server = RedisServer()
    server.start()
    try:
        contention: list[peers.ContentionResult] = []
        for n in procs:
            for lib in peers.LIBS:
                res = peers.run_contention(server.url, lib, n, args.duration, args.cs)
                _progress(res)
                contention.append(res)
        for n in procs:
            contention.extend(
                peers.run_trials(
                    server.url,
                    n,
                    args.trial_duration,
                    args.trials,
                    args.cs,
                    relay=True,
                    progress=_progress,
                )
            )
        zero: list[peers.ContentionResult] = []
        for n in procs:
            zero.extend(
                peers.run_trials(
                    server.url,
                    n,
                    args.zero_duration,
                    args.zero_trials,
                    0.0,
                    libs=ZERO_CS_LIBS,
                    progress=_progress,
                    count_commands=True,
                )
            )
        cycles = cost.measure_cycles(
            server.url,
            args.cycle_rounds,
            args.cycle_ops,
            progress=lambda text: print(f"# {text}", file=sys.stderr, flush=True),
        )
        costs = [cost.measure_costs(server.url, k) for k in sizes]
    finally:
        server.close()
    fleet_report = ""
    if args.fleet != "off":
        quick = args.fleet == "quick"
        fleet_report = fleet.run(
            fleet.QUICK if quick else fleet.Sizes(),
            ".venv/bin/python -m benchmarks.fleet" + (" --quick" if quick else ""),
            lambda m: print(f"# fleet {m}", file=sys.stderr, flush=True),
        )
    elapsed = time.monotonic() - started

    report = render(
        contention,
        costs,
        args,
        command,
        server.version_string,
        load_before,
        load_average(),
        elapsed,
        zero=zero,
        cycles=cycles,
    )
    if fleet_report:
        report += "\n" + fleet_report
    print(report)
    args.out.write_text(report)
    print(f"\n(written to {args.out})", file=sys.stderr)
    return 0


def _progress(res: peers.ContentionResult) -> None:
    print(
        f"# {res.mode:5} {res.lib:18} procs={res.procs} grants/s={res.throughput:.0f} "
        f"handoff_p50_ms={res.handoff_p50_ms:.3f} jain={res.jain:.3f} "
        f"violations={res.violations} errors={res.errors}",
        file=sys.stderr,
        flush=True,
    )


def _error_lines(contention: list[peers.ContentionResult]) -> list[str]:
    lines = []
    for r in contention:
        if r.errors:
            text = r.first_error.strip()
            first = text.splitlines()[-1] if text else "?"
            lines.append(
                f"- errors in {r.mode} {r.lib} procs={r.procs}: {r.errors}, first: `{first}`"
            )
    return [*lines, ""] if lines else []


def render(
    contention: list[peers.ContentionResult],
    costs: list[cost.CostRun],
    args: argparse.Namespace,
    command: str,
    redis_version: str,
    load_before: str,
    load_after: str,
    elapsed: float,
    *,
    zero: list[peers.ContentionResult] | None = None,
    cycles: list[cost.CycleResult] | None = None,
) -> str:
    """The markdown report."""
    zero = zero or []
    cycles = cycles or []
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ours = [r for r in contention if r.lib == "celery-redislock"]
    jain_min = min((r.jain for r in ours if r.mode == "open"), default=0.0)
    violations = sum(r.violations + r.lost_updates for r in ours)
    walks = sum(
        cost.walks(ops) for run in costs for op, ops in run.ops.items() if op != cost.SCAN_CONTRAST
    )
    equal = all(
        costs[0].ops[op] == costs[-1].ops[op] for op in costs[-1].ops if op != cost.SCAN_CONTRAST
    )
    lines = [
        "# celery-redislock benchmark results",
        "",
        f"- date: {now}",
        f"- command: `{command}` (or `make bench`); total {elapsed:.0f} s",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), load average before/after "
        f"{load_before} / {load_after} (1/5/15 min; other jobs share the machine)",
        f"- redis-server {redis_version} on 127.0.0.1 (loopback TCP, no persistence), "
        f"started by the benchmark; Python {platform.python_version()}, "
        f"redis-py {_version('redis')}, python-redis-lock {_version('python-redis-lock')}, "
        f"celery-redislock {_version('celery-redislock')}",
        f"- open runs: {args.duration:g} s per library; relay runs: {args.trials} interleaved "
        f"rounds of {args.trial_duration:g} s per library (rotated order), pooled",
        f"- critical section = sleep "
        f"{args.cs * 1000:g} ms; redis-py Lock with its default sleep={peers.REDIS_PY_SLEEP:g} s "
        "(polling); python-redis-lock's default (BLPOP on a signal list); celery-redislock "
        "`LockManager.acquire(resource, timeout=None)`; every client `socket_timeout=None`",
        "",
        "## Contention (one exclusive lock, N forked processes)",
        "",
        "*open*: each process asks again right after releasing (an unfair lock lets the "
        "releaser barge back in). *relay*: a releaser asks again only once another process "
        "has entered, so every grant is a handoff to a process that was already waiting. "
        "Handoff = from the holder calling release() to the next (different) holder's "
        "acquire() returning. Relay rows pool every round; the ratios below also give "
        "each round's p50 ratio.",
        "",
        peers.markdown_table(contention),
        "",
        *_error_lines(contention),
        "Ratios (same run; handoff from relay runs, throughput and fairness from open runs):",
        "",
        *peers.ratio_lines(contention),
        "",
        "## Contention with a zero-length critical section (open mode, interleaved rounds)",
        "",
        f"{args.zero_trials} rounds of {args.zero_duration:g} s per library and process count, "
        "rotated order, pooled. Redis commands per grant: every command the server ran during "
        "the rounds (INFO commandstats, scripts' own commands included) / grants.",
        "",
        peers.markdown_table(zero) if zero else "(not run)",
        "",
        *peers.throughput_lines(zero),
        "",
        "## Uncontended lock cycle (acquire + release, one process, interleaved rounds)",
        "",
        f"{args.cycle_rounds} rounds of {args.cycle_ops} cycles per library and shape, rotated "
        "order, every cycle one sample. Five resources: one call for celery-redislock, five "
        "locks one after the other for the peers (one name per call). Ratios against redis-py "
        "Lock's one-resource cycle. Round trips counted on the client's connections; server "
        "commands from INFO commandstats.",
        "",
        cost.cycle_table(cycles) if cycles else "(not run)",
        "",
        "## Cost against keyspace size (Redis commands per operation, from INFO commandstats)",
        "",
        cost.markdown_table(costs),
        "",
        "## Targets",
        "",
        f"- Jain index >= 0.99 (open runs): {jain_min:.3f} -> "
        f"{'met' if jain_min >= 0.99 else 'NOT met'}",
        f"- zero exclusion violations (overlaps + lost updates): {violations} -> "
        f"{'met' if violations == 0 else 'NOT met'}",
    ]
    for n in sorted({r.procs for r in ours}):
        by = {r.lib: r for r in contention if r.mode == "relay" and r.procs == n}
        me, prl, rp = (by.get(x) for x in peers.LIBS)
        if me and prl and rp:
            ok = me.handoff_p50_ms <= prl.handoff_p50_ms
            pairs = list(zip(me.trial_p50s_ms, prl.trial_p50s_ms))
            at_or_below = sum(a <= b for a, b in pairs)
            median_round = statistics.median(a / b for a, b in pairs) if pairs else math.nan
            lines.append(
                f"- handoff p50 <= python-redis-lock's, far below redis-py's ({n} procs, relay, "
                f"pooled): {me.handoff_p50_ms:.3f} vs {prl.handoff_p50_ms:.3f} vs "
                f"{rp.handoff_p50_ms:.3f} ms -> "
                f"{'met' if ok else 'NOT met against python-redis-lock'} "
                f"(at or below in {at_or_below} of {len(pairs)} rounds, median round ratio "
                f"{median_round:.2f}x); "
                f"{'met' if me.handoff_p50_ms * 10 < rp.handoff_p50_ms else 'NOT met'} "
                "against redis-py"
            )
    relay = [r for r in contention if r.mode == "relay"]
    lines += [f"- {line}" for line in cost.cycle_target_lines(cycles)]
    lines += [f"- {line}" for line in peers.throughput_target_lines(zero, relay)]
    lines.append(
        f"- cost independent of keyspace, zero SCAN/KEYS: counts equal = {equal}, "
        f"SCAN+KEYS = {walks} -> {'met' if equal and walks == 0 else 'NOT met'}; "
        f"every dead owner's locks freed: {all(run.freed_ok for run in costs)}"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
