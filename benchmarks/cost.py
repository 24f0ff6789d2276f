"""Cost benchmark: Redis commands per operation, small keyspace against large.

For each keyspace size (by default 100 and 50,000 unrelated keys, made with
``DEBUG POPULATE`` or, where DEBUG is disabled, pipelined SETs) this measures,
with ``CONFIG RESETSTAT`` before and ``INFO commandstats`` after, the commands
Redis executed for:

- ``acquire+release``: one exclusive lock, uncontended, taken and released;
- ``cleanup_owner``: a dead owner (its liveness expired) holding 3 locks;
- ``reconcile``: the active-owners set holds one live owner and two dead
  owners with 3 locks each.

Commands run inside Lua scripts are counted by Redis under their own names
(``hset``, ``zrange``, ...), next to the ``evalsha`` that ran them, so the
totals are the real work. Connection set-up (HELLO, CLIENT SETINFO) and the
measurement itself (CONFIG RESETSTAT, INFO) are left out; scripts are loaded
and owners registered by a warm-up pass first. The claim being checked
(DESIGN invariant 6): the counts are equal for both sizes, and SCAN and
KEYS are never called.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_redislock import LockManager

#: Commands not attributed to the operation measured.
EXCLUDED = frozenset(
    {"info", "config|resetstat", "config", "hello", "client|setinfo", "client", "ping"}
)
#: Commands that walk the keyspace: must stay at zero.
KEYSPACE_WALKS = ("scan", "keys")

#: Not an operation of the library: what a SCAN-based cleanup pays (SCAN
#: MATCH over the keyspace, redis-py's default COUNT), shown for contrast.
SCAN_CONTRAST = "contrast, not ours: SCAN MATCH {ns}:lock:* walk"

NAMESPACE = "cost"
DEAD_TTL = 0.2  # seconds: liveness of the owners that are made to die


def commandstats(client: redis.Redis) -> dict[str, int]:
    """``{command: calls}`` from INFO commandstats (subcommands as ``cmd|sub``)."""
    out: dict[str, int] = {}
    for key, value in client.info("commandstats").items():
        name = str(key).removeprefix("cmdstat_")
        out[name] = int(value["calls"])
    return out


def measure(client: redis.Redis, operation: Callable[[], object]) -> dict[str, int]:
    """Commands Redis executed while ``operation`` ran (nothing else may run)."""
    client.config_resetstat()
    operation()
    stats = commandstats(client)
    return {k: v for k, v in sorted(stats.items()) if k not in EXCLUDED and v}


def populate(client: redis.Redis, count: int) -> str:
    """Add ``count`` unrelated keys; returns the method used."""
    try:
        client.execute_command("DEBUG", "POPULATE", count, "unrelated", 16)
        method = "DEBUG POPULATE"
    except redis.ResponseError:
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            pipe.set(f"unrelated:{i}", "x" * 16)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        method = "pipelined SET"
    if client.dbsize() < count:
        raise RuntimeError(f"populating {count} keys failed ({method})")
    return method


def _dead_owner(url: str, resources: list[str]) -> str:
    """An owner holding ``resources`` whose liveness then runs out.

    Its heartbeat is stopped (as if the process had died) and this waits for
    the liveness key to expire; returns the owner id.
    """
    client = redis.Redis.from_url(url, socket_timeout=None, decode_responses=True)
    mgr = LockManager(client, namespace=NAMESPACE, owner_ttl=DEAD_TTL)
    for res in resources:
        mgr.acquire(res, timeout=0)
    owner = mgr.owner_id
    mgr.heartbeat.stop()  # it "dies" holding them (close() would release them)
    deadline = time.monotonic() + 10
    while client.exists(mgr.keys.alive(owner)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"liveness of {owner} did not expire")
        time.sleep(0.02)
    client.close()
    return owner


@dataclass
class CostRun:
    """Command counts of each operation at one keyspace size."""

    keys: int
    populate_method: str
    dbsize: int
    ops: dict[str, dict[str, int]] = field(default_factory=dict)
    freed_ok: bool = True


def measure_costs(url: str, keyspace: int) -> CostRun:
    """Measure every operation with ``keyspace`` unrelated keys (flushes first)."""
    admin = redis.Redis.from_url(url, socket_timeout=None, decode_responses=True)
    admin.flushdb()
    method = populate(admin, keyspace)
    client = redis.Redis.from_url(url, socket_timeout=None, decode_responses=True)
    mgr = LockManager(client, namespace=NAMESPACE, owner_ttl=60)

    # Warm-up: load every script, register the owner, open the connection.
    mgr.acquire("warm", timeout=0).release()
    mgr.cleanup_owner(_dead_owner(url, ["warm-dead"]))
    mgr.reconcile()

    run = CostRun(keys=keyspace, populate_method=method, dbsize=admin.dbsize())

    def acquire_release() -> None:
        mgr.acquire("res-1", timeout=0).release()

    run.ops["acquire+release"] = measure(admin, acquire_release)

    dead = _dead_owner(url, ["dead-a-0", "dead-a-1", "dead-a-2"])
    report = None

    def cleanup() -> None:
        nonlocal report
        report = mgr.cleanup_owner(dead)

    run.ops["cleanup_owner (dead, 3 locks)"] = measure(admin, cleanup)
    run.freed_ok = report is not None and report.released == 3

    for o in "bc":
        _dead_owner(url, [f"dead-{o}-{i}" for i in range(3)])
    rec = None

    def reconcile() -> None:
        nonlocal rec
        rec = mgr.reconcile()

    run.ops["reconcile (1 live + 2 dead owners, 6 locks)"] = measure(admin, reconcile)
    run.freed_ok = run.freed_ok and rec is not None and rec.released == 6
    left = [mgr.keys.lock(f"dead-{o}-{i}") for o in "abc" for i in range(3)]
    run.freed_ok = run.freed_ok and admin.exists(*left) == 0

    def scan_walk() -> None:
        for _ in admin.scan_iter(match=mgr.keys.prefix + "lock:*"):
            pass

    run.ops[SCAN_CONTRAST] = measure(admin, scan_walk)
    mgr.close()
    admin.flushdb()
    admin.close()
    return run


def walks(counts: dict[str, int]) -> int:
    """SCAN + KEYS calls in ``counts``."""
    return sum(counts.get(c, 0) for c in KEYSPACE_WALKS)


def markdown_table(runs: list[CostRun]) -> str:
    """Commands per operation for each keyspace size, and whether they match."""
    small, large = runs[0], runs[-1]
    lines = [
        f"| operation | commands @ {small.keys:,} keys | commands @ {large.keys:,} keys | "
        "equal | SCAN+KEYS | commands (large keyspace) |",
        "|---|---:|---:|---|---:|---|",
    ]
    for op, big in large.ops.items():
        little = small.ops.get(op, {})
        same = "yes" if little == big else "NO"
        detail = ", ".join(f"{k} {v}" for k, v in big.items())
        if op == SCAN_CONTRAST:
            same = "(contrast)"
        lines.append(
            f"| {op} | {sum(little.values())} | {sum(big.values())} | {same} | "
            f"{walks(little) + walks(big)} | {detail} |"
        )
    return "\n".join(lines)


# -- uncontended lock cycle: time, round trips and commands per library ------

#: Libraries timed by :func:`measure_cycles`, in table order; the first is
#: the reference of the ratios.
CYCLE_LIBS = ("redis-py Lock", "python-redis-lock", "celery-redislock")
#: Resources of the one-resource and the five-resource cycle.
CYCLE_SHAPES = {1: ["r0"], 5: [f"r{i}" for i in range(5)]}
#: Target 1: celery-redislock's cycle against redis-py Lock's one-lock cycle
#: (p50 and p99), one resource and five resources in one call.
CYCLE_TARGETS = {1: 1.0, 5: 1.2}


class _CountingConnection(redis.Connection):
    """A connection that counts what it sends: one send is one round trip
    (a pipeline is one send); commands a script runs are not sends. It also
    counts the commands sent, by name (``sent``), so that server time can
    be taken from the top-level commands alone."""

    sends = 0
    sent: Counter[str] = Counter()

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _CountingConnection.sends += 1
        _CountingConnection.sent.update(command_names(command))
        super().send_packed_command(command, check_health)


def command_names(packed: Any) -> list[str]:
    """The command names in RESP-encoded requests (``*N $len NAME ...``)."""
    if isinstance(packed, (bytes, str)):
        packed = [packed]
    data = b"".join(x.encode() if isinstance(x, str) else bytes(x) for x in packed)
    names: list[str] = []
    i = 0
    while i < len(data):
        end = data.index(b"\r\n", i)
        count = int(data[i + 1 : end])
        i = end + 2
        for k in range(count):
            end = data.index(b"\r\n", i)
            size = int(data[i + 1 : end])
            if k == 0:
                names.append(data[end + 2 : end + 2 + size].decode().lower())
            i = end + 2 + size + 2
    return names


def top_level_usec(stats: dict[str, Any], sent: Counter[str]) -> float:
    """Server time of the commands clients sent, from ``INFO commandstats``.

    A script's ``usec`` already includes the commands it runs, which Redis
    also counts under their own names: summing every row would count them
    twice. For each command name, the share of its calls that clients sent
    themselves (the rest ran inside scripts) is taken.
    """
    total = 0.0
    for key, value in stats.items():
        name = str(key).removeprefix("cmdstat_")
        calls = int(value["calls"])
        direct = min(sent.get(name, 0), calls)
        if calls and direct and name not in EXCLUDED:
            total += int(value["usec"]) * direct / calls
    return total


def _cycle_client(url: str) -> redis.Redis:
    kwargs = redis.Redis.from_url(url).connection_pool.connection_kwargs
    pool = redis.ConnectionPool(connection_class=_CountingConnection, **kwargs)
    return redis.Redis(connection_pool=pool, socket_timeout=None)


def _cycle(lib: str, client: redis.Redis, names: list[str]) -> Callable[[], None]:
    """One uncontended acquire+release of ``names``: one call for
    celery-redislock, one lock after the other for the peers (they lock one
    name per call)."""
    if lib == "celery-redislock":
        mgr = LockManager(client, namespace="cycle", owner_ttl=60)
        if len(names) == 1:
            name = names[0]

            def ours_one() -> None:
                with mgr.lock(name):
                    pass

            return ours_one

        def ours_many() -> None:
            with mgr.lock(names):
                pass

        return ours_many
    if lib == "redis-py Lock":

        def redis_py() -> None:
            locks = [client.lock(f"cycle:{n}", timeout=60) for n in names]
            for lk in locks:
                lk.acquire()
            for lk in reversed(locks):
                lk.release()

        return redis_py
    if lib == "python-redis-lock":
        import redis_lock

        def prl() -> None:
            locks = [redis_lock.Lock(client, f"cycle:{n}", expire=60) for n in names]
            for lk in locks:
                lk.acquire()
            for lk in reversed(locks):
                lk.release()

        return prl
    raise ValueError(f"unknown library {lib!r}; choose from {CYCLE_LIBS}")


@dataclass
class CycleResult:
    """One library's uncontended cycle of ``resources`` resources."""

    lib: str
    resources: int
    samples_us: list[float] = field(default_factory=list)
    round_trips: float = 0.0
    commands: dict[str, float] = field(default_factory=dict)
    #: p50 of each round (us), in run order.
    round_p50s_us: list[float] = field(default_factory=list)
    #: Server time per cycle (us): INFO commandstats usec of the commands
    #: the client sent (a script's includes the commands it runs).
    server_us: float = 0.0

    @property
    def p50_us(self) -> float:
        return _percentile(self.samples_us, 0.50)

    @property
    def p99_us(self) -> float:
        return _percentile(self.samples_us, 0.99)

    @property
    def commands_per_cycle(self) -> float:
        return sum(self.commands.values())


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


def measure_cycles(
    url: str,
    rounds: int = 7,
    ops: int = 300,
    shapes: tuple[int, ...] = (1, 5),
    progress: Callable[[str], None] | None = None,
) -> list[CycleResult]:
    """Time uncontended acquire+release cycles of every library, interleaved.

    Each round runs ``ops`` cycles of every (library, shape) in an order
    rotated by the round, so that machine noise falls on all alike; every
    cycle is one sample (``time.perf_counter_ns``). Round trips per cycle
    are counted on the client's connections, Redis commands and server time
    (usec) per cycle with ``INFO commandstats`` over a separate run of ``ops``
    cycles. Flushes the Redis at ``url`` first.
    """
    admin = redis.Redis.from_url(url, socket_timeout=None, decode_responses=True)
    admin.flushdb()
    configs = [(lib, n) for n in shapes for lib in CYCLE_LIBS]
    clients = {c: _cycle_client(url) for c in configs}
    cycles = {c: _cycle(c[0], clients[c], CYCLE_SHAPES[c[1]]) for c in configs}
    results = {c: CycleResult(c[0], c[1]) for c in configs}
    for c in configs:  # warm-up: connections, scripts, registration
        for _ in range(20):
            cycles[c]()
        before = _CountingConnection.sends
        _CountingConnection.sent = Counter()
        admin.config_resetstat()
        for _ in range(ops):
            cycles[c]()
        raw = admin.info("commandstats")
        counts = {str(k).removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}
        results[c].server_us = top_level_usec(raw, _CountingConnection.sent) / ops
        results[c].round_trips = (_CountingConnection.sends - before) / ops
        results[c].commands = {
            k: v / ops for k, v in sorted(counts.items()) if k not in EXCLUDED and v
        }
    clock = time.perf_counter_ns
    for i in range(rounds):
        order = configs[i % len(configs) :] + configs[: i % len(configs)]
        for c in order:
            run = cycles[c]
            samples = []
            for _ in range(ops):
                t = clock()
                run()
                samples.append((clock() - t) / 1000)
            results[c].samples_us.extend(samples)
            results[c].round_p50s_us.append(_percentile(samples, 0.5))
        if progress is not None:
            progress(f"cycle round {i + 1}/{rounds}")
    for client in clients.values():
        client.close()
    admin.flushdb()
    admin.close()
    return [results[c] for c in configs]


def cycle_table(results: list[CycleResult]) -> str:
    """The cycle results as a markdown table, ratios against redis-py Lock's one-lock cycle."""
    ref = next(r for r in results if r.lib == CYCLE_LIBS[0] and r.resources == 1)
    lines = [
        "| resources | library | p50 us | p99 us | p50 / redis-py Lock (1) | "
        "p99 / redis-py Lock (1) | round trips | server us | server commands | commands |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        detail = ", ".join(f"{k} {v:g}" for k, v in r.commands.items())
        lines.append(
            f"| {r.resources} | {r.lib} | {r.p50_us:.0f} | {r.p99_us:.0f} | "
            f"{r.p50_us / ref.p50_us:.2f}x | {r.p99_us / ref.p99_us:.2f}x | "
            f"{r.round_trips:g} | {r.server_us:.0f} | {r.commands_per_cycle:g} | {detail} |"
        )
    return "\n".join(lines)


def cycle_target_lines(results: list[CycleResult]) -> list[str]:
    """One ``target 1 ...: met`` / ``NOT met`` line per shape."""
    ref = next(r for r in results if r.lib == CYCLE_LIBS[0] and r.resources == 1)
    lines = []
    for r in results:
        if r.lib != "celery-redislock":
            continue
        limit = CYCLE_TARGETS.get(r.resources, 1.0)
        p50, p99 = r.p50_us / ref.p50_us, r.p99_us / ref.p99_us
        rounds = [a / b for a, b in zip(r.round_p50s_us, ref.round_p50s_us)]
        within = sum(x <= limit for x in rounds)
        ok = p50 <= limit and p99 <= limit and r.round_trips == 2
        what = (
            f"uncontended {r.resources} resource{'s' if r.resources > 1 else ''} "
            f"<= {limit:g}x redis-py Lock p50/p99, 2 round trips"
        )
        verdict = (
            "met"
            if ok
            else "NOT met ("
            + ", ".join(
                x
                for x in (
                    f"{p50:.2f}x p50" if p50 > limit else "",
                    f"{p99:.2f}x p99" if p99 > limit else "",
                    f"{r.round_trips:g} round trips" if r.round_trips != 2 else "",
                )
                if x
            )
            + ")"
        )
        lines.append(
            f"target 1 ({what}): {verdict}; {p50:.2f}x p50, {p99:.2f}x p99, "
            f"{r.commands_per_cycle:g} server commands per cycle; round p50 ratio at or below "
            f"{limit:g}x in {within} of {len(rounds)} rounds"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.cost``: the uncontended cycle benchmark alone, on
    its own throw-away redis-server (as ``make bench`` runs it)."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from redis_server import RedisServer

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--ops", type=int, default=300, help="cycles per round and library")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        results = measure_cycles(server.url, args.rounds, args.ops)
    print(cycle_table(results))
    print()
    print("\n".join(cycle_target_lines(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
