"""Celery end to end: real prefork workers contending for a few locks, and
the cost of ``@locked`` on a no-op task.

1. **Contention.** For each cell (``--workers`` x ``--concurrency``, default
   2 and 4 workers x 1, 2 and 4 pool children), real ``celery worker -P
   prefork`` subprocesses (the end-to-end harness of ``tests/e2e``) share one
   redis-server as broker, result backend and lock store. A producer sends
   ``--tasks`` short tasks spread round-robin over ``--resources`` resources;
   each task holds ``@locked("cebench:{res}")`` (``on_busy="wait"``) while it
   GETs a counter, works ``--work-ms`` and SETs it + 1. A cell is
   ``--runs`` runs on the same workers, after one uncounted warm-up run.
   Reported per cell: p50 / p99 / max of the lock wait (measured inside the
   task: from ``task_prerun``, just before ``@locked`` asks, to the grant,
   ``Lease.acquired_at``), the runs with any wait over 500 ms ("stalls"),
   and the runs whose counters are exact (each resource's counter equals
   the number of tasks sent to it; anything else is an exclusion bug).
2. **The cost of @locked.** One worker (``-P prefork -c 1``, then ``-P
   solo``) runs ``--rounds`` batches of ``--batch`` no-op tasks, in which
   runs of 10 plain tasks, 10 under ``@locked`` (one uncontended resource)
   and, for contrast, 10 inside redis-py's ``Lock`` (the simplest Redis
   lock: two round trips, like ``@locked``) take turns. Measured twice
   (``--lock-stores``): with the locks on the broker's redis-server, and on
   a redis-server of their own. A gate task holds the worker while the batch is
   queued, so it runs at the worker's pace. From the bodies' own
   ``perf_counter()`` stamps, a kind's cycle is the time from one body to
   the next of the same kind; its rate, one over the round's median cycle
   (see :class:`CostResult`). Results are not stored (``ignore_result``),
   so the no-op baseline is as cheap as Celery gets. Target: ``@locked``
   costs at most 10% of tasks/s (median of the rounds' ratios).
2b. **Where the CPU goes in a prefork worker.** Then, on the same prefork
   worker (not solo: its one process does everything), ``--cpu-rounds``
   rounds of ``--cpu-batch`` no-op tasks, interleaved like the rates'
   (runs of 10 of each kind in turn), while the pool child watches the CPU
   of the worker's main process, itself, the broker's redis-server and the
   locks' redis-server when it is another one: each body records with its
   stamp the ns each has spent on the CPU (``/proc/<pid>/task/<tid>/
   schedstat``; its own ``process_time_ns()``). Per process and kind, the
   median over the rounds of the round's median CPU over the intervals
   between two consecutive bodies of that kind, and the wall time of the
   same intervals (:class:`CpuSplit`). Skipped, saying why, on a kernel
   without schedstats.

Usage::

    make bench-celery
    .venv/bin/python -m benchmarks.celery_e2e [--runs 6] [--tasks 240] [--resources 4]
        [--work-ms 3] [--workers 2,4] [--concurrency 1,2,4] [--rounds 12]
        [--batch 400] [--pools prefork,solo] [--lock-stores broker,own]
        [--cpu-rounds 3] [--cpu-batch 300] [--skip-cost] [--skip-contention]
        [--no-profile] [--out benchmarks/results-celery.md]

3. **Where the time goes** (unless ``--no-profile``): the no-op tasks again
   in a solo worker under cProfile, split into phases (:class:`Profile`).

Starts its own redis-server (as ``benchmarks.run`` does). Prints markdown,
writes it to ``--out`` and exits 1 if any run's counters are not exact.
Not a timed test: tests/test_benchmarks_smoke.py runs it small.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.machine import cpu_model, load_average  # noqa: E402
from e2e.harness import Cluster, Worker, wait_for  # noqa: E402
from redis_server import RedisServer  # noqa: E402

APP = "benchmarks.celery_app"
DEFAULT_OUT = ROOT / "benchmarks" / "results-celery.md"
#: A lock wait longer than this (seconds) makes its run a "stall".
STALL = 0.5
#: Largest share of tasks/s ``@locked`` may cost on a no-op task.
COST_TARGET = 0.10
POOLS = ("prefork", "solo")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


# -- contention -------------------------------------------------------------------


@dataclass
class RunResult:
    """One run of a cell: every task's lock wait, the counters against the sends."""

    waits: list[float]
    expected: dict[str, int]
    counts: dict[str, int]
    complete: bool
    seconds: float

    @property
    def exact(self) -> bool:
        return self.complete and self.counts == self.expected

    @property
    def stalled(self) -> bool:
        return not self.complete or any(w > STALL for w in self.waits)


@dataclass
class CellResult:
    """A cell: ``workers`` prefork workers of ``concurrency`` children, its runs."""

    workers: int
    concurrency: int
    runs: list[RunResult] = field(default_factory=list)

    @property
    def waits(self) -> list[float]:
        return [w for r in self.runs for w in r.waits]

    @property
    def stalls(self) -> int:
        return sum(r.stalled for r in self.runs)

    @property
    def exact_runs(self) -> int:
        return sum(r.exact for r in self.runs)

    @property
    def tasks_per_s(self) -> float:
        rates = [sum(r.expected.values()) / r.seconds for r in self.runs if r.seconds > 0]
        return statistics.median(rates) if rates else math.nan


def contention_run(
    c: Cluster, tasks: int, resources: int, work: float, timeout: float = 120.0
) -> RunResult:
    """Send ``tasks`` write tasks over ``resources`` resources; wait; check the counters."""
    run = uuid.uuid4().hex[:8]
    names = [f"r{i}" for i in range(resources)]
    expected = dict.fromkeys(names, 0)
    waits_key = f"cebench:{run}:waits"
    began = time.monotonic()
    for i in range(tasks):
        res = names[i % resources]
        expected[res] += 1
        c.producer.send_task("cebench.write", args=(res, run, work), queue=c.queue)
    complete = True
    try:
        wait_for(
            lambda: c.data.llen(waits_key) >= tasks,
            timeout=timeout,
            what=f"run {run}: {tasks} tasks finished",
            interval=0.01,
        )
    except AssertionError:
        complete = False
    seconds = time.monotonic() - began
    waits = [float(x) for x in c.data.lrange(waits_key, 0, -1)]
    counts = {n: int(c.data.get(f"cebench:{run}:count:{n}") or 0) for n in names}
    c.data.delete(waits_key, *(f"cebench:{run}:count:{n}" for n in names))
    return RunResult(waits, expected, counts, complete, seconds)


def run_cell(
    broker_url: str,
    workdir: Path,
    workers: int,
    concurrency: int,
    *,
    runs: int,
    tasks: int,
    resources: int = 4,
    work: float = 0.003,
    warmup: bool = True,
    progress: Callable[[str], None] | None = None,
) -> CellResult:
    """Start the cell's workers, run it ``runs`` times (after a warm-up), stop them."""
    c = Cluster(broker_url, workdir, app_module=APP)
    cell = CellResult(workers, concurrency)
    try:
        started = [
            c.start_worker(
                f"w{i}",
                concurrency=concurrency,
                extra_args=["--prefetch-multiplier", "1"],
                wait=False,
            )
            for i in range(workers)
        ]
        for w in started:
            c.wait_ready(w)
        if warmup:
            # Every child opens its connections and loads the scripts here.
            contention_run(c, min(tasks, 4 * workers * concurrency), resources, work)
        for i in range(runs):
            res = contention_run(c, tasks, resources, work)
            cell.runs.append(res)
            if progress is not None:
                progress(
                    f"  {workers}x{concurrency} run {i + 1}/{runs}: {res.seconds:.1f}s "
                    f"max wait {max(res.waits, default=0) * 1000:.0f} ms "
                    f"{'exact' if res.exact else 'NOT EXACT'}"
                )
    finally:
        c.close()
    return cell


# -- the cost of @locked ----------------------------------------------------------


def _median_loss(ratios: list[float]) -> float:
    """Share of tasks/s lost, from per-round rate ratios (median; nan: none)."""
    return 1 - statistics.median(ratios) if ratios else math.nan


@dataclass
class CostResult:
    """Per-round no-op rates (tasks/s) with and without ``@locked``.

    A round is one batch in which runs of :data:`RUN` plain tasks alternate
    with runs of :data:`RUN` ``@locked`` ones. The time from one body to the
    next within a run of one kind is one whole task cycle of that kind
    (Celery's handling, plus ``@locked``'s release and next acquire); the
    intervals across a change of kind are left out. A round's rate is one
    over its median cycle: the two kinds are timed within the same second,
    so load from other processes hits both alike, and a burst of it moves
    the median little.
    """

    pool: str
    #: Where the locks live: "broker" (the redis-server that is also the
    #: worker's broker and result backend) or "own" (a redis-server of
    #: their own).
    store: str = "broker"
    plain: list[float] = field(default_factory=list)
    locked: list[float] = field(default_factory=list)
    #: The same no-op body inside redis-py's ``Lock`` (a peer, for contrast).
    peer: list[float] = field(default_factory=list)
    #: CPU per task by process (prefork only; None when not measured).
    cpu: CpuSplit | None = None

    @property
    def ratios(self) -> list[float]:
        return [b / a for a, b in zip(self.plain, self.locked)]

    @property
    def peer_cost(self) -> float:
        """Share of tasks/s lost to redis-py's ``Lock`` (median over rounds)."""
        return _median_loss([b / a for a, b in zip(self.plain, self.peer)])

    @property
    def cost(self) -> float:
        """Share of tasks/s lost to ``@locked`` (median over rounds)."""
        return _median_loss(self.ratios)

    @property
    def met(self) -> bool:
        return self.cost <= COST_TARGET


#: Tasks of one kind in a row in a cost batch.
RUN = 10
KINDS = {"p": "cebench.noop", "l": "cebench.noop_locked", "r": "cebench.noop_redis_py_lock"}
#: The order of the kinds' runs in each round, rotated by round.
ORDERS = ("plr", "lrp", "rpl")


def _run_batch(c: Cluster, worker: Worker, kinds: str) -> list[list[Any]]:
    """Run one no-op task per letter of ``kinds`` (``p``/``l``/``r``) on ``worker``,
    all queued behind a gate; return the bodies' stamps as the worker sent
    them: ``[perf_counter, kind]``, and the CPU reading while it watches."""
    gate = f"cebench:gate:{uuid.uuid4().hex[:8]}"
    c.producer.send_task("cebench.gate", args=(gate,), queue=worker.queue)
    wait_for(lambda: c.data.llen(f"{gate}:in"), timeout=60, what="the gate task to start")
    for kind in kinds:
        c.producer.send_task(KINDS[kind], args=("solo",), queue=worker.queue)
    c.data.rpush(gate, "go")
    stamps = c.producer.send_task("cebench.stamps", queue=worker.queue).get(timeout=300)
    c.data.delete(gate, f"{gate}:in")
    if "".join(str(s[1]) for s in stamps) != kinds:
        raise AssertionError(f"{len(stamps)} of {len(kinds)} tasks ran, in order?\n{c.report()}")
    return [list(s) for s in stamps]


def _batch(c: Cluster, worker: Worker, kinds: str) -> list[tuple[float, str]]:
    """:func:`_run_batch`; the bodies' ``(perf_counter, kind)``."""
    return [(float(s[0]), str(s[1])) for s in _run_batch(c, worker, kinds)]


def _same_kind_pairs(stamps: Sequence[Sequence[Any]]) -> Iterator[tuple[Any, Any]]:
    """Each two consecutive stamps of the same kind (``stamp[1]``): the
    interval between them is one whole task cycle of that kind; intervals
    across a change of kind are left out."""
    for a, b in zip(stamps, stamps[1:]):
        if a[1] == b[1]:
            yield a, b


def _round_kinds(round_index: int, batch: int) -> str:
    """The kinds of one round's batch: runs of :data:`RUN` tasks of each kind
    in turn (at least 3 runs, about ``batch`` tasks), in the order of
    :data:`ORDERS` rotated by round."""
    order = ORDERS[round_index % len(ORDERS)]
    return "".join(order[j % len(order)] * RUN for j in range(max(3, batch // RUN)))


def cycle_rates(stamps: list[tuple[float, str]]) -> dict[str, float]:
    """Tasks/s of each kind: one over the median body-to-body interval
    between two consecutive tasks of that kind."""
    gaps: dict[str, list[float]] = {}
    for (t0, k0), (t1, _) in _same_kind_pairs(stamps):
        gaps.setdefault(k0, []).append(t1 - t0)
    return {k: 1 / statistics.median(v) for k, v in gaps.items()}


def measure_cost(
    c: Cluster,
    worker: Worker,
    pool: str,
    *,
    rounds: int,
    batch: int,
    progress: Callable[[str], None] | None = None,
) -> CostResult:
    """``rounds`` batches of ``batch`` no-op tasks on ``worker``, runs of
    plain, ``@locked`` and redis-py ``Lock`` ones in turn (the order rotated
    by round, :data:`ORDERS`)."""
    _batch(c, worker, "".join(k * RUN for k in ORDERS[0]) * 2)  # warm-up: connections, scripts
    result = CostResult(pool)
    for i in range(rounds):
        rates = cycle_rates(_batch(c, worker, _round_kinds(i, batch)))
        result.plain.append(rates["p"])
        result.locked.append(rates["l"])
        result.peer.append(rates["r"])
        if progress is not None:
            progress(
                f"  {pool} round {i + 1}/{rounds}: plain {result.plain[-1]:.0f}/s "
                f"locked {result.locked[-1]:.0f}/s redis-py Lock {result.peer[-1]:.0f}/s"
            )
    return result


#: Defaults of the CPU split: rounds, and tasks per round (all kinds).
CPU_ROUNDS = 3
CPU_BATCH = 300
#: The processes of the CPU split, in the table's order, with their labels.
PROCESSES = {
    "main": "worker main process (receives the messages, feeds the child)",
    "child": "pool child (runs the task)",
    "broker": "broker's redis-server",
    "locks": "locks' redis-server",
}


def _redis_server_pid(url: str) -> int | None:
    """The pid of the redis-server at ``url`` if it runs on this machine
    (INFO server's ``process_id`` names a local redis-server); else None."""
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None  # INFO refused (a least-privilege user), or no process_id
    finally:
        client.close()
    try:
        comm = Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return None
    return pid if comm.startswith("redis") else None


def cpu_pids(c: Cluster, worker: Worker, lock_url: str | None = None) -> dict[str, int]:
    """The pids of the processes of :data:`PROCESSES` for a ``-c 1`` prefork
    ``worker``: the main process, its pool child (the one that answers
    ``e2e.ping``), the broker's redis-server and, when the locks live on
    another one, that redis-server. A redis-server not on this machine is
    left out."""
    child = c.producer.send_task("e2e.ping", queue=worker.queue).get(timeout=60)["pid"]
    pids = {"main": worker.pid, "child": int(child)}
    broker = _redis_server_pid(c.broker_url)
    if broker is not None:
        pids["broker"] = broker
    locks = _redis_server_pid(lock_url) if lock_url else None
    if locks is not None and locks != broker:
        pids["locks"] = locks
    return pids


@dataclass
class CpuSplit:
    """Where the CPU goes in a prefork worker: µs of CPU per no-op task, by
    process and kind (``p`` plain, ``l`` ``@locked``, ``r`` redis-py ``Lock``).

    Measured like the rates (:class:`CostResult`): each round is one batch
    of ``batch`` tasks in which runs of :data:`RUN` tasks of each kind take
    turns (the order rotated by round, :data:`ORDERS`). While it runs, each
    body records with its stamp the ns on CPU so far of every process
    (``/proc/<pid>/task/<tid>/schedstat``; the pool child's own
    ``time.process_time_ns()``): the delta from one body to the next of the
    same kind is one task cycle's CPU in each process. Per round, process
    and kind: the median of those deltas; reported: the median over rounds.
    """

    batch: int
    #: The processes measured (keys of :data:`PROCESSES`).
    processes: list[str]
    #: kind -> process -> per-round median µs of CPU per task cycle.
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    #: kind -> per-round median wall µs per task cycle (the same intervals).
    wall: dict[str, list[float]] = field(default_factory=dict)
    #: kind -> per-round count of the intervals the medians are taken over.
    intervals: dict[str, list[int]] = field(default_factory=dict)
    #: The pool child's CPU per reading of the processes' counters (µs),
    #: paid once per body whatever the kind.
    read_us: float = math.nan
    #: Why the split was not measured (None: it was).
    skipped: str | None = None

    @property
    def rounds(self) -> int:
        return len(self.wall.get("p", []))

    def cpu_us(self, kind: str, process: str) -> float:
        """Median over the rounds of ``process``'s µs of CPU per ``kind`` task."""
        return _median(self.cpu.get(kind, {}).get(process, []))

    def total_us(self, kind: str) -> float:
        """The processes' medians added up (those measured)."""
        values = [self.cpu_us(kind, p) for p in self.processes]
        return sum(v for v in values if not math.isnan(v))

    def wall_us(self, kind: str) -> float:
        """Median over the rounds of the wall µs per ``kind`` task."""
        return _median(self.wall.get(kind, []))


def _median(values: list[float]) -> float:
    """Median of the values that are not NaN (NaN if none)."""
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def cycle_cpu(
    stamps: list[list[Any]], processes: list[str]
) -> tuple[dict[str, dict[str, float]], dict[str, float], dict[str, int]]:
    """From one batch's stamps ``[perf_counter, kind, [ns per process]]``:
    per kind, the median over the intervals between two consecutive bodies
    of that kind (the pairing of :func:`cycle_rates`) of each process's µs
    of CPU, the median wall µs of the same intervals, and their count."""
    cpu: dict[str, dict[str, list[float]]] = {}
    wall: dict[str, list[float]] = {}
    for (t0, k0, ns0), (t1, _, ns1) in _same_kind_pairs(stamps):
        per = cpu.setdefault(k0, {})
        for name, a, b in zip(processes, ns0, ns1):
            per.setdefault(name, []).append((b - a) / 1000)
        wall.setdefault(k0, []).append((t1 - t0) * 1e6)
    return (
        {k: {n: statistics.median(v) for n, v in per.items()} for k, per in cpu.items()},
        {k: statistics.median(v) for k, v in wall.items()},
        {k: len(v) for k, v in wall.items()},
    )


def _watch(c: Cluster, worker: Worker, pids: list[int]) -> dict[str, Any]:
    """Have ``worker``'s pool child watch the CPU of ``pids`` (``[]``: stop)."""
    reply = c.producer.send_task("cebench.cpu_watch", args=(pids,), queue=worker.queue)
    return dict(reply.get(timeout=60))


def measure_cpu(
    c: Cluster,
    worker: Worker,
    pids: dict[str, int],
    *,
    rounds: int,
    batch: int,
    progress: Callable[[str], None] | None = None,
) -> CpuSplit:
    """``rounds`` batches of ``batch`` no-op tasks on ``worker``, runs of
    each kind in turn, while the pool child watches the CPU of the processes
    of ``pids`` (:func:`cpu_pids`); the CPU of each per task, and the wall
    time per task (:class:`CpuSplit`). Skipped, with the reason, where the
    kernel keeps no ``/proc/<pid>/task/<tid>/schedstat``."""
    split = CpuSplit(len(_round_kinds(0, batch)), list(pids))
    names = list(pids)
    try:
        reply = _watch(c, worker, list(pids.values()))
        unread = [n for n, ns in zip(names, reply["reading"]) if ns <= 0]
        if unread:
            split.skipped = (
                f"no CPU time in /proc/<pid>/task/<tid>/schedstat for {', '.join(unread)} "
                "(a kernel without schedstats?)"
            )
            return split
        split.read_us = reply["read_ns"] / 1000
        for i in range(rounds):
            stamps = _run_batch(c, worker, _round_kinds(i, batch))
            if any(len(s) < 3 for s in stamps):
                raise AssertionError(f"a body ran without the CPU watch\n{c.report()}")
            cpu, wall, count = cycle_cpu(stamps, names)
            for kind in "plr":
                per = split.cpu.setdefault(kind, {})
                for name in names:
                    per.setdefault(name, []).append(cpu[kind][name])
                split.wall.setdefault(kind, []).append(wall[kind])
                split.intervals.setdefault(kind, []).append(count[kind])
            if progress is not None:
                progress(
                    f"  CPU split round {i + 1}/{rounds}: main process "
                    + ", ".join(f"{k} {split.cpu[k]['main'][-1]:.0f}" for k in "plr")
                    + ", pool child "
                    + ", ".join(f"{k} {split.cpu[k]['child'][-1]:.0f}" for k in "plr")
                    + " µs of CPU per task"
                )
    finally:
        _watch(c, worker, [])
    return split


def run_cost(
    broker_url: str,
    workdir: Path,
    pool: str,
    *,
    rounds: int,
    batch: int,
    progress: Callable[[str], None] | None = None,
    lock_url: str | None = None,
    cpu_rounds: int = 0,
    cpu_batch: int = CPU_BATCH,
) -> CostResult:
    """Start one worker (``-P prefork -c 1`` or ``-P solo``), measure, stop it.

    ``lock_url``: the lock store (``@locked``'s and the peer lock's) on that
    Redis instead of the broker's. ``cpu_rounds`` (0: none): for prefork,
    then split the CPU by process on the same worker (:func:`measure_cpu`,
    ``cpu_batch`` tasks per round); solo has no main process apart from the
    one that runs the task, so it is not split.
    """
    c = Cluster(broker_url, workdir, app_module=APP)
    try:
        env = {"E2E_LOCK_URL": lock_url} if lock_url else None
        worker = c.start_worker("cost", concurrency=1, pool=pool, env=env)
        result = measure_cost(c, worker, pool, rounds=rounds, batch=batch, progress=progress)
        result.store = "own" if lock_url else "broker"
        if pool == "prefork" and cpu_rounds > 0:
            pids = cpu_pids(c, worker, lock_url)
            result.cpu = measure_cpu(
                c, worker, pids, rounds=cpu_rounds, batch=cpu_batch, progress=progress
            )
        return result
    finally:
        c.close()


@dataclass
class Profile:
    """Where a solo worker's time goes per no-op task, under cProfile (µs per task).

    cProfile slows Python-heavy code more than waiting on a socket, so the
    shares are indicative; the unprofiled cost is :class:`CostResult`'s.
    """

    tasks: int
    plain_call: float  # the task call (Celery's __protected_call__), no @locked
    locked_call: float  # the same with @locked
    wrapper: float  # @locked's wrapper, body and all
    acquire: float  # LockManager.acquire, its round trip included
    release: float  # Lease.release, its round trip included
    round_trips: float  # the scripts' round trips (client + Redis), both included above
    socket: float  # of the round trips: in send and recv on the socket (waiting for Redis)
    server: float  # Redis executing the scripts (INFO commandstats, not profiled)
    top: str  # the heaviest functions of the @locked run, by own time
    #: For contrast, the same body inside redis-py's ``Lock``: the task call,
    #: its time in send/recv, and Redis executing its SET and release script.
    peer_call: float = math.nan
    peer_socket: float = math.nan
    peer_server: float = math.nan


def _entry(stats: dict, path_end: str, func: str) -> float:
    return sum(v[3] for k, v in stats.items() if k[0].endswith(path_end) and k[2] == func)


def _socket_time(stats: dict) -> float:
    return sum(
        v[2]
        for k, v in stats.items()
        if k[0] == "~" and "_socket.socket" in k[2] and ("recv" in k[2] or "send" in k[2])
    )


def run_profile(
    broker_url: str, workdir: Path, *, batch: int, out_dir: Path | None = None
) -> Profile:
    """Profile the no-op tasks in a solo worker (``CEBENCH_PROFILE=1``)."""
    import io
    import pstats

    c = Cluster(broker_url, workdir, app_module=APP)
    out_dir = out_dir or Path(workdir)
    calls: dict[str, float] = {}
    try:
        worker = c.start_worker("prof", concurrency=1, pool="solo", env={"CEBENCH_PROFILE": "1"})
        peer_socket = peer_server = math.nan
        for name, kind in (("plain", "p"), ("locked", "l"), ("peer", "r")):
            _batch(c, worker, kind * 50)  # warm-up, then forget it
            dump = str(out_dir / f"cebench-{name}.prof")
            c.producer.send_task("cebench.profile_dump", args=(dump,), queue=worker.queue).get(60)
            c.lock_redis.config_resetstat()
            _batch(c, worker, kind * batch)
            # Only the locks run scripts or SET on this server (not the broker, not the backend).
            cmdstats = c.lock_redis.info("commandstats")
            evalsha = cmdstats.get("cmdstat_evalsha", {})
            c.producer.send_task("cebench.profile_dump", args=(dump,), queue=worker.queue).get(60)
            st = pstats.Stats(dump)
            stats = st.stats  # type: ignore[attr-defined]
            calls[name] = _entry(stats, "celery/app/trace.py", "__protected_call__")
            if name == "locked":
                text = io.StringIO()
                pstats.Stats(dump, stream=text).sort_stats("tottime").print_stats(15)
                # Paths relative to the checkout and to site-packages, for the report.
                top = re.sub(r"/\S*/site-packages/", "", text.getvalue())
                top = top.replace(str(ROOT) + "/", "").replace(str(out_dir) + "/", "")
                wrapper = _entry(stats, "celery_redislock/integration/locked.py", "wrapper")
                acquire = _entry(stats, "celery_redislock/engine/manager.py", "acquire")
                release = _entry(stats, "celery_redislock/engine/lease.py", "release")
                # Scripts.run through redis-py, run_direct on a held connection.
                trips = _entry(stats, "celery_redislock/store/scripts.py", "run") + _entry(
                    stats, "celery_redislock/store/scripts.py", "run_direct"
                )
                socket = _socket_time(stats)
                server = float(evalsha.get("usec", 0))
            if name == "peer":
                peer_socket = _socket_time(stats)
                peer_server = float(evalsha.get("usec", 0)) + float(
                    cmdstats.get("cmdstat_set", {}).get("usec", 0)
                )
    finally:
        c.close()
    per = 1e6 / batch
    return Profile(
        batch,
        calls["plain"] * per,
        calls["locked"] * per,
        wrapper * per,
        acquire * per,
        release * per,
        trips * per,
        socket * per,
        server / batch,
        top,
        calls["peer"] * per,
        peer_socket * per,
        peer_server / batch,
    )


def profile_markdown(p: Profile) -> str:
    """Per-task phases of the profiled solo worker."""
    rows = [
        ("the task call without @locked (Celery's call wrapper and the body)", p.plain_call),
        ("the task call with @locked", p.locked_call),
        ("  of which @locked's wrapper (body included)", p.wrapper),
        ("    LockManager.acquire (round trip included)", p.acquire),
        ("    Lease.release (round trip included)", p.release),
        ("    of these two, the scripts' round trips (client + Redis)", p.round_trips),
        ("      of which in send/recv on the socket (waiting for Redis)", p.socket),
        ("        within it, Redis executing the scripts (commandstats)", p.server),
        ("      of which the client's Python (packing, parsing)", p.round_trips - p.socket),
        ("    of these two, the engine's Python", p.acquire + p.release - p.round_trips),
        (
            "    task.py's own Python (arguments, templates, holder record, body run)",
            p.wrapper - p.acquire - p.release,
        ),
        ("the task call inside redis-py's Lock, for contrast (its two round trips)", p.peer_call),
        ("  of which in send/recv on the socket (waiting for Redis)", p.peer_socket),
        ("    within it, Redis executing its SET and release script", p.peer_server),
    ]
    lines = ["| phase (solo worker, under cProfile) | µs per task |", "| --- | --- |"]
    lines += [f"| {name} | {us:.0f} |" for name, us in rows]
    return "\n".join(lines) + "\n"


# -- report -----------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def contention_markdown(cells: list[CellResult]) -> str:
    """The per-cell table and the two correctness lines."""
    lines = [
        "| workers x concurrency | runs | tasks/run | lock wait p50 (ms) | p99 (ms) | "
        f"max (ms) | runs with a wait > {STALL * 1000:.0f} ms (stalls) | runs with exact counts "
        "| tasks/s (median run) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in cells:
        waits = cell.waits
        per_run = statistics.median(sum(r.expected.values()) for r in cell.runs)
        lines.append(
            f"| {cell.workers} x {cell.concurrency} | {len(cell.runs)} | {per_run:.0f} | "
            f"{_ms(percentile(waits, 50))} | {_ms(percentile(waits, 99))} | "
            f"{_ms(max(waits, default=math.nan))} | {cell.stalls} | "
            f"{cell.exact_runs}/{len(cell.runs)} | {cell.tasks_per_s:.0f} |"
        )
    runs = sum(len(c.runs) for c in cells)
    stalls = sum(c.stalls for c in cells)
    wrong = [(c, i, r) for c in cells for i, r in enumerate(c.runs, 1) if not r.exact]
    lines.append("")
    lines.append(
        f"no stall (lock wait > {STALL * 1000:.0f} ms) in any run: "
        + ("met" if stalls == 0 else f"NOT met ({stalls} of {runs} runs)")
    )
    lines.append("")
    if not wrong:
        lines.append(f"counts exact in every run: met ({runs} runs)")
    for c, i, r in wrong:
        what = "did not finish" if not r.complete else "counters differ"
        lines.append(
            f"**EXCLUSION BUG? counts NOT exact** in cell {c.workers} x {c.concurrency} "
            f"run {i} ({what}): counted {r.counts}, sent {r.expected}"
        )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _pool_label(pool: str) -> str:
    return "prefork -c 1" if pool == "prefork" else pool


def _store_label(store: str) -> str:
    return "on the broker's Redis" if store == "broker" else "on a Redis of their own"


def cost_markdown(results: list[CostResult]) -> str:
    """The per-pool cost table and one target line per pool."""
    lines = [
        "| worker | lock store | rounds | no-op tasks/s (median) | with @locked (median) | "
        "time added per task (µs, medians) | per-round cost of @locked | cost (median) | "
        "inside redis-py's Lock (median) | time added (µs) | cost of redis-py's Lock (median) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        plain, locked_ = statistics.median(r.plain), statistics.median(r.locked)
        added = (1 / locked_ - 1 / plain) * 1e6
        rounds = ", ".join(f"{(1 - x) * 100:.1f}%" for x in r.ratios)
        peer = statistics.median(r.peer) if r.peer else math.nan
        peer_added = (1 / peer - 1 / plain) * 1e6 if r.peer else math.nan
        lines.append(
            f"| {_pool_label(r.pool)} | {_store_label(r.store)} | {len(r.ratios)} | "
            f"{plain:.0f} | {locked_:.0f} | "
            f"{added:.0f} | {rounds} | {r.cost * 100:.1f}% | {peer:.0f} | {peer_added:.0f} | "
            f"{r.peer_cost * 100:.1f}% |"
        )
    lines.append("")
    for r in results:
        verdict = "met" if r.met else f"NOT met ({r.cost * 100:.1f}%)"
        lines.append(
            f"target 3b (@locked costs <= {COST_TARGET * 100:.0f}% tasks/s): {verdict} "
            f"[{_pool_label(r.pool)}, locks {_store_label(r.store)}: {r.cost * 100:.1f}%; "
            "for contrast, redis-py's Lock "
            f"around the same body: {r.peer_cost * 100:.1f}%]"
        )
        lines.append("")
    for r in results:
        if r.cpu is not None:
            lines.append(cpu_markdown(r.cpu, r.store))
    return "\n".join(lines).rstrip() + "\n"


def _us(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def _added(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.0f}"


def cpu_markdown(split: CpuSplit, store: str) -> str:
    """The CPU split of one prefork worker: a row per process, their total
    and the wall time per task, with how it is measured under it."""
    title = f"CPU by process, prefork -c 1, locks {_store_label(store)}"
    if split.skipped is not None:
        return f"{title}: not measured: {split.skipped}.\n"
    labels = dict(PROCESSES)
    if store == "broker":
        labels["broker"] += " (and the locks)"
    intervals = min((n for v in split.intervals.values() for n in v), default=0)
    lines = [
        f"{title}: {split.rounds} round{'s' if split.rounds != 1 else ''} of "
        f"{split.batch} tasks, runs of {RUN} of each kind in turn (medians over "
        f"the rounds of each round's median over at least {intervals} intervals "
        "per kind):",
        "",
        "| process | plain (µs CPU per task) | @locked | redis-py Lock | added by @locked "
        "| added by redis-py Lock |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def row(label: str, values: dict[str, float]) -> str:
        p, l_, r = values["p"], values["l"], values["r"]
        return f"| {label} | {_us(p)} | {_us(l_)} | {_us(r)} | {_added(l_ - p)} | {_added(r - p)} |"

    for name in split.processes:
        lines.append(row(labels[name], {k: split.cpu_us(k, name) for k in "plr"}))
    lines.append(row("total (of the medians)", {k: split.total_us(k) for k in "plr"}))
    lines.append(
        row("wall time per task (µs, same intervals)", {k: split.wall_us(k) for k in "plr"})
    )
    lines += [
        "",
        "Each body stamps perf_counter() and the ns each process has spent on the CPU "
        "(/proc/<pid>/task/<tid>/schedstat summed over its threads; the pool child's "
        "own process_time_ns()); a task's CPU in a process is the delta between two "
        "consecutive bodies of the same kind, medians per round. Reading the counters "
        f"costs the pool child about {split.read_us:.0f} µs per task, alike for every "
        "kind (in its row and in the wall time). A process whose CPU per task comes "
        "close to the wall time per task is busy all the time: it paces the worker.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="counted runs per cell")
    ap.add_argument("--tasks", type=int, default=240, help="tasks per run")
    ap.add_argument("--resources", type=int, default=4)
    ap.add_argument("--work-ms", type=float, default=3.0, help="work inside the lock")
    ap.add_argument("--workers", default="2,4", help="worker counts (comma-separated)")
    ap.add_argument("--concurrency", default="1,2,4", help="pool sizes (comma-separated)")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved cost rounds")
    ap.add_argument("--batch", type=int, default=400, help="no-op tasks per cost batch")
    ap.add_argument("--pools", default=",".join(POOLS), help="pools of the cost measurement")
    ap.add_argument(
        "--lock-stores",
        default="broker,own",
        help="where the cost measurement's locks live: 'broker' (the broker's "
        "redis-server), 'own' (a redis-server of their own), or both",
    )
    ap.add_argument(
        "--cpu-rounds",
        type=int,
        default=CPU_ROUNDS,
        help="rounds of the CPU split by process (prefork only; 0: none)",
    )
    ap.add_argument(
        "--cpu-batch",
        type=int,
        default=CPU_BATCH,
        help="no-op tasks per round of the CPU split (runs of each kind in turn)",
    )
    ap.add_argument("--skip-contention", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile the no-op tasks in a solo worker (cProfile, per-phase table)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    load_before = load_average()
    began = time.monotonic()
    cells: list[CellResult] = []
    costs: list[CostResult] = []
    stores = [x for x in args.lock_stores.split(",") if x]
    if not set(stores) <= {"broker", "own"}:
        ap.error(f"--lock-stores: 'broker', 'own' or both, not {args.lock_stores!r}")
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        server = stack.enter_context(RedisServer(workdir=Path(tmp) / "r"))
        # The second redis-server only when a cost run puts the locks on it.
        lock_server = (
            stack.enter_context(RedisServer(workdir=Path(tmp) / "locks"))
            if "own" in stores and not args.skip_cost
            else None
        )
        if not args.skip_contention:
            for workers in (int(x) for x in args.workers.split(",")):
                for conc in (int(x) for x in args.concurrency.split(",")):
                    progress(f"contention: {workers} workers x -c {conc}")
                    cells.append(
                        run_cell(
                            server.url,
                            Path(tmp) / f"cell-{workers}x{conc}",
                            workers,
                            conc,
                            runs=args.runs,
                            tasks=args.tasks,
                            resources=args.resources,
                            work=args.work_ms / 1000,
                            progress=progress,
                        )
                    )
        if not args.skip_cost:
            for store in stores:
                for pool in args.pools.split(","):
                    progress(f"cost of @locked: {pool}, locks {_store_label(store)}")
                    costs.append(
                        run_cost(
                            server.url,
                            Path(tmp) / f"cost-{pool}-{store}",
                            pool,
                            rounds=args.rounds,
                            batch=args.batch,
                            progress=progress,
                            lock_url=lock_server.url
                            if lock_server is not None and store == "own"
                            else None,
                            cpu_rounds=args.cpu_rounds,
                            cpu_batch=args.cpu_batch,
                        )
                    )
        profile = None
        if args.profile and not args.skip_cost:
            progress("profile of @locked: solo")
            profile = run_profile(server.url, Path(tmp) / "profile", batch=args.batch)
    elapsed = time.monotonic() - began
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# Celery end to end benchmark\n",
        f"{stamp}; {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}; "
        f"load average (1/5/15 min) {load_before} before, {load_average()} after; "
        f"{elapsed:.0f} s in all.\n",
        f"Command: `{' '.join(['python -m benchmarks.celery_e2e', *(argv or sys.argv[1:])])}`\n",
    ]
    if cells:
        parts.append(
            f"## Contention: {args.tasks} tasks per run over {args.resources} resources, "
            f"{args.work_ms:g} ms of work each, prefork workers (prefetch 1, acks_late)\n"
        )
        parts.append(contention_markdown(cells))
    if costs:
        parts.append(
            f"## The cost of @locked: no-op tasks, {args.batch} per batch, "
            f"{args.rounds} interleaved rounds, one worker\n"
        )
        parts.append(cost_markdown(costs))
    if profile is not None:
        parts.append(f"## Where the time goes: {profile.tasks} no-op tasks, cProfile\n")
        parts.append(profile_markdown(profile))
        parts.append("Heaviest functions of the @locked run, by own time:\n")
        parts.append("```\n" + profile.top.strip() + "\n```\n")
    text = "\n".join(parts)
    print(text)
    args.out.write_text(text)
    print(f"written to {args.out}", file=sys.stderr)
    return 1 if any(r.exact is False for c in cells for r in c.runs) else 0


if __name__ == "__main__":
    sys.exit(main())
