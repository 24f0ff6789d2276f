"""The asyncio front-end against redis-py's ``redis.asyncio.lock.Lock``.

Both run on one event loop against one redis-server (the one at
``--url``, or a throw-away one started here):

- **uncontended cycle**: ``acquire`` + ``release`` of a free lock, one
  coroutine, ``--cycles`` times after a warm-up; p50 and p99 of the cycle.
  ``AsyncLockManager.acquire(name, timeout=5)`` against
  ``Lock(client, name, timeout=30).acquire(blocking_timeout=5)``.
- **FIFO**: a holder takes the lock; ``--coros`` coroutines then ask for it
  one after the other (each starts once the one before it is waiting: for
  celery-redislock once its queue entry exists, for redis-py once it has
  made its first attempt); the holder lets go and each waiter holds the
  lock for a moment. Reported: the waiters served out of arrival order
  (pairs ``i < j`` with ``j`` served first, over all pairs) and the time to
  serve them all.
- **throughput**: ``--coros`` coroutines loop acquire / release on one
  lock for ``--duration`` seconds (a zero-length critical section:
  ``await asyncio.sleep(0)``). Reported: grants per second, Jain's
  fairness index over the per-coroutine grants, and the longest wait.

redis-py's lock polls (``sleep=0.1``, its default, unchanged): it is
neither FIFO nor woken by push; the numbers show what that costs.
Run: ``python -m benchmarks.asyncio_bench`` (results: docs/benchmarks.md,
"asyncio front-end").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio
import redis.asyncio.lock

LIBS = ("celery-redislock", "redis.asyncio Lock")
NS = "abench"
#: Seconds a redis-py lock key lives (its ``timeout``), longer than any hold.
PEER_LOCK_TTL = 30.0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def jain_index(counts: list[int]) -> float:
    total = sum(counts)
    if not counts or not total:
        return 0.0
    return total * total / (len(counts) * sum(c * c for c in counts))


Locker = tuple[Callable[[float], Awaitable[Any]], Callable[[Any], Awaitable[None]]]


class _Lib:
    """One library's acquire and release on a shared loop and server."""

    def __init__(self, lib: str, url: str, connections: int = 250) -> None:
        self.lib = lib
        self.url = url
        # Every waiting coroutine holds a connection (celery-redislock's
        # BLPOP; redis-py's polls): above redis.asyncio's default pool of 100.
        self.client = redis.asyncio.Redis.from_url(
            url, socket_timeout=None, max_connections=connections
        )
        self.mgr: Any = None
        if lib == "celery-redislock":
            from celery_redislock.asyncio import AsyncLockManager

            self.mgr = AsyncLockManager(self.client, NS)
        elif lib != "redis.asyncio Lock":
            raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")

    def locker(self, name: str) -> Locker:
        """``(acquire(timeout) -> handle or None, release(handle))`` for one coroutine."""
        if self.mgr is not None:
            mgr = self.mgr

            async def acquire_crl(timeout: float) -> Any:
                return await mgr.acquire(name, timeout=timeout)

            async def release_crl(lease: Any) -> None:
                await lease.release()

            return acquire_crl, release_crl
        # One Lock object per coroutine: its token is per object (thread_local
        # would share it between the coroutines of one thread).
        lock = redis.asyncio.lock.Lock(
            self.client, f"{NS}:{name}", timeout=PEER_LOCK_TTL, thread_local=False
        )

        async def acquire_rp(timeout: float) -> Any:
            return True if await lock.acquire(blocking_timeout=timeout) else None

        async def release_rp(_: Any) -> None:
            await lock.release()

        return acquire_rp, release_rp

    async def waiting(self, name: str, count: int) -> bool:
        """Whether ``count`` requests wait for ``name`` (celery-redislock's queue)."""
        if self.mgr is None:
            return True
        return int(await self.client.zcard(f"{{{NS}}}:q:{name}")) >= count

    async def close(self) -> None:
        if self.mgr is not None:
            await self.mgr.close()
        await self.client.aclose()


@dataclass
class CycleResult:
    lib: str
    cycles: int
    p50_us: float
    p99_us: float


@dataclass
class FifoResult:
    lib: str
    waiters: int
    inversions: int
    pairs: int
    served_s: float
    order: list[int] = field(default_factory=list)

    @property
    def out_of_order(self) -> float:
        return self.inversions / self.pairs if self.pairs else 0.0


@dataclass
class ThroughputResult:
    lib: str
    coros: int
    duration: float
    grants: int
    per_coro: list[int]
    max_wait_ms: float
    errors: int

    @property
    def rate(self) -> float:
        return self.grants / self.duration if self.duration else 0.0

    @property
    def jain(self) -> float:
        return jain_index(self.per_coro)


async def run_cycle(url: str, lib: str, cycles: int, warmup: int = 200) -> CycleResult:
    """p50 / p99 of one uncontended acquire + release."""
    side = _Lib(lib, url)
    try:
        acquire, release = side.locker("cycle")
        for _ in range(warmup):
            await release(await acquire(5.0))
        times = []
        for _ in range(cycles):
            t0 = time.perf_counter_ns()
            handle = await acquire(5.0)
            await release(handle)
            times.append((time.perf_counter_ns() - t0) / 1000)
        times.sort()
        return CycleResult(lib, cycles, percentile(times, 0.5), percentile(times, 0.99))
    finally:
        await side.close()


async def run_fifo(url: str, lib: str, waiters: int, hold: float = 0.001) -> FifoResult:
    """Sequential arrivals behind a holder; how far the grants leave arrival order."""
    side = _Lib(lib, url, 2 * waiters + 20)
    try:
        hold_acquire, hold_release = side.locker("fifo")
        holder = await hold_acquire(5.0)
        served: list[int] = []
        tried: list[asyncio.Event] = []

        async def waiter(i: int, first: asyncio.Event) -> None:
            acquire, release = side.locker("fifo")
            started = asyncio.create_task(acquire(120.0))
            # redis-py makes its first attempt at once: a yield lets it.
            await asyncio.sleep(0)
            first.set()
            handle = await started
            served.append(i)
            await asyncio.sleep(hold)
            await release(handle)

        tasks = []
        for i in range(waiters):
            ev = asyncio.Event()
            tried.append(ev)
            tasks.append(asyncio.create_task(waiter(i, ev)))
            await ev.wait()
            while not await side.waiting("fifo", i + 1):
                await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        await hold_release(holder)
        await asyncio.gather(*tasks)
        served_s = time.perf_counter() - t0
        pos = {w: k for k, w in enumerate(served)}
        inversions = sum(
            1 for i in range(waiters) for j in range(i + 1, waiters) if pos[j] < pos[i]
        )
        return FifoResult(lib, waiters, inversions, waiters * (waiters - 1) // 2, served_s, served)
    finally:
        await side.close()


async def run_throughput(url: str, lib: str, coros: int, duration: float) -> ThroughputResult:
    """``coros`` coroutines contending for one lock for ``duration`` seconds."""
    side = _Lib(lib, url, 2 * coros + 20)
    counts = [0] * coros
    waits: list[float] = []
    errors = 0
    try:
        start = time.perf_counter() + 0.05
        deadline = start + duration

        async def worker(i: int) -> None:
            nonlocal errors
            acquire, release = side.locker("tput")
            while time.perf_counter() < start:
                await asyncio.sleep(0.001)
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    handle = await acquire(max(0.0, deadline - t0) + 5.0)
                except Exception:
                    errors += 1
                    continue
                waited = time.perf_counter() - t0
                if handle is None:
                    errors += 1
                    continue
                if time.perf_counter() <= deadline:
                    counts[i] += 1
                    waits.append(waited)
                await asyncio.sleep(0)
                await release(handle)

        await asyncio.gather(*(worker(i) for i in range(coros)))
        return ThroughputResult(
            lib, coros, duration, sum(counts), counts, max(waits, default=0.0) * 1000, errors
        )
    finally:
        await side.close()


def markdown(
    cycles: list[CycleResult], fifos: list[FifoResult], tputs: list[ThroughputResult]
) -> str:
    lines = [
        "| library | cycle p50 (µs) | cycle p99 (µs) | FIFO: pairs out of order | "
        "FIFO: all served (s) | grants/s | Jain | longest wait (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, f, t in zip(cycles, fifos, tputs):
        lines.append(
            f"| {c.lib} | {c.p50_us:.0f} | {c.p99_us:.0f} | {f.out_of_order:.1%} "
            f"({f.inversions}/{f.pairs}) | {f.served_s:.2f} | {t.rate:.0f} | {t.jain:.3f} | "
            f"{t.max_wait_ms:.0f} |"
        )
    return "\n".join(lines)


async def run_all(
    url: str, cycles: int, coros: int, duration: float, libs: tuple[str, ...] = LIBS
) -> tuple[list[CycleResult], list[FifoResult], list[ThroughputResult]]:
    c = [await run_cycle(url, lib, cycles) for lib in libs]
    f = [await run_fifo(url, lib, coros) for lib in libs]
    t = [await run_throughput(url, lib, coros, duration) for lib in libs]
    return c, f, t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a Redis to use (default: start a throw-away one)")
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--coros", type=int, default=100)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from redis_server import RedisServer

        server = RedisServer().start()
        url = server.url
    try:
        cycles, fifos, tputs = asyncio.run(run_all(url, args.cycles, args.coros, args.duration))
    finally:
        if server is not None:
            server.stop()
    print(markdown(cycles, fifos, tputs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
