"""Limited resources under Celery: a partner API limited to 3, and unrelated tasks.

A real ``celery worker -P prefork -c 8`` (the end-to-end harness of
``tests/e2e``) gets ``--limited`` tasks of ``--limited-seconds`` that each
take one slot of ``bench:api:partner`` (``@locked(limited={...: 3})``),
then ``--plain`` tasks of ``--plain-seconds`` that take no lock, all sent at
once, in that order. For each mode of the limited tasks it reports the
latency (enqueue -> finish) of both kinds, when the last of each finished,
and the most limited bodies seen running at once:

* ``defer``: a limited task that finds the partner's 3 slots taken parks in
  line and gives its pool slot back, so the unrelated tasks run at once,
  while the limited ones run 3 at a time;
* ``wait``: the limited tasks waiting for a slot hold the 5 other pool
  slots, and the unrelated tasks wait behind them.

Usage::

    .venv/bin/python -m benchmarks.limited_celery [--limited 40] [--plain 40]
        [--limited-seconds 0.3] [--plain-seconds 0.05] [--modes defer,wait]

Starts its own redis-server (as ``benchmarks.run`` does) and one worker for
both modes. Not a timed test: tests/test_benchmarks_smoke.py runs it small.
"""

from __future__ import annotations

import argparse
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

MODES = ("defer", "wait")
#: The partner's limit (``bench_limited_*`` in tests/e2e/proj.py).
LIMIT = 3
CONCURRENCY = 8


@dataclass
class Run:
    """One mode's run: each task's kind, latency and body span (epoch s)."""

    mode: str
    #: tag -> (enqueue -> finish, body start, body end), the tag ``L<i>`` or ``P<i>``.
    tasks: dict[str, tuple[float, float, float]]
    sent_at: float

    def latencies(self, kind: str) -> list[float]:
        return [lat for tag, (lat, _, _) in self.tasks.items() if tag[0] == kind]

    def last(self, kind: str) -> float:
        """Seconds from the first send until the last task of ``kind`` finished."""
        return max(end for tag, (_, _, end) in self.tasks.items() if tag[0] == kind) - self.sent_at

    @property
    def peak(self) -> int:
        """Most limited bodies running at once (from their start and end times)."""
        events = sorted(
            (t, step)
            for tag, (_, start, end) in self.tasks.items()
            if tag[0] == "L"
            for t, step in ((start, 1), (end, -1))
        )
        now = best = 0
        for _, step in events:
            now += step
            best = max(best, now)
        return best

    @property
    def plain_before_limited(self) -> int:
        """Unrelated tasks that finished before the limited tasks' median finish."""
        ends = sorted(end for tag, (_, _, end) in self.tasks.items() if tag[0] == "L")
        middle = ends[len(ends) // 2]
        return sum(1 for tag, (_, _, end) in self.tasks.items() if tag[0] == "P" and end < middle)


def run_mode(
    c: Cluster, mode: str, n_limited: int, n_plain: int, limited_s: float, plain_s: float
) -> Run:
    """Send the limited tasks, then the unrelated ones; wait for all; time them."""
    c.data.delete("e2e:bench-finish")
    sent: dict[str, float] = {}
    results = []
    first = time.time()
    for i in range(n_limited):
        sent[f"L{i}"] = time.time()
        results.append(c.send(f"bench_limited_{mode}", "partner", f"L{i}", limited_s))
    for i in range(n_plain):
        sent[f"P{i}"] = time.time()
        results.append(c.send("bench_plain", f"P{i}", plain_s))
    total = n_limited + n_plain
    wait_for(
        lambda: c.data.llen("e2e:bench-finish") >= total,
        timeout=60 + 3 * n_limited * limited_s,
        what=f"{mode}: every task finished",
        on_timeout=c.report,
    )
    tasks = {}
    for raw in c.data.lrange("e2e:bench-finish", 0, -1):
        f = json.loads(raw)
        tasks[f["tag"]] = (f["at"] - sent[f["tag"]], f["start"], f["at"])
    for r in results:
        r.forget()
    return Run(mode, tasks, first)


def run(
    redis_url: str,
    workdir: Path,
    *,
    modes: tuple[str, ...] = MODES,
    n_limited: int = 40,
    n_plain: int = 40,
    limited_s: float = 0.3,
    plain_s: float = 0.05,
    concurrency: int = CONCURRENCY,
) -> list[Run]:
    """Start one prefork worker (``-c concurrency``) and run each mode in turn."""
    c = Cluster(redis_url, workdir, owner_ttl=10, heartbeat=1)
    try:
        c.start_worker("bench-limited", concurrency=concurrency)
        return [run_mode(c, m, n_limited, n_plain, limited_s, plain_s) for m in modes]
    finally:
        c.close()


def markdown(runs: list[Run]) -> str:
    """One row per mode."""
    lines = [
        "| limited tasks | unrelated: max / median latency (s) | unrelated: last done (s) "
        "| limited: max / median latency (s) | limited: last done (s) "
        f"| most limited bodies at once (limit {LIMIT}) "
        "| unrelated done before the limited tasks' median |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        plain, limited = r.latencies("P"), r.latencies("L")
        lines.append(
            f"| {r.mode} | {max(plain):.2f} / {statistics.median(plain):.2f} | "
            f"{r.last('P'):.2f} | {max(limited):.2f} / {statistics.median(limited):.2f} | "
            f"{r.last('L'):.2f} | {r.peak} | {r.plain_before_limited}/{len(plain)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limited", type=int, default=40)
    ap.add_argument("--plain", type=int, default=40)
    ap.add_argument("--limited-seconds", type=float, default=0.3)
    ap.add_argument("--plain-seconds", type=float, default=0.05)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(workdir=Path(tmp) / "r") as server:
        runs = run(
            server.url,
            Path(tmp) / "w",
            modes=tuple(args.modes.split(",")),
            n_limited=args.limited,
            n_plain=args.plain,
            limited_s=args.limited_seconds,
            plain_s=args.plain_seconds,
        )
    print(markdown(runs))


if __name__ == "__main__":
    main()
