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
from collections.abc import Callable
from dataclasses import dataclass, field

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
