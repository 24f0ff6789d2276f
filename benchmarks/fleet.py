"""Fleet scale, simulated on one machine against one real redis-server.

Usage::

    .venv/bin/python -m benchmarks.fleet [--quick] [--window 20] [--out FILE]

No Celery runs: the library's own code paths drive one redis-server the way
a fleet of prefork workers would, each scenario at two sizes so that the
ratio shows whether its cost grows linearly in what it touches.

1. **Heartbeats** (``--nodes``, default 500 and 1,000 worker nodes with 8
   pool children each, at the default interval of 10 s and owner TTL of
   30 s). Per node: a real :class:`~celery_redislock.worker.node.Node` whose
   :meth:`~celery_redislock.worker.node.Node.tick` runs ``node_heartbeat.lua``
   (refreshing its 8 children's liveness keys) once per interval, and a real
   deferred-task :class:`~celery_redislock.worker.defer.Dispatcher` whose
   ``upkeep()`` runs ``defer_tick.lua`` once per interval; both driven from
   a few threads on each node's schedule, the nodes of a thread sharing one
   connection. The children's owners are registered by real acquires (a
   lock taken and released: idle children). The blocking waits of an idle
   worker come from a second process on one connection each, with the
   commands the library sends: the dispatcher's ``BLMOVE {ns}:dispatch
   {ns}:dispatching:<inc>`` (4 s, 4 s, then until the next upkeep) and, for
   the first ``--watching`` children of each node (default 0: an idle
   child's lost-owner watcher sends nothing), the watcher of a child that
   holds a lock, ``BLPOP {ns}:lost:<owner> 4`` (re-blocking every
   ``min(4 s, interval / 2)``, 4 s being below redis-py's 5 s socket
   timeout).
   Measured over a fixed window from ``INFO commandstats`` and ``INFO cpu``.
2. **Reconcile** (``--owners``, default 5,000 and 10,000 owners, 1 % dead,
   each holding one lock): one :meth:`LockManager.reconcile` pass.
3. **Start-up of N workers at once** (``--workers``, default 75 and 150):
   each has a same-name predecessor that died a minute ago with 8 children
   holding 2 locks each; every worker does, on its own connections and all
   released together: the bootstep's eviction check (INFO), the node claim
   (:meth:`Node.start`: format check, ``node_start.lua``, the predecessor's
   eviction and the cleanup of its owners), the first node heartbeat and
   the dispatcher's first upkeep.
4. **One worker's cleanup when it held L locks** (``--locks``, default
   1,000 and 2,000, so that every child holds more than REGISTRY_SPILL_AT
   at both sizes: its registry's buckets are then part of both): 8 pool children (real forked processes) take L locks in all
   and exit without releasing them; (a) the node's next tick frees them
   (children died), (b) a successor of the same name evicts the worker at
   its start-up (worker died).

Then the keyspace check: reconcile and cleanup at a small size again with
100,000 unrelated keys in the database, whose command counts must not
change; and every scenario's SCAN and KEYS calls (must be zero).

Each row gives the commands Redis executed (``INFO commandstats``, those run
inside scripts included), the round trips (top-level commands), the server
time of the top-level commands from commandstats (a script's time includes
its inner commands, counted once) and the server process's CPU time
(``used_cpu_sys + used_cpu_user``: network I/O included). Set-up shortcuts,
never measured: a dead owner's liveness key is deleted (as if it expired),
and a dead predecessor's last beat is set a minute back (as if it had died
then); owners that stand for processes not run use a 600 s TTL so that a
slow set-up does not expire them.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import logging
import multiprocessing as mp
import os
import platform
import random
import resource
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from benchmarks.machine import load_average
from celery_redislock import LockManager
from celery_redislock.store.scripts import SCRIPT_NAMES, source
from celery_redislock.worker.defer import Dispatcher
from celery_redislock.worker.node import Node, new_incarnation

ROOT = Path(__file__).resolve().parents[1]

#: Library defaults (``redislock_heartbeat_interval``, ``redislock_owner_ttl``).
INTERVAL = 10.0
OWNER_TTL = 30.0
#: The lost-owner watcher's block: min(block_cap, interval / 2), where the
#: cap is 4 s under redis-py's default 5 s socket timeout.
WATCH_BLOCK = 4.0
#: TTL of owners standing for processes the benchmark does not run.
SETUP_TTL = 600.0
CHILDREN = 8
#: Commands that walk the keyspace: must stay at zero.
KEYSPACE_WALKS = ("scan", "keys")
#: INFO calls a measurement makes itself between its two snapshots.
OWN_INFO = 2
#: Commands only ever sent by a client here (never run from a script);
#: HELLO and CLIENT SETINFO come with a new connection (a worker's start-up).
TOP_LEVEL_ONLY = frozenset(
    {
        "evalsha",
        "eval",
        "blpop",
        "blmove",
        "sscan",
        "script|load",
        "info",
        "hello",
        "client|setinfo",
        "ping",
    }
)
UNRELATED_KEYS = 100_000
#: Threads of the paced start-up run: the benchmark's own client threads
#: (one per worker in the run "at once") compete with redis-server for the
#: same cores and inflate its measured time; a few threads disturb it less.
PACED = 8


# -- measurement ----------------------------------------------------------


@dataclass
class Snapshot:
    """Command counts, their server time, and the server's CPU time."""

    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float
    at: float


def snapshot(admin: redis.Redis) -> Snapshot:
    """``INFO commandstats`` and ``INFO cpu`` now."""
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for key, value in admin.info("commandstats").items():
        name = str(key).removeprefix("cmdstat_")
        calls[name] = int(value["calls"])
        usec[name] = int(value["usec"])
    cpu = admin.info("cpu")
    return Snapshot(
        calls,
        usec,
        float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        time.monotonic(),
    )


@dataclass
class Cost:
    """What Redis did between two snapshots.

    ``direct`` names how many calls of commands that scripts run too (EXISTS,
    DEL, HDEL) the client sent itself: their share of the time is counted as
    top-level.
    """

    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float
    wall_s: float
    direct: dict[str, int] = field(default_factory=dict)

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot, direct: dict[str, int] | None = None) -> Cost:
        calls = {k: v - a.calls.get(k, 0) for k, v in b.calls.items()}
        usec = {k: b.usec[k] - a.usec.get(k, 0) for k in calls}
        info = calls.get("info", 0)
        if info:  # the measurement's own INFO calls are left out
            usec["info"] = usec["info"] * max(0, info - OWN_INFO) // info
            calls["info"] = max(0, info - OWN_INFO)
        calls = {k: v for k, v in calls.items() if v > 0}
        usec = {k: usec[k] for k in calls}
        return cls(dict(sorted(calls.items())), usec, b.cpu_s - a.cpu_s, b.at - a.at, direct or {})

    @property
    def commands(self) -> int:
        """Every command Redis executed (inside scripts included)."""
        return sum(self.calls.values())

    @property
    def round_trips(self) -> int:
        """Top-level commands: scripts, blocking waits and direct commands."""
        top = sum(v for k, v in self.calls.items() if k in TOP_LEVEL_ONLY)
        return top + sum(min(n, self.calls.get(k, 0)) for k, n in self.direct.items())

    @property
    def top_usec(self) -> float:
        """Server time of the top-level commands (a script's includes its calls)."""
        total = float(sum(v for k, v in self.usec.items() if k in TOP_LEVEL_ONLY))
        for k, n in self.direct.items():
            calls = self.calls.get(k, 0)
            if calls:
                total += self.usec.get(k, 0) * min(n, calls) / calls
        return total

    @property
    def walks(self) -> int:
        """SCAN + KEYS calls (must be 0)."""
        return sum(self.calls.get(c, 0) for c in KEYSPACE_WALKS)


@dataclass
class Row:
    """One scenario at one size."""

    scenario: str
    size: int
    unit: str
    cost: Cost
    #: Scenario-specific counts (what was found, freed, ticked).
    counts: dict[str, Any] = field(default_factory=dict)
    #: Per-second rates (heartbeats) instead of totals.
    per_second: bool = False


def _admin(url: str, *, scripts: bool = False) -> redis.Redis:
    """A client; ``scripts``: first load every script of the library, so that
    no measured window counts a NOSCRIPT reply and the load that follows."""
    client = redis.Redis.from_url(url, socket_timeout=None, decode_responses=True)
    if scripts:
        for name in SCRIPT_NAMES:
            client.script_load(source(name))
    return client


def _manager(client: redis.Redis, ns: str, **kwargs: Any) -> LockManager:
    """A manager that stands for one process's owner, run from this process.

    No heartbeat and no lost-owner watcher thread of its own (thousands of
    them share this process): another part of the benchmark (a node tick)
    refreshes its liveness, or nobody does.
    """
    kwargs.setdefault("heartbeat", False)
    kwargs.setdefault("eviction_check", "ignore")
    # Thousands of simulated processes share this process's one client:
    # each would otherwise keep a connection of its own for its commands
    # (a real process has one manager, and one such connection per thread).
    kwargs.setdefault("hold_connection", False)
    mgr = LockManager(client, ns, **kwargs)
    mgr.watcher.exempt_pid = os.getpid()
    # Set-up speed: the namespace's data format is checked once per run
    # (``check_format`` below), not once per simulated process.
    mgr.channel.format_pending = False
    return mgr


def _children(
    client: redis.Redis, ns: str, group: str, count: int, locks: int, tag: str, ttl: float
) -> list[Any]:
    """``count`` pool-child owners of ``group``, holding ``locks`` locks each."""
    held: list[Any] = []
    for c in range(count):
        mgr = _manager(client, ns, group=lambda g=group: g, owner_ttl=ttl)
        for i in range(max(1, locks)):
            held.append(mgr.acquire(f"{tag}-c{c}-{i}", timeout=0))
        if locks == 0:
            held[-1].release()  # registered, holding nothing
        held.append(mgr)
    return held


# -- 1. heartbeats ----------------------------------------------------------


class _TickDriver(threading.Thread):
    """Runs real node ticks and dispatcher upkeeps on their schedule."""

    def __init__(self, url: str, ns: str, interval: float) -> None:
        super().__init__(daemon=True, name="fleet-ticks")
        self.ops = _manager(_admin(url), ns, heartbeat_interval=interval)
        self.interval = interval
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()
        #: Failed calls, and ticks that found a dead or lost owner (none
        #: should: every simulated child is alive).
        self.errors = 0
        #: Latest start of a due job, seconds (the driver keeping up).
        self.max_lag = 0.0

    def add(self, node: Node, dispatcher: Dispatcher, first: float) -> None:
        # The nodes of one driver thread share its connection (a real worker
        # has its own; Redis's cost per command is the same).
        dispatcher.manager = self.ops
        with self._lock:
            n = len(self._due)  # sequence numbers break ties: no callable compared
            heapq.heappush(self._due, (first, 2 * n, lambda: self._tick(node)))
            heapq.heappush(self._due, (first + 0.001, 2 * n + 1, dispatcher.upkeep))

    def _tick(self, node: Node) -> None:
        node.clients.by_thread[threading.get_ident()] = self.ops
        result = node.tick()
        if result.dead or result.lost or result.state != "owner":
            self.errors += 1

    def run(self) -> None:
        while not self._halt.is_set():
            with self._lock:
                job = self._due[0] if self._due else None
            if job is None:
                self._halt.wait(0.05)
                continue
            at, seq, fn = job
            now = time.monotonic()
            if at > now:
                self._halt.wait(min(0.05, at - now))
                continue
            self.max_lag = max(self.max_lag, now - at)
            with self._lock:
                heapq.heapreplace(self._due, (at + self.interval, seq, fn))
            try:
                fn()
            except Exception:
                self.errors += 1

    def stop(self) -> None:
        self._halt.set()


def _waits_main(host: str, port: int, waits: list[tuple[bytes, list[float]]], ready: Any) -> None:
    """Process body: one connection per blocking wait, re-sent on each reply.

    ``waits``: (command without its timeout, timeouts to cycle through). The
    first sends are spread over one block period. Runs until killed.
    """
    _raise_nofile()
    sel = selectors.DefaultSelector()
    state: list[list[Any]] = []
    for cmd, cycle in waits:
        s = socket.create_connection((host, port))
        s.setblocking(False)
        state.append([s, cmd, cycle, 0])
    order = list(range(len(state)))
    random.shuffle(order)
    start = time.monotonic()
    spread = max(cycle[0] for _, cycle in waits) if waits else 0.0
    pending = [(start + spread * k / max(1, len(order)), i) for k, i in enumerate(order)]
    nxt = 0
    ready.set()

    def send(i: int) -> None:
        s, cmd, cycle, n = state[i]
        t = f"{cycle[n % len(cycle)]:g}".encode()
        state[i][3] = n + 1
        s.sendall(cmd + b"$%d\r\n%s\r\n" % (len(t), t))

    while True:
        now = time.monotonic()
        while nxt < len(pending) and pending[nxt][0] <= now:
            i = pending[nxt][1]
            nxt += 1
            sel.register(state[i][0], selectors.EVENT_READ, i)
            send(i)
        timeout = max(0.0, pending[nxt][0] - now) if nxt < len(pending) else 1.0
        for key, _ in sel.select(timeout):
            i = key.data
            data = state[i][0].recv(65536)
            if not data:
                raise SystemExit(1)
            if data.endswith(b"\r\n"):
                send(i)


def _resp(*parts: str) -> bytes:
    """A RESP command with one more argument (the timeout) to append."""
    out = [b"*%d\r\n" % (len(parts) + 1)]
    for p in parts:
        b = p.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _dispatch_cycle(interval: float) -> list[float]:
    """The dispatcher's BLMOVE timeouts between two upkeeps (4 s at most each)."""
    out, left = [], interval
    while left > 1e-9:
        out.append(max(0.05, min(WATCH_BLOCK, left)))
        left -= out[-1]
    return out


def _raise_nofile() -> None:
    """Raise this process's open-file limit to its hard limit (one socket per wait)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def heartbeats(
    url: str,
    sizes: Iterable[int],
    *,
    window: float,
    interval: float = INTERVAL,
    children: int = CHILDREN,
    threads: int = 4,
    waits: bool = True,
    watching: int = 0,
) -> list[Row]:
    """Idle fleet cost per second: node ticks, upkeeps and blocking waits.

    ``watching``: children per node whose lost-owner watcher blocks (a
    child that holds a lock); an idle child's watcher sends nothing.
    """
    sizes = sorted(sizes)
    watch = min(WATCH_BLOCK, interval / 2)
    dispatch_cycle = _dispatch_cycle(interval)
    admin = _admin(url, scripts=True)
    host = admin.connection_pool.connection_kwargs["host"]
    port = int(admin.connection_pool.connection_kwargs["port"])
    ns = "fleet"
    reg = _admin(url)
    drivers = [_TickDriver(url, ns, interval) for _ in range(threads)]
    for d in drivers:
        d.start()
    procs: list[Any] = []
    held: list[Any] = []
    rows: list[Row] = []
    made = 0
    ctx = mp.get_context("spawn")
    try:
        for size in sizes:
            batch: list[tuple[bytes, list[float]]] = []
            t0 = time.monotonic()
            for i in range(made, size):
                mgr = _manager(reg, ns, heartbeat_interval=interval, owner_ttl=interval * 3)
                inc = new_incarnation()
                node = Node(mgr, f"w{i}@fleet", inc)
                node.clients.by_thread[threading.get_ident()] = drivers[0].ops
                node.start()
                del node.clients.by_thread[threading.get_ident()]
                kids = _children(reg, ns, node.group_key, children, 0, f"n{i}", interval * 3)
                held.extend(kids)
                disp = Dispatcher(mgr, inc, publish=lambda *a: None, on_withdrawn=lambda *a: None)
                first = time.monotonic() + random.uniform(0.0, interval)
                drivers[i % threads].add(node, disp, first)
                owners = [m for m in kids if isinstance(m, LockManager)]
                for m in owners[:watching]:
                    batch.append((_resp("BLPOP", m.keys.lost(m.owner_id)), [watch]))
                batch.append(
                    (
                        _resp(
                            "BLMOVE", f"{{{ns}}}:dispatch", disp.dispatching_key, "RIGHT", "LEFT"
                        ),
                        dispatch_cycle,
                    )
                )
            made = size
            setup_s = time.monotonic() - t0
            if waits and batch:
                ready = ctx.Event()
                p = ctx.Process(target=_waits_main, args=(host, port, batch, ready), daemon=True)
                p.start()
                procs.append(p)
                if not ready.wait(120):
                    raise RuntimeError("the blocking-wait driver did not start")
            # Every node's first tick and every wait's first block are due
            # within one interval: let the schedule fill before measuring.
            time.sleep(interval + 0.5)
            errors0 = sum(d.errors for d in drivers)
            for d in drivers:
                d.max_lag = 0.0
            a = snapshot(admin)
            time.sleep(window)
            b = snapshot(admin)
            cost = Cost.between(a, b)
            lag = max(d.max_lag for d in drivers)
            rows.append(
                Row(
                    "heartbeats",
                    size,
                    "nodes",
                    cost,
                    {
                        "owners": size * children,
                        "setup_s": round(setup_s, 1),
                        "tick_errors": sum(d.errors for d in drivers) - errors0,
                        "max_tick_lag_s": round(lag, 3),
                        "connections": int(admin.info("clients")["connected_clients"]),
                        "clients_mem_mb": round(
                            int(admin.info("memory")["mem_clients_normal"]) / 2**20, 1
                        ),
                        **{
                            f"{k}/s": round(cost.calls.get(k, 0) / cost.wall_s, 1)
                            for k in ("evalsha", "blpop", "blmove")
                        },
                    },
                    per_second=True,
                )
            )
    finally:
        for d in drivers:
            d.stop()
        for p in procs:
            p.kill()
            p.join(10)
        for d in drivers:
            d.join(5)
            d.ops.client.close()
        admin.flushall()
        reg.close()
        admin.close()
    return rows


# -- 2. reconcile -----------------------------------------------------------


def reconcile(
    url: str, sizes: Iterable[int], *, dead_share: float = 0.01, unrelated: int = 0
) -> list[Row]:
    """One reconcile pass over ``size`` owners, ``dead_share`` of them dead.

    The sizes share one namespace: after a pass, new owners (dead ones
    among them) fill the owners set up to the next size.
    """
    rows = []
    admin = _admin(url, scripts=True)
    admin.flushall()
    if unrelated:
        populate(admin, unrelated)
    ns = "rec"
    client = _admin(url)
    beat = _manager(_admin(url), ns)
    beat.check_format()  # also warms its connection
    held: list[Any] = []
    made = 0
    for size in sorted(sizes):
        dead = max(1, round(size * dead_share))
        new = size - int(admin.scard(beat.keys.owners))
        if new < dead:
            raise ValueError(f"sizes too close together: {sorted(sizes)}")
        owners = []
        for _ in range(new):
            mgr = _manager(client, ns, owner_ttl=SETUP_TTL)
            held.append(mgr.acquire(f"r{made}", timeout=0))
            made += 1
            owners.append(mgr)
        for mgr in random.sample(owners, dead):
            admin.delete(mgr.keys.alive(mgr.owner_id))  # its liveness expired
        a = snapshot(admin)
        report = beat.reconcile()
        b = snapshot(admin)
        cost = Cost.between(a, b, {"exists": report.owners_seen})
        rows.append(
            Row(
                "reconcile",
                size,
                "owners",
                cost,
                {
                    "dead": dead,
                    "owners_seen": report.owners_seen,
                    "cleaned": report.cleaned,
                    "released": report.released,
                    "left": int(admin.scard(beat.keys.owners)),
                    "errors": len(report.errors),
                    "unrelated_keys": unrelated,
                },
            )
        )
    del held
    beat.client.close()
    client.close()
    admin.flushall()
    admin.close()
    return rows


# -- 3. start-up of many workers at once -------------------------------------


def _dead_predecessor(
    client: redis.Redis, ns: str, name: str, children: int, locks: int
) -> list[Any]:
    """A worker ``name`` whose children hold locks, dead for a minute."""
    mgr = _manager(client, ns)
    node = Node(mgr, name, new_incarnation())
    node.start()
    kids = _children(client, ns, node.group_key, children, locks, name, SETUP_TTL)
    ms = int(time.time() * 1000) - 60_000
    client.hset(node.node_key, "hb_ms", str(ms))  # its last beat: a minute ago
    for ops in node.clients.by_thread.values():
        ops.client.close()
    return kids


def _worker_start(url: str, ns: str, names: list[str], go: threading.Barrier) -> list[Any]:
    """The bootstep's start-up Redis work of workers ``names``, one after the
    other from this thread, each on its own connections, once ``go`` opens."""
    made = []
    for name in names:
        mgr = LockManager(
            redis.Redis.from_url(url), ns, heartbeat=False, group=None, eviction_check="ignore"
        )
        inc = new_incarnation()
        node = Node(mgr, name, inc)
        disp = Dispatcher(mgr, inc, publish=lambda *a: None, on_withdrawn=lambda *a: None)
        made.append((mgr, node, disp))
    go.wait()  # ready (the main thread snapshots the counters)
    go.wait()  # go
    out = []
    for mgr, node, disp in made:
        mgr.check_eviction()  # the bootstep's eviction check (INFO)
        state = node.start()
        tick = node.tick()  # the heartbeat thread's first beat
        disp.upkeep()  # the dispatcher's first pass
        out.append({"state": state, "after_tick": tick.state, "done": time.monotonic()})
    for mgr, node, disp in made:
        disp.manager.client.close()
        for ops in node.clients.by_thread.values():
            ops.client.close()
        mgr.client.close()
    return out


def startups(
    url: str,
    sizes: Iterable[int],
    *,
    children: int = CHILDREN,
    locks: int = 2,
    trials: int = 1,
    concurrency: int | None = None,
) -> list[Row]:
    """``size`` workers starting at once, each evicting a dead predecessor.

    One thread per worker, all released together; ``concurrency`` caps the
    threads (each then starts its share of the workers one after the
    other). ``trials`` rounds of every size, interleaved; the round with the
    least server time of each size is kept (the machine is shared).
    """
    rows = []
    for size in [n for _ in range(trials) for n in sorted(sizes)]:
        admin = _admin(url, scripts=True)
        admin.flushall()
        ns = f"start{size}"
        client = _admin(url)
        held = []
        for i in range(size):
            held.extend(_dead_predecessor(client, ns, f"w{i}@fleet", children, locks))
        grants = size * children * locks
        threads = min(size, concurrency or size)
        go = threading.Barrier(threads + 1)
        names = [f"w{i}@fleet" for i in range(size)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            futs = [
                pool.submit(_worker_start, url, ns, names[t::threads], go) for t in range(threads)
            ]
            go.wait()  # every thread ready
            a = snapshot(admin)
            go.wait()  # go
            results = [r for f in futs for r in f.result()]
        b = snapshot(admin)
        wall = max(r["done"] for r in results) - a.at
        # Direct commands: each worker DELs its predecessor's group once.
        cost = Cost.between(a, b, {"del": size})
        cost.wall_s = wall
        left = _count_grants(admin, ns)  # a check, after the window
        rows.append(
            Row(
                "startup" if threads == size else f"startup ({threads} threads)",
                size,
                "workers",
                cost,
                {
                    "owners": sum(1 for r in results if r["after_tick"] == "owner"),
                    "predecessor_grants": grants,
                    "locks_left": left,
                },
            )
        )
        del held
        client.close()
        admin.flushall()
        admin.close()
    return best_of(rows)


def best_of(rows: list[Row]) -> list[Row]:
    """Per scenario and size, the row with the least server time (in order).

    Its counts are checked against the other rounds' by the callers' tests:
    only the timings differ between rounds.
    """
    best: dict[tuple[str, int], Row] = {}
    for r in rows:
        key = (r.scenario, r.size)
        if key not in best or r.cost.top_usec < best[key].cost.top_usec:
            best[key] = r
    return list(best.values())


# -- 4. one worker's cleanup ---------------------------------------------------


def _child_body(url: str, ns: str, group: str, names: list[str], done: Any) -> None:
    """A forked pool child: takes its locks one by one and dies holding them."""
    mgr = LockManager(url, ns, heartbeat=False, group=lambda: group, eviction_check="ignore")
    for res in names:
        mgr.acquire(res, timeout=0)
    done.put(len(names))
    done.close()
    done.join_thread()  # flushed before the process dies without cleaning up
    os._exit(0)


def _worker_with_dead_children(url: str, ns: str, name: str, locks: int, children: int) -> Node:
    """A live worker node (its connection warm) whose ``children`` took
    ``locks`` locks in all and exited without releasing them."""
    mgr = _manager(_admin(url), ns)
    node = Node(mgr, name, new_incarnation(), live_pids=list)
    node.start()
    node.tick()  # warm: the ops connection and its format check
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    per = [locks // children + (1 if c < locks % children else 0) for c in range(children)]
    procs, k = [], 0
    for c in range(children):
        names = [f"{name}-r{k + j}" for j in range(per[c])]
        k += per[c]
        p = ctx.Process(target=_child_body, args=(url, ns, node.group_key, names, q))
        p.start()
        procs.append(p)
    got = sum(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    if got != locks:
        raise RuntimeError(f"children took {got} locks, not {locks}")
    return node


def _close_node(node: Node) -> None:
    for ops in node.clients.by_thread.values():
        ops.client.close()
    node.manager.client.close()


def cleanup(
    url: str,
    sizes: Iterable[int],
    *,
    children: int = CHILDREN,
    unrelated: int = 0,
    trials: int = 1,
) -> list[Row]:
    """A worker's pool children held ``size`` locks and died; freed by (a) the
    node's next tick (children died), (b) a same-name successor's start-up,
    which evicts the worker (worker died too). ``trials``: as for
    :func:`startups`."""
    rows = []
    for size in [n for _ in range(trials) for n in sorted(sizes)]:
        for how in ("children died", "worker died"):
            admin = _admin(url, scripts=True)
            admin.flushall()
            if unrelated:
                populate(admin, unrelated)
            ns = f"clean{size}"
            name = "w@clean"
            node = _worker_with_dead_children(url, ns, name, size, children)
            before = _count_grants(admin, ns)
            if how == "children died":
                a = snapshot(admin)
                tick = node.tick()
                b = snapshot(admin)
                owners = len(tick.dead)
                ok = node.state == "owner" and sum(r.released for r in tick.cleaned) == size
                # Direct: one HDEL of each dead owner's group entry.
                cost = Cost.between(a, b, {"hdel": owners})
            else:
                ms = int(time.time() * 1000) - 60_000
                admin.hset(node.node_key, "hb_ms", str(ms))  # it died a minute ago
                succ = Node(_manager(_admin(url), ns), name, new_incarnation())
                succ.clients.ops().check_format()  # warm: connection and format check
                a = snapshot(admin)
                succ.start()
                b = snapshot(admin)
                owners = children
                ok = succ.state == "owner"
                # Direct: the DEL of the predecessor's group.
                cost = Cost.between(a, b, {"del": 1})
                _close_node(succ)
            freed = before - _count_grants(admin, ns)
            rows.append(
                Row(
                    f"cleanup ({how})",
                    size,
                    "locks",
                    cost,
                    {
                        "owners": owners,
                        "held": before,
                        "freed": freed,
                        "ok": ok and freed == size,
                        "unrelated_keys": unrelated,
                    },
                )
            )
            _close_node(node)
            admin.flushall()
            admin.close()
    return best_of(rows)


def _count_grants(admin: redis.Redis, ns: str) -> int:
    """Lock hashes in ``ns``: a check made outside every measured window."""
    return sum(1 for _ in admin.scan_iter(match=f"{{{ns}}}:lock:*", count=1000))


def populate(admin: redis.Redis, count: int) -> None:
    """``count`` unrelated keys (pipelined SETs)."""
    pipe = admin.pipeline(transaction=False)
    for i in range(count):
        pipe.set(f"unrelated:{i}", "x" * 16)
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


# -- report -------------------------------------------------------------------


@dataclass
class Sizes:
    """The two sizes of each scenario, and the heartbeat window."""

    nodes: tuple[int, int] = (500, 1000)
    owners: tuple[int, int] = (5000, 10000)
    workers: tuple[int, int] = (75, 150)
    locks: tuple[int, int] = (1000, 2000)
    #: Children per node holding a lock (their lost-owner watcher blocks).
    watching: int = 0
    window: float = 20.0
    interval: float = INTERVAL
    unrelated: int = UNRELATED_KEYS
    #: Sizes of the keyspace check (reconcile owners, cleanup locks).
    keyspace_owners: int = 1000
    keyspace_locks: int = 200
    #: Interleaved rounds of the start-up and cleanup scenarios (least
    #: server time kept).
    trials: int = 2


#: Small enough for the smoke test (seconds): a 1 s heartbeat interval.
QUICK = Sizes(
    nodes=(4, 8),
    owners=(100, 200),
    workers=(3, 6),
    locks=(16, 32),
    window=2.0,
    interval=1.0,
    unrelated=2000,
    keyspace_owners=100,
    keyspace_locks=16,
)


@dataclass
class FleetRun:
    """Every row of one run, and the keyspace check."""

    sizes: Sizes
    heartbeats: list[Row]
    reconcile: list[Row]
    startup: list[Row]
    cleanup: list[Row]
    keyspace: list[tuple[Row, Row]]
    #: The start-ups again from :data:`PACED` threads (server time).
    startup_paced: list[Row] = field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        rows = [*self.heartbeats, *self.reconcile, *self.startup, *self.startup_paced]
        return [*rows, *self.cleanup] + [r for pair in self.keyspace for r in pair]

    @property
    def walks(self) -> int:
        """SCAN + KEYS calls in every measured window (must be 0)."""
        return sum(r.cost.walks for r in self.rows)


def run_all(url: str, sizes: Sizes, progress: Callable[[str], None] = lambda _: None) -> FleetRun:
    """Every scenario at its two sizes, then the keyspace check."""
    hb = heartbeats(
        url, sizes.nodes, window=sizes.window, interval=sizes.interval, watching=sizes.watching
    )
    progress(f"heartbeats: {[_brief(r) for r in hb]}")
    rec = reconcile(url, sizes.owners)
    progress(f"reconcile: {[_brief(r) for r in rec]}")
    st = startups(url, sizes.workers, trials=sizes.trials)
    progress(f"startup: {[_brief(r) for r in st]}")
    paced = startups(url, sizes.workers, trials=sizes.trials, concurrency=PACED)
    progress(f"startup paced: {[_brief(r) for r in paced]}")
    cl = cleanup(url, sizes.locks, trials=sizes.trials)
    progress(f"cleanup: {[_brief(r) for r in cl]}")
    pairs: list[tuple[Row, Row]] = []
    for fn, n in ((reconcile, sizes.keyspace_owners), (cleanup, sizes.keyspace_locks)):
        plain = fn(url, [n])
        crowded = fn(url, [n], unrelated=sizes.unrelated)
        pairs.extend(zip(plain, crowded))
    progress(f"keyspace: {[(_brief(a), _brief(b)) for a, b in pairs]}")
    return FleetRun(sizes, hb, rec, st, cl, pairs, paced)


def _brief(r: Row) -> str:
    c = r.cost
    each = ", ".join(
        f"{k} {c.usec[k] / c.calls[k]:.1f}" for k in ("evalsha", "blpop", "blmove") if k in c.calls
    )
    return (
        f"{r.scenario}@{r.size}: {c.commands} cmds {c.top_usec:.0f} usec "
        f"{c.cpu_s * 1000:.0f} ms cpu {c.wall_s:.2f} s (usec per call: {each})"
    )


def _rate(r: Row, value: float) -> float:
    return value / r.cost.wall_s if r.per_second else value


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}"


def _table(rows: list[Row]) -> list[str]:
    per_s = rows[0].per_second
    unit = " / s" if per_s else ""
    head = (
        f"| {rows[0].unit} | commands{unit} | round trips{unit} | server usec{unit} "
        f"(commandstats) | server CPU ms{unit} (INFO cpu) | wall s | SCAN+KEYS | found |"
    )
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        c = r.cost
        found = ", ".join(f"{k} {v}" for k, v in r.counts.items())
        lines.append(
            f"| {r.size:,} | {_fmt(_rate(r, c.commands))} | {_fmt(_rate(r, c.round_trips))} | "
            f"{_fmt(_rate(r, c.top_usec))} | {_fmt(_rate(r, c.cpu_s * 1000))} | "
            f"{c.wall_s:.2f} | {c.walks} | {found} |"
        )
    return lines


@dataclass
class Linearity:
    """The ratios of one scenario's two sizes."""

    size: float
    commands: float
    round_trips: float
    usec: float
    cpu: float

    @property
    def met(self) -> bool:
        """No faster than linear growth: counts at most 1.1 x, server time at
        most 1.5 x the size ratio.

        A fixed part (the 8 owners of a cleanup, a connection) makes a ratio
        smaller than the size ratio; a cost that grows with something else
        than the size (the keyspace, the square of the size) makes it larger.
        Command counts are deterministic; server times are measured on a
        shared machine, hence the looser bound.
        """
        counts = all(x <= 1.1 * self.size for x in (self.commands, self.round_trips))
        return counts and self.usec <= 1.5 * self.size

    def text(self) -> str:
        return (
            f"size x{self.size:.2f}: commands x{self.commands:.2f}, round trips "
            f"x{self.round_trips:.2f}, server usec x{self.usec:.2f}, server CPU x{self.cpu:.2f}"
        )


def linearity(rows: list[Row]) -> Linearity:
    """Ratios of the larger size's costs to the smaller's."""
    a, b = rows[0], rows[-1]

    def ratio(f: Callable[[Row], float]) -> float:
        x, y = _rate(a, f(a)), _rate(b, f(b))
        return y / x if x else float("inf")

    return Linearity(
        b.size / a.size,
        ratio(lambda r: r.cost.commands),
        ratio(lambda r: r.cost.round_trips),
        ratio(lambda r: r.cost.top_usec),
        ratio(lambda r: r.cost.cpu_s),
    )


def nodes_per_core(run: FleetRun) -> tuple[float, float, float]:
    """(CPU share of a core, nodes per core from CPU, from commandstats) at the
    largest heartbeat size, extrapolated linearly."""
    r = run.heartbeats[-1]
    share = r.cost.cpu_s / r.cost.wall_s
    usec_share = r.cost.top_usec / r.cost.wall_s / 1e6
    return share, r.size / share if share else 0.0, r.size / usec_share if usec_share else 0.0


def render(
    run: FleetRun,
    command: str,
    version: str,
    load: tuple[str, str],
    elapsed: float,
    level: int = 2,
) -> str:
    """The markdown report; its title is a heading of ``level``."""
    h1, h2 = "#" * level, "#" * (level + 1)
    s = run.sizes
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        f"{h1} Fleet scale (simulated on one machine)",
        "",
        f"- date: {now}; command: `{command}`; total {elapsed:.0f} s",
        f"- machine: {os.cpu_count()} CPUs, load average before/after {load[0]} / {load[1]} "
        "(1/5/15 min; the benchmark's own drivers and other jobs share the cores with Redis)",
        f"- redis-server {version} on 127.0.0.1, started by the benchmark; "
        f"Python {platform.python_version()}, redis-py {redis.__version__}",
        f"- heartbeat interval {s.interval:g} s, owner TTL {3 * s.interval:g} s, "
        f"{CHILDREN} pool children per node, {s.window:g} s window per size",
        f"- children per node holding a lock (their lost-owner watcher blocks): {s.watching} "
        "(an idle child's watcher sends nothing)",
        "",
    ]
    sections = [
        (
            "1. Heartbeats of an idle fleet (per second)",
            run.heartbeats,
            "what it touches: nodes (and their 8 children each)",
        ),
        ("2. One reconcile pass, 1 % of the owners dead", run.reconcile, "what it touches: owners"),
    ]
    for title, rows, what in sections:
        lin = linearity(rows)
        out += [f"{h2} {title}", "", *_table(rows), "", f"Ratio: {lin.text()}", ""]
        out.append(f"{title.split('.')[0]}. target 4.x (linear in {what}): " + _verdict(lin))
        out.append("")
    lin = linearity(run.startup)
    out += [
        f"{h2} 3. Workers starting at once, each evicting a dead predecessor "
        f"({CHILDREN} children x 2 locks)",
        "",
        "All at once (one thread per worker, released together):",
        "",
        *_table(run.startup),
        "",
        f"Ratio: {lin.text()}",
        "",
    ]
    if run.startup_paced:
        paced = linearity(run.startup_paced)
        out += [
            f"The same start-ups from {PACED} threads (the benchmark's client threads "
            "disturb the server's timing less):",
            "",
            *_table(run.startup_paced),
            "",
            f"Ratio: {paced.text()}",
            "",
        ]
        # Counts from the run at once, server time from the paced run.
        lin = Linearity(lin.size, lin.commands, lin.round_trips, paced.usec, paced.cpu)
    out.append(
        "3. target 4.x (linear in what it touches: workers, their predecessors' owners and "
        "locks; server time from the paced run when there is one): " + _verdict(lin)
    )
    out.append("")
    for how in ("children died", "worker died"):
        rows = [r for r in run.cleanup if r.scenario == f"cleanup ({how})"]
        lin = linearity(rows)
        title = (
            "4a. One worker's dead pool children held the locks (freed by its next node tick)"
            if how == "children died"
            else "4b. The worker died with them (freed by a same-name successor's start-up)"
        )
        out += [f"{h2} {title}", "", *_table(rows), "", f"Ratio: {lin.text()}", ""]
        out.append(f"{title[:2]}. target 4.x (linear in locks): " + _verdict(lin))
        out.append("")
    share, per_core, per_core_usec = nodes_per_core(run)
    at = "at the defaults" if s.interval == INTERVAL else f"at a {s.interval:g} s interval"
    big = run.heartbeats[-1]
    out += [
        f"{h2} Nodes per Redis core {at}",
        "",
        f"At {big.size:,} nodes ({big.size * CHILDREN:,} pool children) the server used "
        f"{share * 100:.1f} % of one core (INFO cpu), its commands "
        f"{big.cost.top_usec / big.cost.wall_s / 1e4:.1f} % (commandstats). Extrapolated "
        f"linearly (an assumption, not measured beyond {big.size:,} nodes): one Redis core "
        f"carries about **{per_core:,.0f} nodes** {at} by server CPU "
        f"({per_core_usec:,.0f} by command time alone), with no lock traffic.",
        "",
        f"{h2} Keyspace size and keyspace walks",
        "",
        "| scenario | size | commands, empty keyspace | commands, "
        f"{s.unrelated:,} unrelated keys | equal |",
        "|---|---:|---:|---:|---|",
    ]
    equal_all = True
    for a, b in run.keyspace:
        # SSCAN's call count follows the owners set's hashing: left out.
        ca = {k: v for k, v in a.cost.calls.items() if k != "sscan"}
        cb = {k: v for k, v in b.cost.calls.items() if k != "sscan"}
        equal = ca == cb
        equal_all = equal_all and equal
        out.append(
            f"| {a.scenario} | {a.size:,} | {a.cost.commands} | {b.cost.commands} | "
            f"{'yes' if equal else 'NO'} |"
        )
    out += [
        "",
        f"- costs independent of unrelated keyspace size (commands equal, SSCAN calls aside): "
        f"{'met' if equal_all else 'NOT met'}",
        f"- SCAN + KEYS calls in every measured window: {run.walks} -> "
        f"{'met' if run.walks == 0 else 'NOT met'}",
        "",
    ]
    return "\n".join(out)


def _verdict(lin: Linearity) -> str:
    if lin.met:
        return "met"
    return f"NOT met ({lin.text()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--nodes", help="two node counts, e.g. 500,1000")
    parser.add_argument("--owners", help="two owner counts for reconcile, e.g. 5000,10000")
    parser.add_argument("--workers", help="two worker counts starting at once, e.g. 75,150")
    parser.add_argument("--locks", help="two lock counts for one worker's cleanup, e.g. 1000,2000")
    parser.add_argument("--window", type=float, help="heartbeat measuring window, seconds")
    parser.add_argument(
        "--watching",
        type=int,
        help="children per node holding a lock, whose lost-owner watcher blocks (default 0)",
    )
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    for name in ("nodes", "owners", "workers", "locks"):
        value = getattr(args, name)
        if value:
            a, b = (int(x) for x in value.split(","))
            setattr(sizes, name, (a, b))
    if args.window:
        sizes.window = args.window
    if args.watching is not None:
        sizes.watching = args.watching
    command = ".venv/bin/python -m benchmarks.fleet" + (
        " " + " ".join(sys.argv[1:]) if argv is None and sys.argv[1:] else ""
    )
    report = run(sizes, command, lambda m: print(f"# {m}", file=sys.stderr, flush=True))
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


def run(sizes: Sizes, command: str, progress: Callable[[str], None] = lambda _: None) -> str:
    """Start a redis-server, run every scenario, return the markdown report."""
    sys.path.insert(0, str(ROOT / "tests"))
    from redis_server import RedisServer

    _raise_nofile()  # one connection per blocking wait; the server inherits it
    # The engine logs every eviction and cleanup it does (thousands here).
    logging.getLogger("celery_redislock").setLevel(logging.ERROR)
    started = time.monotonic()
    before = load_average()
    with RedisServer(extra_args=["--maxclients", "20000"]) as server:
        result = run_all(server.url, sizes, progress)
        version = server.version_string
    return render(result, command, version, (before, load_average()), time.monotonic() - started)


if __name__ == "__main__":
    raise SystemExit(main())
