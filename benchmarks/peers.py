"""Contention benchmark: celery-redislock against redis-py's Lock and python-redis-lock.

N processes (forked) contend for one exclusive lock for a fixed duration.
Each loops::

    t_req = now; acquire(); t_acq = now
    critical section (exclusion checks, a shared counter, a short sleep)
    t_rel = now; release()

Timestamps are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for every
process on Linux), so records from different processes compare directly.
From the merged records :func:`run_contention` derives:

- handoff latency: for two consecutive grants held by *different* processes,
  the time from the first holder calling ``release()`` to the next holder's
  ``acquire()`` returning, i.e. how long the lock sits idle between owners
  (release round trip + wake-up + the next holder's acquire). Consecutive
  grants to the *same* process (the releaser barging back in) are counted
  separately as ``self_reacquire``;
- throughput: grants per second over all processes;
- fairness: Jain's index over the per-process grant counts, and the longest
  wait (a request still waiting at the end counts up to the end);
- exclusion violations: the critical section sets a shared ``inside`` flag
  and checks it on entry and exit, and increments a shared counter with a
  non-atomic read-sleep-write; overlaps and lost updates are counted.

The shared flag and counter live in fork-shared memory
(``multiprocessing.RawValue``, deliberately unlocked), so the check adds no
Redis traffic. Every process stops by itself at the deadline; peers wait with
a bounded timeout, celery-redislock with ``timeout=None`` (it is FIFO, so its
last waiters are served as the others stop). The parent kills a process only
if it has not reported within a generous grace period (reported as ``killed``).
"""

from __future__ import annotations

import inspect
import logging
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.lock

#: The libraries compared, in table order.
LIBS = ("celery-redislock", "python-redis-lock", "redis-py Lock")

#: The resource every library locks; each maps it to its own key scheme:
#: ``{bench}:lock:handoff`` (celery-redislock), ``lock:bench:handoff``
#: (python-redis-lock) and ``bench:handoff`` (redis-py).
RESOURCE = "handoff"

#: redis-py ``Lock``'s default polling interval (seconds), used unchanged.
REDIS_PY_SLEEP: float = inspect.signature(redis.lock.Lock.__init__).parameters["sleep"].default

#: Seconds between two looks of a relay-mode releaser at the shared entry
#: counter (fork-shared memory, no Redis traffic).
RELAY_POLL = 0.0001
#: Seconds after the deadline a peer's bounded acquire may still wait.
PEER_GRACE = 5.0
#: Seconds after the deadline before the parent kills a silent process.
KILL_GRACE = 20.0


def collect_reports(
    out: Any, workers: list[Any], expected: int, duration: float
) -> dict[int, tuple[Any, ...]]:
    """The workers' reports from ``out`` (``(index, ...)`` tuples), until
    ``expected`` came, every worker ended, or the run is long overdue."""
    reports: dict[int, tuple[Any, ...]] = {}
    give_up_at = time.monotonic() + 60 + duration + KILL_GRACE
    while len(reports) < expected and time.monotonic() < give_up_at:
        try:
            rep = out.get(timeout=0.5)
        except queue.Empty:
            if all(not w.is_alive() for w in workers) and out.empty():
                break
            continue
        reports[rep[0]] = rep
    return reports


class _SendCounter(redis.Connection):
    """Counts what this process sends (one send = one round trip; a
    pipeline is one send). Costs every library the same one addition."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _SendCounter.sends += 1
        super().send_packed_command(command, check_health)


def make_client(url: str) -> redis.Redis:
    """A client for one benchmark process.

    ``socket_timeout=None`` for every library alike: redis-py 8 defaults to a
    5 s socket timeout, which makes any BLPOP longer than 5 s (python-redis-lock
    waits in ``BLPOP ... 0``) fail with ``TimeoutError``. Its connections
    count their sends (:class:`_SendCounter`).
    """
    kwargs = redis.Redis.from_url(url).connection_pool.connection_kwargs
    kwargs.update(socket_timeout=None, decode_responses=True)
    pool = redis.ConnectionPool(connection_class=_SendCounter, **kwargs)
    return redis.Redis.from_pool(pool)


def _cpu_ns() -> int:
    """This process's CPU time (user + system), in ns."""
    t = os.times()
    return int((t.user + t.system) * 1e9)


def server_cpu_s(client: redis.Redis) -> float:
    """The redis-server process's CPU time so far (INFO cpu, user + system), in s."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


Locker = tuple[Callable[[], Any], Callable[[Any], None]]


def make_locker(lib: str, client: redis.Redis, deadline_ns: int) -> Locker:
    """``(acquire, release)`` for ``lib``; ``acquire()`` returns a handle or None."""
    if lib == "celery-redislock":
        from celery_redislock import LockManager

        mgr = LockManager(client, namespace="bench")

        def acquire_crl() -> Any:
            return mgr.acquire(RESOURCE, timeout=None)

        def release_crl(lease: Any) -> None:
            lease.release()

        return acquire_crl, release_crl

    def peer_timeout() -> float:
        return max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9) + PEER_GRACE

    if lib == "redis-py Lock":
        rlock = redis.lock.Lock(client, f"bench:{RESOURCE}")  # sleep=0.1 default

        def acquire_rp() -> Any:
            return True if rlock.acquire(blocking_timeout=peer_timeout()) else None

        def release_rp(_: Any) -> None:
            rlock.release()

        return acquire_rp, release_rp

    if lib == "python-redis-lock":
        import redis_lock

        plock = redis_lock.Lock(client, f"bench:{RESOURCE}")

        def acquire_prl() -> Any:
            return True if plock.acquire(timeout=math.ceil(peer_timeout())) else None

        def release_prl(_: Any) -> None:
            plock.release()

        return acquire_prl, release_prl

    raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")


@dataclass
class _Shared:
    """Fork-shared, deliberately unlocked state of one configuration."""

    inside: Any
    counter: Any
    start_ns: Any
    entries: Any


def _worker(
    lib: str,
    url: str,
    idx: int,
    duration: float,
    cs_seconds: float,
    relay: bool,
    shared: _Shared,
    barrier: Any,
    out: Any,
) -> None:
    me = idx + 1
    reqs: list[int] = []
    acqs: list[int] = []
    rels: list[int] = []
    violations = errors = 0
    first_error = ""
    # A failing call is counted below; keep the engine's per-call warnings
    # (e.g. release.deferred) from flooding the report.
    logging.getLogger("celery_redislock").setLevel(logging.ERROR)
    try:
        client = make_client(url)
        client.ping()
        # The deadline is set once every process is connected and ready.
        barrier.wait(timeout=60)
        deadline = shared.start_ns.value + int(duration * 1e9)
        acquire, release = make_locker(lib, client, deadline)
        cpu0, sends0 = _cpu_ns(), _SendCounter.sends
        while time.monotonic_ns() < deadline:
            t_req = time.monotonic_ns()
            try:
                handle = acquire()
            except Exception as exc:  # a peer's BLPOP timing out, Redis errors
                errors += 1
                first_error = first_error or repr(exc)
                continue
            t_acq = time.monotonic_ns()
            reqs.append(t_req)
            if handle is None:  # a peer's bounded wait ran out
                acqs.append(-1)
                rels.append(-1)
                break
            # Critical section: nobody else may be inside.
            if shared.inside.value != 0:
                violations += 1
            shared.inside.value = me
            shared.entries.value += 1
            my_entry = shared.entries.value
            value = shared.counter.value
            time.sleep(cs_seconds)
            shared.counter.value = value + 1
            if shared.inside.value != me:
                violations += 1
            shared.inside.value = 0
            t_rel = time.monotonic_ns()
            acqs.append(t_acq)
            rels.append(t_rel)
            try:
                release(handle)
            except Exception as exc:
                errors += 1
                first_error = first_error or repr(exc)
            if relay:
                # Re-request only once another process has entered: every
                # grant is then a handoff to a process that was waiting.
                while shared.entries.value == my_entry and time.monotonic_ns() < deadline:
                    time.sleep(RELAY_POLL)
        usage = (_cpu_ns() - cpu0, _SendCounter.sends - sends0)
        out.put((idx, reqs, acqs, rels, violations, errors, first_error, usage))
    except BaseException:
        fault = traceback.format_exc(limit=3)
        out.put((idx, reqs, acqs, rels, violations, errors + 1, fault, (0, 0)))
    finally:
        out.close()
        out.join_thread()  # flush the report before leaving
        os._exit(0)  # skip atexit handlers inherited from the parent (the server's)


def _set_start(shared: _Shared) -> Callable[[], None]:
    def action() -> None:
        shared.start_ns.value = time.monotonic_ns()

    return action


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of an ascending list; NaN if empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def jain_index(counts: list[int]) -> float:
    """Jain's fairness index: 1.0 when every process got the same share."""
    total = sum(counts)
    squares = sum(c * c for c in counts)
    if not counts or squares == 0:
        return 0.0
    return total * total / (len(counts) * squares)


@dataclass
class ContentionResult:
    """One library at one process count."""

    lib: str
    procs: int
    duration: float
    mode: str = "open"
    grants: int = 0
    per_process: list[int] = field(default_factory=list)
    handoffs_ms: list[float] = field(default_factory=list)
    self_reacquire: int = 0
    violations: int = 0
    lost_updates: int = 0
    errors: int = 0
    first_error: str = ""
    gave_up: int = 0
    killed: int = 0
    #: Every wait (ms, ascending): max and p99 derive from it, and trials pool it.
    waits_ms: list[float] = field(default_factory=list)
    #: Handoff p50 (ms) of each trial pooled into this result, in run order
    #: (one entry for a single run).
    trial_p50s_ms: list[float] = field(default_factory=list)
    #: Grants per second of each trial, in run order.
    trial_throughputs: list[float] = field(default_factory=list)
    #: Commands Redis ran during the run (INFO commandstats, scripts' own
    #: commands included), when counted (``count_commands=True``).
    commands: dict[str, int] = field(default_factory=dict)
    #: CPU time (ns) the contending processes used in their timed loops,
    #: summed, and the sends (round trips) they made there.
    client_cpu_ns: int = 0
    sends: int = 0
    #: CPU time (ns) redis-server used during the run (INFO cpu; start-up
    #: and drain included), when counted (``count_commands=True``).
    server_cpu_ns: int = 0

    def per_grant_us(self, ns: int) -> float:
        """``ns`` per grant, in microseconds (NaN when nothing was granted)."""
        return ns / 1000 / self.grants if self.grants else math.nan

    @property
    def sends_per_grant(self) -> float:
        return self.sends / self.grants if self.grants else math.nan

    @property
    def commands_per_grant(self) -> float:
        """Redis commands per grant (NaN when not counted or nothing granted)."""
        total = sum(self.commands.values())
        return total / self.grants if total and self.grants else math.nan

    @property
    def throughput(self) -> float:
        """Grants per second over every process."""
        return self.grants / self.duration if self.duration else 0.0

    @property
    def handoff_p50_ms(self) -> float:
        return percentile(self.handoffs_ms, 0.50)

    @property
    def handoff_p99_ms(self) -> float:
        return percentile(self.handoffs_ms, 0.99)

    @property
    def max_wait_ms(self) -> float:
        """The longest wait (a request still waiting at the end counts up to the end)."""
        return self.waits_ms[-1] if self.waits_ms else 0.0

    @property
    def wait_p99_ms(self) -> float:
        return percentile(self.waits_ms, 0.99)

    @property
    def jain(self) -> float:
        return jain_index(self.per_process)

    @property
    def self_reacquire_share(self) -> float:
        """Share of consecutive grant pairs that went to the same process."""
        pairs = len(self.handoffs_ms) + self.self_reacquire
        return self.self_reacquire / pairs if pairs else 0.0


def run_contention(
    url: str,
    lib: str,
    procs: int,
    duration: float,
    cs_seconds: float = 0.0005,
    *,
    relay: bool = False,
    count_commands: bool = False,
) -> ContentionResult:
    """Run ``procs`` forked processes contending for one lock of ``lib``.

    ``relay=False`` (open contention): each process re-requests the lock right
    after releasing it, so an unfair lock lets the releaser barge back in.
    ``relay=True``: a releaser re-requests only once another process has
    entered the critical section, so every grant goes to a process that was
    already waiting; this isolates the handoff latency of the wake-up path.

    Blocks for about ``duration`` seconds plus start-up and drain. Uses the
    Redis at ``url`` as a scratch server (its keys are flushed first).
    ``count_commands``: reset the server's command statistics first and keep
    the commands run meanwhile (start-up and drain included) in the result.
    """
    if lib not in LIBS:
        raise ValueError(f"unknown library {lib!r}; choose from {LIBS}")
    admin = make_client(url)
    server_cpu0 = 0.0
    try:
        admin.flushdb()
        if count_commands:
            admin.config_resetstat()
            server_cpu0 = server_cpu_s(admin)
    finally:
        admin.close()
    # Imported here, before forking: an import in each child would fall
    # inside the timed window (about a second per child on a loaded machine).
    if lib == "celery-redislock":
        import celery_redislock  # noqa: F401
    elif lib == "python-redis-lock":
        import redis_lock  # noqa: F401
    ctx = mp.get_context("fork")
    shared = _Shared(*(ctx.RawValue("q", 0) for _ in range(4)))
    barrier = ctx.Barrier(procs, action=_set_start(shared))
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(lib, url, i, duration, cs_seconds, relay, shared, barrier, out),
            name=f"bench-{lib}-{i}",
            daemon=True,
        )
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    reports = collect_reports(out, workers, procs, duration)
    killed = 0
    for w in workers:
        w.join(timeout=2)
        if w.is_alive():
            killed += 1
            w.kill()
            w.join()
    out.close()
    res = _summarise(lib, procs, duration, shared, reports, killed)
    res.mode = "relay" if relay else "open"
    if count_commands:
        admin = make_client(url)
        try:
            res.server_cpu_ns = int((server_cpu_s(admin) - server_cpu0) * 1e9)
            for key, value in admin.info("commandstats").items():
                name = str(key).removeprefix("cmdstat_")
                if name not in (
                    "info",
                    "config|resetstat",
                    "flushdb",
                    "ping",
                    "hello",
                    "client|setinfo",
                ):
                    res.commands[name] = int(value["calls"])
        finally:
            admin.close()
    return res


def _summarise(
    lib: str,
    procs: int,
    duration: float,
    shared: _Shared,
    reports: dict[int, tuple[Any, ...]],
    killed: int,
) -> ContentionResult:
    res = ContentionResult(lib=lib, procs=procs, duration=duration, killed=killed)
    start = shared.start_ns.value
    deadline = start + int(duration * 1e9)
    grants: list[tuple[int, int, int]] = []  # (t_acq, t_rel, idx)
    waits: list[float] = []
    counts = [0] * procs
    total_cs = 0
    for idx, reqs, acqs, rels, violations, errors, first_error, usage in reports.values():
        res.client_cpu_ns += usage[0]
        res.sends += usage[1]
        res.violations += violations
        res.errors += errors
        if first_error and not res.first_error:
            res.first_error = first_error
        for t_req, t_acq, t_rel in zip(reqs, acqs, rels):
            if t_acq < 0:
                res.gave_up += 1
                waits.append((deadline - t_req) / 1e6)
                continue
            total_cs += 1
            if t_req < deadline:
                waits.append((min(t_acq, deadline) - t_req) / 1e6)
            if t_acq < deadline:
                counts[idx] += 1
                grants.append((t_acq, t_rel, idx))
    res.lost_updates = total_cs - shared.counter.value
    res.per_process = counts
    res.grants = sum(counts)
    grants.sort()
    for (_, prev_rel, prev_idx), (acq, _, idx) in zip(grants, grants[1:]):
        if idx == prev_idx:
            res.self_reacquire += 1
        elif acq >= prev_rel:
            res.handoffs_ms.append((acq - prev_rel) / 1e6)
    res.handoffs_ms.sort()
    waits.sort()
    res.waits_ms = waits
    res.trial_p50s_ms = [res.handoff_p50_ms]
    res.trial_throughputs = [res.throughput]
    return res


def pool(trials: list[ContentionResult]) -> ContentionResult:
    """One result from several trials of the same library, mode and process count.

    Samples are pooled (handoffs, waits), counts summed (grants per process,
    violations, errors) and durations added, so percentiles and Jain's index
    are over every trial at once. ``trial_p50s_ms`` keeps each trial's own
    handoff p50, in run order, so the spread between trials stays visible.
    """
    if not trials:
        raise ValueError("pool() needs at least one trial")
    first = trials[0]
    keys = {(t.lib, t.mode, t.procs) for t in trials}
    if len(keys) != 1:
        raise ValueError(f"pool() mixes configurations: {sorted(keys)}")
    out = ContentionResult(lib=first.lib, procs=first.procs, duration=0.0, mode=first.mode)
    out.per_process = [0] * first.procs
    for t in trials:
        out.duration += t.duration
        out.grants += t.grants
        out.per_process = [a + b for a, b in zip(out.per_process, t.per_process)]
        out.handoffs_ms.extend(t.handoffs_ms)
        out.waits_ms.extend(t.waits_ms)
        out.self_reacquire += t.self_reacquire
        out.violations += t.violations
        out.lost_updates += t.lost_updates
        out.errors += t.errors
        out.first_error = out.first_error or t.first_error
        out.gave_up += t.gave_up
        out.killed += t.killed
        out.trial_p50s_ms.extend(t.trial_p50s_ms)
        out.trial_throughputs.extend(t.trial_throughputs)
        for name, calls in t.commands.items():
            out.commands[name] = out.commands.get(name, 0) + calls
        out.client_cpu_ns += t.client_cpu_ns
        out.sends += t.sends
        out.server_cpu_ns += t.server_cpu_ns
    out.handoffs_ms.sort()
    out.waits_ms.sort()
    return out


def run_trials(
    url: str,
    procs: int,
    duration: float,
    trials: int,
    cs_seconds: float = 0.0005,
    *,
    relay: bool = False,
    libs: tuple[str, ...] = LIBS,
    progress: Callable[[ContentionResult], None] | None = None,
    count_commands: bool = False,
) -> list[ContentionResult]:
    """Run ``trials`` rounds of every library, interleaved, and pool each library's rounds.

    Round ``i`` runs the libraries in an order rotated by ``i`` (A B C, then
    B C A, ...), so no library always runs first or right after another one,
    and slow drifts of the machine (other jobs, thermal state) fall on every
    library alike. Returns one pooled result per library, in ``libs`` order.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, not {trials}")
    runs: dict[str, list[ContentionResult]] = {lib: [] for lib in libs}
    for i in range(trials):
        order = libs[i % len(libs) :] + libs[: i % len(libs)]
        for lib in order:
            res = run_contention(
                url, lib, procs, duration, cs_seconds, relay=relay, count_commands=count_commands
            )
            if progress is not None:
                progress(res)
            runs[lib].append(res)
    return [pool(runs[lib]) for lib in libs]


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(results: list[ContentionResult]) -> str:
    """The contention results as one markdown table."""
    lines = [
        "| mode | library | procs | grants/s | handoff p50 ms | handoff p99 ms | handoffs | "
        "self re-acquire | Jain | max wait ms | wait p99 ms | violations | lost updates | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        errors = str(r.errors)
        if r.gave_up or r.killed:
            errors += f" (gave up {r.gave_up}, killed {r.killed})"
        lines.append(
            f"| {r.mode} | {r.lib} | {r.procs} | {r.throughput:.0f} | "
            f"{_fmt(r.handoff_p50_ms, 3)} | {_fmt(r.handoff_p99_ms, 3)} | {len(r.handoffs_ms)} | "
            f"{r.self_reacquire_share:.0%} | {r.jain:.3f} | {r.max_wait_ms:.1f} | "
            f"{_fmt(r.wait_p99_ms, 1)} | {r.violations} | {r.lost_updates} | {errors} |"
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "n/a"
    ratio = a / b
    if ratio < 0.1:
        return f"{ratio:.4f}x (1/{1 / ratio:.0f})" if ratio else "0x"
    return f"{ratio:.2f}x"


def ratio_lines(results: list[ContentionResult], subject: str = "celery-redislock") -> list[str]:
    """``subject`` against each peer measured in the same run, per process count.

    Handoff latency comes from the relay runs (every grant is a handoff to a
    waiting process); throughput and fairness from the open runs.
    """
    by = {(r.mode, r.lib, r.procs): r for r in results}
    lines = []
    for procs in sorted({r.procs for r in results}):
        relay_me, open_me = by.get(("relay", subject, procs)), by.get(("open", subject, procs))
        for lib in LIBS:
            if lib == subject:
                continue
            parts = []
            relay_peer = by.get(("relay", lib, procs))
            if relay_me and relay_peer:
                text = (
                    f"handoff p50 = {_ratio(relay_me.handoff_p50_ms, relay_peer.handoff_p50_ms)}"
                    f", p99 = {_ratio(relay_me.handoff_p99_ms, relay_peer.handoff_p99_ms)}"
                )
                pairs = list(zip(relay_me.trial_p50s_ms, relay_peer.trial_p50s_ms))
                if len(pairs) > 1:
                    text += " (p50 per trial: " + ", ".join(_ratio(a, b) for a, b in pairs) + ")"
                parts.append(text)
            open_peer = by.get(("open", lib, procs))
            if open_me and open_peer:
                parts.append(
                    f"open throughput = {_ratio(open_me.throughput, open_peer.throughput)}, "
                    f"Jain {open_me.jain:.3f} vs {open_peer.jain:.3f}, "
                    f"max wait {open_me.max_wait_ms:.0f} vs {open_peer.max_wait_ms:.0f} ms"
                )
            if parts:
                lines.append(f"- {procs} processes, {subject} vs {lib}: " + "; ".join(parts))
    return lines


#: Target 2: celery-redislock's open-mode throughput with a zero-length
#: critical section against python-redis-lock's, at every process count.
THROUGHPUT_TARGET = 1.5


def throughput_lines(results: list[ContentionResult]) -> list[str]:
    """Open-mode throughput of each library against python-redis-lock's, per
    process count, with Redis commands per grant and each round's ratio."""
    by = {(r.lib, r.procs): r for r in results if r.mode == "open"}
    lines = []
    for procs in sorted({r.procs for r in results}):
        ref = by.get(("python-redis-lock", procs))
        for r in (x for x in results if x.mode == "open" and x.procs == procs):
            text = (
                f"- {procs} processes, {r.lib}: {r.throughput:.0f} grants/s"
                f", {r.commands_per_grant:.1f} Redis commands per grant"
                f", {r.sends_per_grant:.2f} round trips per grant"
                f", CPU per grant: clients {r.per_grant_us(r.client_cpu_ns):.0f} us"
                f", redis-server {r.per_grant_us(r.server_cpu_ns):.0f} us"
                f", Jain {r.jain:.3f}"
            )
            if ref is not None and r is not ref:
                text += f", {_ratio(r.throughput, ref.throughput)} python-redis-lock's"
                pairs = list(zip(r.trial_throughputs, ref.trial_throughputs))
                if len(pairs) > 1:
                    text += " (per round: " + ", ".join(_ratio(a, b) for a, b in pairs) + ")"
            if r.commands:
                top = sorted(r.commands.items(), key=lambda kv: -kv[1])[:8]
                text += "; per grant: " + ", ".join(
                    f"{k} {v / r.grants:.1f}" for k, v in top if r.grants
                )
            lines.append(text)
    return lines


def throughput_target_lines(
    open_zero: list[ContentionResult], relay: list[ContentionResult]
) -> list[str]:
    """``target 2 ...: met`` / ``NOT met`` per process count: open-mode throughput
    (zero-length critical section) at least THROUGHPUT_TARGET x python-redis-lock's,
    relay handoff p50 at or below it in every round, Jain >= 0.99, no violation."""
    lines = []
    for procs in sorted({r.procs for r in open_zero}):
        by = {r.lib: r for r in open_zero if r.procs == procs}
        me, ref = by.get("celery-redislock"), by.get("python-redis-lock")
        if me is None or ref is None:
            continue
        ratio = me.throughput / ref.throughput if ref.throughput else math.nan
        relay_by = {r.lib: r for r in relay if r.procs == procs and r.mode == "relay"}
        rme, rref = relay_by.get("celery-redislock"), relay_by.get("python-redis-lock")
        problems = []
        if not ratio >= THROUGHPUT_TARGET:
            problems.append(f"{ratio:.2f}x throughput")
        rounds = ""
        if rme is not None and rref is not None:
            pairs = list(zip(rme.trial_p50s_ms, rref.trial_p50s_ms))
            below = sum(a <= b for a, b in pairs)
            rounds = f", handoff p50 at or below in {below} of {len(pairs)} relay rounds"
            if below < len(pairs):
                problems.append(f"handoff p50 above in {len(pairs) - below} rounds")
        if me.jain < 0.99:
            problems.append(f"Jain {me.jain:.3f}")
        if me.violations or me.lost_updates:
            problems.append("exclusion violated")
        verdict = "met" if not problems else "NOT met (" + ", ".join(problems) + ")"
        lines.append(
            f"target 2 ({procs} processes: open throughput >= {THROUGHPUT_TARGET:g}x "
            f"python-redis-lock's with a zero-length critical section, relay handoff p50 at or "
            f"below it in every round, Jain >= 0.99): {verdict}; {ratio:.2f}x "
            f"({me.throughput:.0f} vs {ref.throughput:.0f} grants/s), "
            f"{me.commands_per_grant:.1f} Redis commands per grant, Jain {me.jain:.3f}{rounds}"
        )
    return lines
