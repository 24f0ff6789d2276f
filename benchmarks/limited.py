"""Limited resources (at most N holders) against dramatiq's and redis-limiters' semaphores.

Usage::

    make bench-limited
    .venv/bin/python -m benchmarks.limited [--rounds 3] [--duration 3] [--quick] [--out FILE]

Starts its own throw-away redis-server (``tests/redis_server.py``) and runs,
for each library, ``--procs`` forked processes (16) on one resource with a
limit of ``--limit`` holders (4):

- celery-redislock: ``LockManager(client, namespace="limbench", owner_ttl=TTL)``,
  ``acquire(limited={"api": 4}, timeout=...)``: FIFO queue, waiters woken by
  a push;
- dramatiq: ``ConcurrentRateLimiter(RedisBackend(client=client), "limbench:api",
  limit=4, ttl=TTL ms)``, ``with limiter.acquire(raise_on_failure=False) as
  acquired:``. It never waits, so a process retries until acquired, sleeping
  1 ms after its first failed attempt and doubling the sleep after each
  further one, up to 8 ms;
- redis-limiters: ``SyncSemaphore(name="api", capacity=4, expiry=TTL s,
  max_sleep=..., connection=client)``, ``with semaphore:``: a list of N
  tokens, ``BLPOP`` to take one (Redis serves blocked clients in arrival
  order), ``LPUSH`` to give it back.

Each process loops: note the time, acquire, note the time, run the
critical section, release. The critical section runs one script that
``INCR``\\ s a counter of the processes inside (its own key, not any
library's) and keeps its peak, sleeps ``hold`` (0 and 5 ms), then ``DECR``\\ s
the counter: the peak is the most holders Redis saw at once, which must stay
at or below N. Throughput rounds run the libraries interleaved (round *i* in
an order rotated by *i*), and the report pools each library's rounds.

**Recovery.** One process (the victim) takes a slot and keeps it, the other
15 loop with hold 5 ms; once the victim has held for ``SETTLE`` seconds the
parent takes it off the counter (one script, which also marks the kill) and
``SIGKILL``\\ s it. The recovery time runs from the kill to the first entry
after it that finds N processes inside: the dead holder's slot in use by a
live one. A library that does not get there within ``--window`` seconds is
reported as not recovered. The libraries' expiry settings are all ``TTL``
(``--ttl``, 2 s): celery-redislock's ``owner_ttl`` (a holder is dead that long
after its last heartbeat), dramatiq's ``ttl`` (of its counter key, in ms) and
redis-limiters' ``expiry`` (of its token list, whole seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.machine import cpu_model, load_average  # noqa: E402
from benchmarks.peers import collect_reports, jain_index, make_client, percentile  # noqa: E402
from celery_redislock.protocol.keys import Keyspace  # noqa: E402
from redis_server import RedisServer  # noqa: E402

OURS = "celery-redislock"
DRAMATIQ = "dramatiq"
LIMITERS = "redis-limiters"
#: The libraries compared, in table order.
LIBS = (OURS, DRAMATIQ, LIMITERS)

#: The resource every library limits (each with its own key scheme).
RESOURCE = "api"
#: Keys of the holders counter (not any library's): inside now, the most
#: seen at once, and the kill mark of a recovery run.
CUR, PEAK, KILLED = "limbench:inside", "limbench:peak", "limbench:killed"
#: celery-redislock's keys of the benchmark's namespace.
KEYSPACE = Keyspace("limbench")

#: Entering the critical section: count this process in, keep the peak,
#: answer ``{inside, kill mark}`` (one round trip).
ENTER = """
local v = redis.call('INCR', KEYS[1])
if v > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], v) end
return {v, tonumber(redis.call('GET', KEYS[3]) or '0')}
"""
#: The parent, just before it SIGKILLs the victim: the victim leaves the
#: count, and later entries know that the kill happened (atomically).
MARK_KILL = """
redis.call('DECR', KEYS[1])
redis.call('SET', KEYS[3], 1)
return 1
"""

#: dramatiq's retry loop: the sleep after the first failed attempt, doubled
#: after each further one up to the cap (seconds).
BACKOFF_MIN = 0.001
BACKOFF_MAX = 0.008
#: Seconds after a run's deadline a bounded wait may still wait.
GRACE = 5.0
#: Seconds the victim holds its slot before it is killed (steady state).
SETTLE = 0.5


class Slot:
    """One library's slot of the resource, opened in one process."""

    def __init__(self, lib: str, client: redis.Redis, limit: int, ttl: float) -> None:
        self.lib = lib
        if lib == OURS:
            from celery_redislock import LockManager

            self.mgr = LockManager(client, namespace="limbench", owner_ttl=ttl)
        elif lib == DRAMATIQ:
            from dramatiq.rate_limits import ConcurrentRateLimiter
            from dramatiq.rate_limits.backends import RedisBackend

            self.limiter = ConcurrentRateLimiter(
                RedisBackend(client=client),
                f"limbench:{RESOURCE}",
                limit=limit,
                ttl=int(ttl * 1000),
            )
        elif lib == LIMITERS:
            from redis_limiters import SyncSemaphore

            self.semaphore = SyncSemaphore(
                name=RESOURCE,
                capacity=limit,
                expiry=max(1, round(ttl)),
                max_sleep=60,
                connection=client,
            )
        else:
            raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")
        self.limit = limit

    def take(self, timeout: float) -> AbstractContextManager[bool]:
        """A context manager holding one slot; it yields False if ``timeout``
        (seconds) ran out first."""
        if self.lib == OURS:
            return self._ours(timeout)
        if self.lib == DRAMATIQ:
            return self._dramatiq(timeout)
        return self._limiters(timeout)

    @contextmanager
    def _ours(self, timeout: float) -> Iterator[bool]:
        from celery_redislock import LockTimeout

        try:
            lease = self.mgr.acquire(limited={RESOURCE: self.limit}, timeout=timeout)
        except LockTimeout:
            yield False
            return
        try:
            yield True
        finally:
            lease.release()

    @contextmanager
    def _dramatiq(self, timeout: float) -> Iterator[bool]:
        give_up = time.monotonic() + timeout
        backoff = BACKOFF_MIN
        while True:
            with self.limiter.acquire(raise_on_failure=False) as acquired:
                if acquired:
                    yield True
                    return
            if time.monotonic() >= give_up:
                yield False
                return
            time.sleep(backoff)
            backoff = min(2 * backoff, BACKOFF_MAX)

    @contextmanager
    def _limiters(self, timeout: float) -> Iterator[bool]:
        from redis_limiters import MaxSleepExceededError

        # Whole seconds, at least 1 (0 would wait for ever).
        self.semaphore.max_sleep = max(1, math.ceil(timeout))
        try:
            self.semaphore.__enter__()
        except MaxSleepExceededError:
            yield False
            return
        try:
            yield True
        finally:
            self.semaphore.__exit__(None, None, None)


@dataclass
class _Shared:
    """Fork-shared state of one run."""

    start_ns: Any
    stop: Any
    victim_in: Any
    full_ns: Any


def _worker(
    lib: str,
    url: str,
    idx: int,
    limit: int,
    ttl: float,
    hold: float,
    duration: float,
    victim: bool,
    shared: _Shared,
    barrier: Any,
    out: Any,
) -> None:
    reqs: list[int] = []
    acqs: list[int] = []
    errors = 0
    first_error = ""
    logging.getLogger("celery_redislock").setLevel(logging.ERROR)
    try:
        client = make_client(url)
        client.ping()
        enter = client.register_script(ENTER)
        slot = Slot(lib, client, limit, ttl)
        barrier.wait(timeout=60)
        deadline = shared.start_ns.value + int(duration * 1e9)

        def left() -> float:
            return max(0.0, (deadline - time.monotonic_ns()) / 1e9) + GRACE

        if victim:
            with slot.take(left()) as ok:
                if ok:
                    enter(keys=[CUR, PEAK, KILLED])
                    shared.victim_in.value = 1
                    time.sleep(3600)  # until SIGKILLed
        while time.monotonic_ns() < deadline and not shared.stop.value:
            t_req = time.monotonic_ns()
            try:
                with slot.take(left()) as ok:
                    t_acq = time.monotonic_ns()
                    reqs.append(t_req)
                    acqs.append(t_acq if ok else -1)
                    if not ok:
                        break
                    inside, killed = enter(keys=[CUR, PEAK, KILLED])
                    if killed and inside >= limit and not shared.full_ns.value:
                        shared.full_ns.value = time.monotonic_ns()
                    if hold:
                        time.sleep(hold)
                    client.decr(CUR)
            except Exception as exc:  # Redis errors, a library's own
                errors += 1
                first_error = first_error or repr(exc)
        out.put((idx, reqs, acqs, errors, first_error))
    except BaseException:
        out.put((idx, reqs, acqs, errors + 1, traceback.format_exc(limit=3)))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


@dataclass
class Run:
    """One library, one configuration: a round or several pooled."""

    lib: str
    hold: float
    procs: int
    duration: float = 0.0
    per_process: list[int] = field(default_factory=list)
    #: Every wait (ms, ascending).
    waits_ms: list[float] = field(default_factory=list)
    peak: int = 0
    errors: int = 0
    first_error: str = ""
    gave_up: int = 0
    killed: int = 0
    #: Acquisitions per second of each round, in run order.
    round_rates: list[float] = field(default_factory=list)
    #: Recovery runs: seconds from the kill to N holders again, per round
    #: (None: not within the window).
    recoveries: list[float | None] = field(default_factory=list)
    #: Recovery runs, celery-redislock: seconds the victim's liveness key had
    #: left at the kill (PTTL), per round.
    liveness_left: list[float | None] = field(default_factory=list)
    #: Recovery runs: slots the library still counts as taken once every
    #: live process has stopped, per round (text: a number, or "expired").
    still_taken: list[str] = field(default_factory=list)

    @property
    def grants(self) -> int:
        return sum(self.per_process)

    @property
    def rate(self) -> float:
        """Acquisitions per second over every process."""
        return self.grants / self.duration if self.duration else 0.0

    @property
    def jain(self) -> float:
        return jain_index(self.per_process)

    def wait_ms(self, q: float) -> float:
        return percentile(self.waits_ms, q)


def run_once(
    url: str,
    lib: str,
    procs: int,
    limit: int,
    ttl: float,
    hold: float,
    duration: float,
    *,
    recovery_window: float | None = None,
) -> Run:
    """One round of ``lib``: ``procs`` forked processes for ``duration`` s.

    ``recovery_window`` (seconds): a recovery run instead: process 0 takes a
    slot and is SIGKILLed holding it, and the run ends once the dead slot is
    in use again or the window has passed (``duration`` is then ignored).
    Flushes the Redis at ``url`` first.
    """
    if lib not in LIBS:
        raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")
    admin = make_client(url)
    try:
        admin.flushdb()
    finally:
        admin.close()
    recovery = recovery_window is not None
    if recovery:
        duration = 60 + SETTLE + (recovery_window or 0.0)
    ctx = mp.get_context("fork")
    shared = _Shared(*(ctx.RawValue("q", 0) for _ in range(4)))

    def set_start() -> None:
        shared.start_ns.value = time.monotonic_ns()

    barrier = ctx.Barrier(procs, action=set_start)
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(
                lib,
                url,
                i,
                limit,
                ttl,
                hold,
                duration,
                recovery and i == 0,
                shared,
                barrier,
                out,
            ),
            name=f"limbench-{lib}-{i}",
            daemon=True,
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    res = Run(lib=lib, hold=hold, procs=procs)
    started = time.monotonic()
    if recovery:
        recovered, left = _kill_and_watch(url, lib, workers[0], shared, recovery_window or 0.0)
        res.recoveries.append(recovered)
        res.liveness_left.append(left)
        # The run's length is the time until the stop (rates are not reported).
        res.duration = time.monotonic() - started
    reports = collect_reports(out, workers, procs - 1 if recovery else procs, duration)
    for w in workers:
        w.join(timeout=2)
        if w.is_alive():
            if not (recovery and w is workers[0]):
                res.killed += 1
            w.kill()
            w.join()
    out.close()
    admin = make_client(url)
    try:
        res.peak = int(admin.get(PEAK) or 0)
        if recovery:
            res.still_taken.append(_still_taken(admin, lib, limit))
    finally:
        admin.close()
    if not recovery:
        res.duration = duration
        _summarise(res, shared.start_ns.value + int(duration * 1e9), reports)
        res.round_rates = [res.rate]
    else:
        for rep in reports.values():
            res.errors += rep[3]
            res.first_error = res.first_error or rep[4]
    return res


def _kill_and_watch(
    url: str, lib: str, victim: Any, shared: _Shared, window: float
) -> tuple[float | None, float | None]:
    """SIGKILL the victim once it has held for SETTLE s. Returns the seconds
    until its slot is in use again (None: not within ``window``) and, for
    celery-redislock, the seconds its liveness had left at the kill. Stops
    the run."""
    admin = make_client(url)
    left = None
    try:
        held_by = time.monotonic() + 60
        while not shared.victim_in.value and time.monotonic() < held_by and victim.is_alive():
            time.sleep(0.01)
        if not shared.victim_in.value:
            return None, None
        time.sleep(SETTLE)
        alive = admin.keys(KEYSPACE.alive(f"{victim.pid}-*")) if lib == OURS else []
        admin.eval(MARK_KILL, 3, CUR, PEAK, KILLED)
        kill_ns = time.monotonic_ns()
        os.kill(victim.pid, signal.SIGKILL)
        if alive:
            left = max(0, int(admin.pttl(alive[0]))) / 1000
        end = kill_ns + int(window * 1e9)
        while not shared.full_ns.value and time.monotonic_ns() < end:
            time.sleep(0.005)
        full = shared.full_ns.value
        return ((full - kill_ns) / 1e9 if full else None), left
    finally:
        shared.stop.value = 1
        admin.close()


def _still_taken(admin: redis.Redis, lib: str, limit: int) -> str:
    """Slots ``lib`` counts as taken now, read from its own keys."""
    if lib == OURS:
        return str(admin.hlen(KEYSPACE.lock(RESOURCE)))
    if lib == DRAMATIQ:
        value = admin.get(f"limbench:{RESOURCE}")
        return "expired" if value is None else str(int(value))
    from redis_limiters import SyncSemaphore

    sem = SyncSemaphore(name=RESOURCE, capacity=limit, connection=admin)
    if not admin.exists(sem.exists):
        return "expired"
    return str(limit - int(admin.llen(sem.key)))


def _summarise(res: Run, deadline: int, reports: dict[int, tuple[Any, ...]]) -> None:
    counts = [0] * res.procs
    for idx, reqs, acqs, errors, first_error in reports.values():
        res.errors += errors
        res.first_error = res.first_error or first_error
        for t_req, t_acq in zip(reqs, acqs):
            if t_acq < 0:
                res.gave_up += 1
                res.waits_ms.append((deadline - t_req) / 1e6)
                continue
            if t_req < deadline:
                res.waits_ms.append((min(t_acq, deadline) - t_req) / 1e6)
            if t_acq < deadline:
                counts[idx] += 1
    res.per_process = counts
    res.waits_ms.sort()


def pool(rounds: list[Run]) -> Run:
    """One result from several rounds of one library and configuration."""
    if not rounds:
        raise ValueError("pool() needs at least one round")
    first = rounds[0]
    if len({(r.lib, r.hold, r.procs) for r in rounds}) != 1:
        raise ValueError("pool() mixes configurations")
    out = Run(lib=first.lib, hold=first.hold, procs=first.procs)
    out.per_process = [0] * first.procs
    for r in rounds:
        out.duration += r.duration
        if r.per_process:
            out.per_process = [a + b for a, b in zip(out.per_process, r.per_process)]
        out.waits_ms.extend(r.waits_ms)
        out.peak = max(out.peak, r.peak)
        out.errors += r.errors
        out.first_error = out.first_error or r.first_error
        out.gave_up += r.gave_up
        out.killed += r.killed
        out.round_rates.extend(r.round_rates)
        out.recoveries.extend(r.recoveries)
        out.liveness_left.extend(r.liveness_left)
        out.still_taken.extend(r.still_taken)
    out.waits_ms.sort()
    return out


def interleaved(
    rounds: int,
    libs: tuple[str, ...],
    one: Callable[[str], Run],
    progress: Callable[[Run], None] | None = None,
) -> list[Run]:
    """``rounds`` rounds of every library, round ``i`` in an order rotated by
    ``i``; one pooled result per library, in ``libs`` order."""
    runs: dict[str, list[Run]] = {lib: [] for lib in libs}
    for i in range(rounds):
        for lib in libs[i % len(libs) :] + libs[: i % len(libs)]:
            res = one(lib)
            if progress is not None:
                progress(res)
            runs[lib].append(res)
    return [pool(runs[lib]) for lib in libs]


@dataclass
class Settings:
    """One benchmark run's sizes."""

    procs: int = 16
    limit: int = 4
    holds: tuple[float, ...] = (0.0, 0.005)
    rounds: int = 3
    duration: float = 4.0
    ttl: float = 2.0
    recovery_rounds: int = 2
    recovery_hold: float = 0.005
    window: float = 8.0


#: ``--quick``: seconds in all, for the smoke test.
QUICK = Settings(
    procs=8,
    holds=(0.0, 0.005),
    rounds=1,
    duration=0.5,
    ttl=1.0,
    recovery_rounds=1,
    window=1.5,
)


def measure(
    url: str, s: Settings, progress: Callable[[Run], None] | None = None
) -> tuple[list[Run], list[Run]]:
    """The throughput runs (per hold) and the recovery runs, pooled per library."""
    # Imported before forking: an import in each child would fall inside the run.
    import dramatiq.rate_limits  # noqa: F401
    import redis_limiters  # noqa: F401

    import celery_redislock  # noqa: F401

    throughput: list[Run] = []
    for hold in s.holds:
        throughput += interleaved(
            s.rounds,
            LIBS,
            lambda lib, hold=hold: run_once(url, lib, s.procs, s.limit, s.ttl, hold, s.duration),
            progress,
        )
    recovery = interleaved(
        s.recovery_rounds,
        LIBS,
        lambda lib: run_once(
            url, lib, s.procs, s.limit, s.ttl, s.recovery_hold, 0.0, recovery_window=s.window
        ),
        progress,
    )
    return throughput, recovery


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def setting(lib: str, ttl: float) -> str:
    """The expiry setting each library runs with, as it is spelled."""
    if lib == OURS:
        return f"`owner_ttl={ttl:g}` (s)"
    if lib == DRAMATIQ:
        return f"`ttl={int(ttl * 1000)}` (ms)"
    return f"`expiry={max(1, round(ttl))}` (s)"


def throughput_table(runs: list[Run]) -> str:
    """The throughput runs as one markdown table."""
    lines = [
        "| hold ms | library | acquisitions/s | ours vs theirs | wait p50 ms | wait p99 ms | "
        "Jain | peak holders | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ours = next((x for x in runs if x.lib == OURS and x.hold == r.hold), None)
        errors = str(r.errors)
        if r.gave_up or r.killed:
            errors += f" (gave up {r.gave_up}, killed {r.killed})"
        vs = "" if ours is None or r is ours else _ratio(ours.rate, r.rate)
        lines.append(
            f"| {r.hold * 1000:g} | {r.lib} | {r.rate:.0f} | {vs} | {_fmt(r.wait_ms(0.5), 2)} | "
            f"{_fmt(r.wait_ms(0.99))} | {r.jain:.3f} | {r.peak} | {errors} |"
        )
    return "\n".join(lines)


def _recovery_text(values: list[float | None], window: float) -> str:
    return ", ".join(f"{v:.2f}" if v is not None else f"> {window:g} (not)" for v in values)


def recovery_table(runs: list[Run], s: Settings) -> str:
    """The recovery runs as one markdown table."""
    lines = [
        "| library | expiry setting | recovery s, per round | liveness left at the kill s | "
        "slots still taken after the run | peak holders | errors |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for r in runs:
        left = ", ".join("?" if v is None else f"{v:.2f}" for v in r.liveness_left)
        lines.append(
            f"| {r.lib} | {setting(r.lib, s.ttl)} | {_recovery_text(r.recoveries, s.window)} | "
            f"{left if r.lib == OURS else ''} | {', '.join(r.still_taken)} | "
            f"{r.peak} | {r.errors} |"
        )
    return "\n".join(lines)


def target_lines(throughput: list[Run], recovery: list[Run], s: Settings) -> list[str]:
    """``... met`` / ``NOT met`` per target."""
    lines = []
    for hold in s.holds:
        by = {r.lib: r for r in throughput if r.hold == hold}
        me = by[OURS]
        peers = [by[lib] for lib in LIBS if lib != OURS]
        worse = [p for p in peers if not me.rate >= p.rate]
        per_round = "; ".join(
            f"{p.lib} " + ", ".join(_ratio(a, b) for a, b in zip(me.round_rates, p.round_rates))
            for p in peers
        )
        lines.append(
            f"throughput at least each peer's (hold {hold * 1000:g} ms): "
            + ("met" if not worse else "NOT met (below " + ", ".join(p.lib for p in worse) + ")")
            + f"; {me.rate:.0f} vs "
            + ", ".join(f"{p.rate:.0f} ({p.lib})" for p in peers)
            + f" acquisitions/s; ours vs theirs per round: {per_round}"
        )
        lines.append(
            f"Jain >= 0.99 (hold {hold * 1000:g} ms): "
            + ("met" if me.jain >= 0.99 else "NOT met")
            + f"; {me.jain:.3f} vs "
            + ", ".join(f"{p.jain:.3f} ({p.lib})" for p in peers)
        )
    over = [
        f"{r.lib} {r.peak} (hold {r.hold * 1000:g} ms)"
        for r in throughput + recovery
        if r.peak > s.limit
    ]
    peaks = ", ".join(
        f"{lib} {max(r.peak for r in throughput + recovery if r.lib == lib)}" for lib in LIBS
    )
    lines.append(
        f"at most {s.limit} holders at once, every library, every run: "
        + ("met" if not over else "NOT met: exceeded by " + "; ".join(over))
        + f"; peaks {peaks}"
    )
    rec = {r.lib: r for r in recovery}
    mine = rec[OURS].recoveries
    ok = bool(mine) and all(v is not None and v <= s.ttl for v in mine)
    after = [
        f"{(v - left) * 1000:.0f}"
        for v, left in zip(mine, rec[OURS].liveness_left)
        if v is not None and left is not None
    ]
    lines.append(
        f"recovery after a SIGKILLed holder within owner_ttl ({s.ttl:g} s): "
        + ("met" if ok else "NOT met")
        + f"; {_recovery_text(mine, s.window)} s"
        + (f" (reclaimed {', '.join(after)} ms after the liveness ran out)" if after else "")
        + "; "
        + "; ".join(
            f"{lib} ({setting(lib, s.ttl)}): {_recovery_text(rec[lib].recoveries, s.window)} s"
            for lib in LIBS
            if lib != OURS
        )
    )
    return lines


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def render(
    throughput: list[Run],
    recovery: list[Run],
    s: Settings,
    command: str,
    redis_version: str,
    load_before: str,
    load_after: str,
    elapsed: float,
) -> str:
    """The markdown report."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    errors = [
        f"- errors in {r.lib} (hold {r.hold * 1000:g} ms): {r.errors}, first: "
        f"`{r.first_error.strip().splitlines()[-1] if r.first_error.strip() else '?'}`"
        for r in throughput + recovery
        if r.errors
    ]
    lines = [
        "# Limited resources against peers",
        "",
        f"- date: {now}",
        f"- command: `{command}` (or `make bench-limited`); total {elapsed:.0f} s",
        f"- machine: {os.cpu_count()} CPUs ({cpu_model()}), load average before/after "
        f"{load_before} / {load_after} (1/5/15 min; other jobs share the machine)",
        f"- redis-server {redis_version} on 127.0.0.1 (loopback TCP, no persistence), started "
        f"by the benchmark; Python {platform.python_version()}, redis-py {_version('redis')}, "
        f"dramatiq {_version('dramatiq')}, redis-limiters {_version('redis-limiters')}, "
        f"celery-redislock {_version('celery-redislock')}",
        f"- {s.procs} processes, one resource, at most {s.limit} holders; {s.rounds} interleaved "
        f"rounds of {s.duration:g} s per library and hold (rotated order), pooled; dramatiq "
        f"retried after {BACKOFF_MIN * 1000:g} ms doubling up to {BACKOFF_MAX * 1000:g} ms; "
        f"expiry settings: " + ", ".join(f"{lib} {setting(lib, s.ttl)}" for lib in LIBS),
        "",
        "## Throughput, waits, fairness, peak holders",
        "",
        throughput_table(throughput),
        "",
        f"## Recovery after a SIGKILLed holder ({s.recovery_rounds} rounds, hold "
        f"{s.recovery_hold * 1000:g} ms)",
        "",
        "From the kill until a live process takes the dead holder's slot (N inside at once "
        f"again); not within {s.window:g} s: not recovered.",
        "",
        recovery_table(recovery, s),
        "",
        *errors,
        *([""] if errors else []),
        "## Targets",
        "",
        *(f"- {line}" for line in target_lines(throughput, recovery, s)),
    ]
    return "\n".join(lines) + "\n"


def _progress(r: Run) -> None:
    what = (
        f"recovery={_recovery_text(r.recoveries, math.nan)}"
        if r.recoveries
        else f"acq/s={r.rate:.0f} wait_p50_ms={r.wait_ms(0.5):.2f} jain={r.jain:.3f}"
    )
    print(
        f"# {r.lib:16} hold_ms={r.hold * 1000:g} {what} peak={r.peak} errors={r.errors}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Settings()
    parser.add_argument("--quick", action="store_true", help="seconds in all (the smoke test)")
    parser.add_argument("--procs", type=int, help=f"contending processes ({d.procs})")
    parser.add_argument("--limit", type=int, help=f"holders at most, N ({d.limit})")
    parser.add_argument("--rounds", type=int, help=f"interleaved throughput rounds ({d.rounds})")
    parser.add_argument("--duration", type=float, help=f"seconds per round ({d.duration:g})")
    parser.add_argument("--ttl", type=float, help=f"every library's expiry, s ({d.ttl:g})")
    parser.add_argument("--recovery-rounds", type=int, help=f"({d.recovery_rounds})")
    parser.add_argument("--window", type=float, help=f"seconds a recovery may take ({d.window:g})")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    names = ("procs", "limit", "rounds", "duration", "ttl", "recovery_rounds", "window")
    s = dataclasses.replace(
        QUICK if args.quick else d,
        **{n: getattr(args, n) for n in names if getattr(args, n) is not None},
    )
    command = ".venv/bin/python -m benchmarks.limited" + (
        " " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else ""
    )
    started = time.monotonic()
    load_before = load_average()
    server = RedisServer()
    server.start()
    try:
        throughput, recovery = measure(server.url, s, _progress)
    finally:
        server.close()
    report = render(
        throughput,
        recovery,
        s,
        command,
        server.version_string,
        load_before,
        load_average(),
        time.monotonic() - started,
    )
    print(report)
    if args.out:
        args.out.write_text(report)
    ours = [r for r in throughput + recovery if r.lib == OURS]
    return 1 if any(r.peak > s.limit for r in ours) else 0


if __name__ == "__main__":
    raise SystemExit(main())
