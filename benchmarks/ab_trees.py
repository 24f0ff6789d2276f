"""The uncontended acquire + release cycle of two checkouts, interleaved.

For a change that must not cost speed (a restructure): each round runs
one process per checkout, in alternating order, against one throw-away
redis-server, each timing ``cycles`` cycles of ``LockManager.acquire`` +
``Lease.release`` on one resource; the report gives each checkout's median
p50 and p99 over the rounds and the per-round ratio of the p50s, so a load
that comes and goes on the machine touches both sides alike.

    python -m benchmarks.ab_trees --old ../old-checkout --new . --rounds 10

``--procs N`` (N >= 2) measures the contended rate instead: each round runs
N processes of one checkout taking and releasing one resource for
``--seconds``, then the same for the other checkout, and reports grants per
second (median over the rounds, and the per-round ratio).

    python -m benchmarks.ab_trees --old ../old-checkout --procs 4 --rounds 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from redis_server import RedisServer  # noqa: E402

_CHILD = r"""
import sys, time
from celery_redislock import LockManager
url, ns, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = LockManager(url, ns)
for _ in range(300):  # warm: connection, format check, script cache
    m.acquire("r", timeout=5).release()
times = []
for _ in range(cycles):
    t = time.perf_counter()
    m.acquire("r", timeout=5).release()
    times.append(time.perf_counter() - t)
times.sort()
print(times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6)
m.close()
"""


_CONTENDED = r"""
import multiprocessing as mp, sys, time

def run(url, ns, seconds, out):
    from celery_redislock import LockManager
    m = LockManager(url, ns)
    m.acquire("warm", timeout=5).release()
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        m.acquire("r", timeout=30).release()
        n += 1
    m.close()
    out.put(n)

if __name__ == "__main__":
    url, ns, seconds, procs = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    out = mp.Queue()
    ps = [mp.Process(target=run, args=(url, ns, seconds, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    total = sum(out.get() for _ in ps)
    for p in ps:
        p.join()
    print(total / seconds)
"""


def _contended(tree: Path, url: str, ns: str, seconds: float, procs: int) -> float:
    """Grants per second of ``procs`` processes of ``tree`` on one resource."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", _CONTENDED, url, ns, str(seconds), str(procs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip())


def _one(tree: Path, url: str, ns: str, cycles: int) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, url, ns, str(cycles)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    p50, p99 = (float(x) for x in out.stdout.split())
    return p50, p99


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--new", type=Path, default=Path("."), help="the checkout measured")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--procs", type=int, default=1, help=">= 2: the contended rate")
    parser.add_argument("--seconds", type=float, default=3.0, help="per contended run")
    args = parser.parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    if args.procs >= 2:
        return _main_contended(trees, args.rounds, args.seconds, args.procs)
    results: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    with RedisServer() as server:
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for name in order:
                results[name].append(_one(trees[name], server.url, f"ab-{name}", args.cycles))
    for name, rows in results.items():
        print(
            f"{name} ({trees[name]}): p50 {statistics.median(r[0] for r in rows):.1f} us, "
            f"p99 {statistics.median(r[1] for r in rows):.1f} us (median of {len(rows)} rounds)"
        )
    ratios = [n[0] / o[0] for n, o in zip(results["new"], results["old"])]
    print(
        "new/old p50 per round: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f"; median {statistics.median(ratios):.3f}"
    )
    return 0


def _main_contended(trees: dict[str, Path], rounds: int, seconds: float, procs: int) -> int:
    rates: dict[str, list[float]] = {"old": [], "new": []}
    with RedisServer() as server:
        for i in range(rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for name in order:
                ns = f"ab-{name}-{i}"
                rates[name].append(_contended(trees[name], server.url, ns, seconds, procs))
    for name, rows in rates.items():
        print(
            f"{name} ({trees[name]}): {statistics.median(rows):.0f} grants/s, {procs} processes "
            f"(median of {len(rows)} rounds of {seconds:g} s)"
        )
    ratios = [n / o for n, o in zip(rates["new"], rates["old"])]
    print(
        "new/old grants/s per round: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f"; median {statistics.median(ratios):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
