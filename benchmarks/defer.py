"""Head-of-line blocking: ``on_busy="defer"`` against ``"wait"`` and ``"retry"``.

A real ``celery worker -P prefork -c 2`` (the end-to-end harness of
``tests/e2e``) gets ``--long`` tasks of ``--long-seconds`` on one resource
(``bench:repo``), enqueued ahead of ``--short`` tasks of ``--short-seconds``
on resources of their own. Each long task is sent once the previous one has
reached the lock (holds it, waits in line, is deferred or is retried), or
0.5 s later at most (with ``wait`` a task behind two busy slots is not even
delivered), so that the enqueue order is their order in line. For each mode it reports
every task's enqueue -> finish latency and the finish order:

* ``defer``: the parked long tasks free their slots, so the short ones run
  at once; the long ones run one after another, in enqueue order;
* ``wait``: the waiting long tasks hold both slots, the short ones are stuck
  behind them;
* ``retry``: the slots are free, but the long tasks leave the line and come
  back on their countdown, out of order.

Usage::

    .venv/bin/python -m benchmarks.defer [--long 4] [--short 8] [--long-seconds 1.5]
        [--short-seconds 0.05] [--modes defer,wait,retry] [--rounds 3]

Starts its own redis-server (as ``benchmarks.run`` does) and one worker for
all modes (each run ``--rounds`` times: retry's order varies from run to
run). Not a timed test: tests/test_benchmarks_smoke.py runs it small.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import Cluster, wait_for  # noqa: E402
from redis_server import RedisServer  # noqa: E402

MODES = ("defer", "wait", "retry")
#: Longest wait (s) for a long task to reach the lock before the next is sent
#: (with "wait", a task behind two busy pool slots is not even delivered).
GATE = 0.5


@dataclass
class TaskTiming:
    """One task of a run: what it was, when it finished, in which place."""

    tag: str
    long: bool
    latency: float
    place: int


@dataclass
class ModeResult:
    mode: str
    tasks: list[TaskTiming]

    @property
    def short(self) -> list[TaskTiming]:
        return [t for t in self.tasks if not t.long]

    @property
    def long(self) -> list[TaskTiming]:
        return [t for t in self.tasks if t.long]

    @property
    def long_in_order(self) -> bool:
        """Did the long tasks finish in the order they were enqueued?"""
        places = [t.place for t in sorted(self.long, key=lambda t: int(t.tag[1:]))]
        return places == sorted(places)


def _reached(
    c: Cluster, mode: str, result: object, i: int, before: int, queue: str, lock: str
) -> bool:
    """Whether long task ``i`` has asked for the lock (holds it, or waits in line)."""
    state = getattr(result, "state", "PENDING")
    if state in ("SUCCESS", "FAILURE"):
        return True
    if i == 0:
        return bool(c.lock_redis.hlen(lock))
    if mode == "defer":
        return bool(state == "DEFERRED")
    if mode == "retry":
        return bool(state == "RETRY")
    return int(c.lock_redis.zcard(queue)) > before


def run_mode(
    c: Cluster, mode: str, n_long: int, n_short: int, long_s: float, short_s: float
) -> ModeResult:
    """Enqueue the long tasks, then the short ones; wait for all; time them."""
    c.data.delete("e2e:bench-finish")
    sent: dict[str, float] = {}
    results = []
    queue, lock = c.key("q", "bench:repo"), c.key("lock", "bench:repo")
    for i in range(n_long):
        # Each long task reaches the lock before the next is sent: two tasks
        # delivered to the two pool children at once ask for the lock in no
        # defined order, and the enqueue order would not be the order in line.
        before = int(c.lock_redis.zcard(queue))
        sent[f"L{i}"] = time.time()
        result = c.send(f"bench_{mode}", "repo", f"L{i}", long_s)
        results.append(result)
        reached = functools.partial(_reached, c, mode, result, i, before, queue, lock)
        give_up = time.monotonic() + GATE
        while not reached() and time.monotonic() < give_up:
            time.sleep(0.005)
    for i in range(n_short):
        sent[f"S{i}"] = time.time()
        results.append(c.send(f"bench_{mode}", f"s{i}", f"S{i}", short_s))
    total = n_long + n_short
    wait_for(
        lambda: c.data.llen("e2e:bench-finish") >= total,
        timeout=60 + 3 * n_long * long_s,
        what=f"{mode}: every task finished",
        on_timeout=c.report,
    )
    finished = [json.loads(x) for x in c.data.lrange("e2e:bench-finish", 0, -1)]
    tasks = [
        TaskTiming(f["tag"], f["tag"].startswith("L"), f["at"] - sent[f["tag"]], place)
        for place, f in enumerate(finished, start=1)
    ]
    for r in results:
        r.forget()
    return ModeResult(mode, tasks)


def run(
    redis_url: str,
    workdir: Path,
    *,
    modes: tuple[str, ...] = MODES,
    n_long: int = 4,
    n_short: int = 8,
    long_s: float = 1.5,
    short_s: float = 0.05,
) -> list[ModeResult]:
    """Start one prefork worker (-c 2) and run each mode in turn."""
    c = Cluster(redis_url, workdir, owner_ttl=10, heartbeat=1)
    try:
        c.start_worker("bench", concurrency=2)
        return [run_mode(c, m, n_long, n_short, long_s, short_s) for m in modes]
    finally:
        c.close()


def markdown(results: list[ModeResult]) -> str:
    """The per-mode summary and the per-task table."""
    lines = [
        "| mode | short tasks: max / median latency (s) | long tasks: latencies (s), "
        "in enqueue order | long tasks finished in enqueue order | finish order |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        shorts = [t.latency for t in r.short]
        longs = [f"{t.latency:.2f}" for t in sorted(r.long, key=lambda t: int(t.tag[1:]))]
        order = " ".join(t.tag for t in sorted(r.tasks, key=lambda t: t.place))
        lines.append(
            f"| {r.mode} | {max(shorts):.2f} / {statistics.median(shorts):.2f} | "
            f"{', '.join(longs)} | {'yes' if r.long_in_order else 'no'} | {order} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long-seconds", type=float, default=1.5)
    ap.add_argument("--short-seconds", type=float, default=0.05)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(workdir=Path(tmp) / "r") as server:
        results = run(
            server.url,
            Path(tmp) / "w",
            modes=tuple(m for m in args.modes.split(",") for _ in range(args.rounds)),
            n_long=args.long,
            n_short=args.short,
            long_s=args.long_seconds,
            short_s=args.short_seconds,
        )
    print(markdown(results))


if __name__ == "__main__":
    main()
