"""What ``wait_replicas=1`` costs: uncontended acquire+release, with and without WAIT.

Usage::

    .venv/bin/python -m benchmarks.replicas [--rounds 6] [--ops 200]

Starts a master and one replica (``--replicaof``, the binary
``tests/redis_server.py`` picks) on loopback, then times one exclusive,
uncontended ``acquire`` + ``release`` of a :class:`LockManager` with
``wait_replicas=0`` (no WAIT: the default) and one with ``wait_replicas=1``
(the acquire script and ``WAIT 1`` in one pipeline), in ``--rounds``
interleaved rounds of ``--ops`` pairs each (order alternated per round, after
a warm-up), and prints the p50 of each and their ratio as markdown. Bounded:
about ``2 x rounds x ops`` pairs, a few seconds with the defaults.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from celery_redislock import LockManager  # noqa: E402
from redis_server import LOOPBACK, RedisServer  # noqa: E402

NAMESPACE = "bench-replicas"


@dataclass
class ReplicaCost:
    """Per-pair latencies (ms) with wait_replicas=0 and =1."""

    without: list[float] = field(default_factory=list)
    with_wait: list[float] = field(default_factory=list)
    redis_version: str = "?"

    @property
    def p50_without(self) -> float:
        return statistics.median(self.without)

    @property
    def p50_with(self) -> float:
        return statistics.median(self.with_wait)

    @property
    def ratio(self) -> float:
        return self.p50_with / self.p50_without

    def markdown(self) -> str:
        return "\n".join(
            [
                "| wait_replicas | pairs | acquire+release p50 (ms) | p90 (ms) |",
                "| --- | --- | --- | --- |",
                _row("0 (no WAIT)", self.without),
                _row("1 (WAIT 1, pipelined)", self.with_wait),
                "",
                f"Ratio of p50s (wait_replicas=1 / 0): **{self.ratio:.2f}x** "
                f"(redis-server {self.redis_version}, one local replica).",
            ]
        )


def _row(label: str, values: list[float]) -> str:
    p90 = statistics.quantiles(values, n=10)[-1] if len(values) >= 10 else max(values)
    return f"| {label} | {len(values)} | {statistics.median(values):.3f} | {p90:.3f} |"


def _time_pairs(mgr: LockManager, ops: int, out: list[float]) -> None:
    for _ in range(ops):
        t0 = time.perf_counter()
        mgr.acquire("res", timeout=0).release()
        out.append((time.perf_counter() - t0) * 1000.0)


def _in_sync(master: redis.Redis, replica: redis.Redis) -> bool:
    link = replica.info("replication").get("master_link_status")
    return link == "up" and int(master.info("replication").get("connected_slaves", 0)) >= 1


def measure(master_url: str, rounds: int = 6, ops: int = 200) -> ReplicaCost:
    """Interleaved rounds against a master that has at least one replica."""
    res = ReplicaCost()
    plain = LockManager(master_url, NAMESPACE, heartbeat=False)
    waiting = LockManager(master_url, NAMESPACE, heartbeat=False, wait_replicas=1)
    try:
        for mgr in (plain, waiting):  # scripts loaded, owners registered
            _time_pairs(mgr, 20, [])
        for i in range(rounds):
            order = [(plain, res.without), (waiting, res.with_wait)]
            for mgr, out in order if i % 2 == 0 else order[::-1]:
                _time_pairs(mgr, ops, out)
    finally:
        plain.close()
        waiting.close()
    return res


def run(rounds: int = 6, ops: int = 200) -> ReplicaCost:
    """Start a master and a replica, measure, stop them."""
    with tempfile.TemporaryDirectory(prefix="redislock-bench-replicas-") as tmp:
        fast_sync = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        master = RedisServer(workdir=Path(tmp) / "m", extra_args=fast_sync).start()
        replica = RedisServer(
            workdir=Path(tmp) / "r",
            extra_args=[*fast_sync, "--replicaof", LOOPBACK, str(master.port)],
        )
        try:
            replica.start()
            m, r = master.client(), replica.client()
            deadline = time.monotonic() + 20
            while not _in_sync(m, r):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not sync within 20 s")
                time.sleep(0.02)
            m.close()
            r.close()
            res = measure(master.url, rounds, ops)
            res.redis_version = master.version_string
            return res
        finally:
            replica.close()
            master.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    parser.add_argument("--ops", type=int, default=200, help="acquire+release pairs per round")
    args = parser.parse_args(argv)
    started = time.monotonic()
    res = run(args.rounds, args.ops)
    print(res.markdown())
    print(f"\n({time.monotonic() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
