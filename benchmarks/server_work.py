"""Server work per uncontended lock cycle, counted: redis-server's
instructions under callgrind.

Redis runs every command and script on one thread, so the server work a lock
cycle costs is what limits a fleet on one Redis. Timing it (``INFO
commandstats`` usec, or the server's CPU time) on a shared machine moves
with the load; counting the instructions redis-server executes does not.
This benchmark starts redis-server under ``valgrind --tool=callgrind`` on a
free loopback port and, per library and shape, runs a warm-up, asks
callgrind for a dump (``callgrind_control --dump``), runs ``--cycles``
uncontended acquire+release cycles from one client, and dumps again: the
second dump's total is the instructions of exactly those cycles (user space
of redis-server: reading and parsing the requests, running the commands and
scripts, writing the replies; not the kernel's share of the socket I/O,
which costs the same per round trip for every library).

Shapes: one resource (celery-redislock: a plain lock, then the same cycle
with a task's holder record as ``@locked`` takes it), five resources (one
call for celery-redislock, five locks one after the other for the peers).
A reference row (:data:`FLOOR`) runs celery-redislock's 9 commands in two
scripts with no logic: the difference to our row is the scripts' own work.
Also counted: Redis commands per cycle (``INFO commandstats``, commands run
inside scripts under their own names), and the liveness upkeep per call: one
``heartbeat.lua`` call for one owner, one node tick with 8 idle children
(:func:`measure_upkeep`).

Usage::

    make bench-server
    .venv/bin/python -m benchmarks.server_work [--cycles 500] [--out FILE]

Needs ``valgrind`` (Debian's package). Instructions are not time; the value
of this count is that it does not move with the machine's load (runs
agree within about 1%: hash tables and Lua's garbage collector vary a
little), so it shows what a change to a script costs, and how the
libraries' server work compares, on any machine. Not a timed test:
tests/test_benchmarks_smoke.py runs it small.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.cost import CYCLE_SHAPES, EXCLUDED, _cycle, commandstats  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from engine_helpers import acquire_as_task  # noqa: E402
from redis_server import binary_version, free_port, resolve_binary  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results-server.md"
#: A reference row, not a library: the 9 commands of celery-redislock's
#: one-resource cycle in two scripts that do nothing else (fixed keys, no
#: checks): what the commands and the two script calls cost without the
#: scripts' own logic.
FLOOR = "floor: our commands, no logic"
#: What one (library, shape) row runs: celery-redislock's @locked shape is
#: its one-resource cycle with a task's holder record.
ROWS = (
    ("redis-py Lock", 1),
    ("python-redis-lock", 1),
    ("celery-redislock", 1),
    ("celery-redislock @locked", 1),
    (FLOOR, 1),
    ("redis-py Lock", 5),
    ("python-redis-lock", 5),
    ("celery-redislock", 5),
)
#: The holder record @locked sends (task name, a uuid task id, node).
HOLDER = "proj.tasks.sync\n0b7e4a2c-7b1e-4bd5-9f3e-6a1d0c2f9e41\ncelery@worker-1"
WARMUP = 50
_TOTALS_RE = re.compile(rb"^totals:\s*(\d+)", re.M)  # the last line of a complete dump


class ValgrindMissing(RuntimeError):
    """valgrind (callgrind) is not installed."""


@dataclass
class Row:
    """One library and shape: instructions and commands per cycle."""

    lib: str
    resources: int
    instructions: float = 0.0
    commands: dict[str, float] = field(default_factory=dict)

    @property
    def command_count(self) -> float:
        return sum(self.commands.values())


class CallgrindServer:
    """redis-server under callgrind; :meth:`count` gives the instructions of a
    block of client work (from one dump to the next)."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            raise ValgrindMissing("valgrind is not installed (Debian: apt-get install valgrind)")
        self.workdir = workdir
        self.port = free_port()
        self.out = workdir / "callgrind.out"
        self.binary = resolve_binary()
        self.proc = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={self.out}",
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dumps = 0
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 120  # valgrind starts slowly
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("redis-server did not start under valgrind") from None
                time.sleep(0.2)
            finally:
                client.close()

    def _dump(self) -> Path:
        self._dumps += 1
        subprocess.run(
            ["callgrind_control", "--dump", str(self.proc.pid)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        path = Path(f"{self.out}.{self._dumps}")
        deadline = time.monotonic() + 60
        while not (path.exists() and _TOTALS_RE.search(path.read_bytes())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"callgrind wrote no dump {path}")
            time.sleep(0.05)
        return path

    def count(self, work: Callable[[], object]) -> int:
        """Instructions redis-server executed while ``work`` ran."""
        self._dump()  # everything before: left out
        work()
        return int(_TOTALS_RE.search(self._dump().read_bytes()).group(1))  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far, the measurement's own commands left out."""
    return {k: v for k, v in commandstats(client).items() if k not in EXCLUDED}


def _locked_cycle(client: redis.Redis) -> Callable[[], None]:
    """celery-redislock's one-resource cycle as @locked runs it in a task."""
    from celery_redislock import LockManager

    mgr = LockManager(client, namespace="cycle", owner_ttl=60)

    def cycle() -> None:
        acquire_as_task(mgr, HOLDER, "r0", timeout=None).release()

    return cycle


_FLOOR_ACQUIRE = """
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('EXISTS', KEYS[1], KEYS[3])
local t = redis.call('TIME')
redis.call('SET', KEYS[4], t[1] .. t[2], 'GET')
redis.call('HSET', KEYS[1], ARGV[1], 'x' .. t[1] .. t[2])
redis.call('HSET', KEYS[5], 'r0', '')
return {1, t[1] .. t[2], 0}
"""
_FLOOR_RELEASE = """
redis.call('EXISTS', KEYS[2], KEYS[3])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], 'r0')
return {1, 0}
"""


def _floor_cycle(client: redis.Redis) -> Callable[[], None]:
    """The :data:`FLOOR` row's cycle: two EVALSHA, one round trip each."""
    acquire = client.register_script(_FLOOR_ACQUIRE)
    release = client.register_script(_FLOOR_RELEASE)
    client.set("{f}:alive:o", "1")
    akeys = ["{f}:lock:r0", "{f}:alive:o", "{f}:q:r0", "{f}:fence", "{f}:held:o"]
    rkeys = ["{f}:lock:r0", "{f}:q:r0", "{f}:contended:r0", "{f}:held:o"]

    def cycle() -> None:
        acquire(akeys, ["o|1", "60000"])
        release(rkeys, ["o|1"])

    return cycle


def measure(server: CallgrindServer, cycles: int) -> list[Row]:
    """Every row of :data:`ROWS`, ``cycles`` cycles each."""
    rows = []
    admin = redis.Redis.from_url(server.url)
    for lib, resources in ROWS:
        client = redis.Redis.from_url(server.url)
        if lib == "celery-redislock @locked":
            one = _locked_cycle(client)
        elif lib == FLOOR:
            one = _floor_cycle(client)
        else:
            one = _cycle(lib, client, CYCLE_SHAPES[resources])
        for _ in range(WARMUP):  # scripts loaded, owner registered, connection open
            one()

        def run(one: Callable[[], None] = one) -> None:
            for _ in range(cycles):
                one()

        before = _commands(admin)
        instructions = server.count(run)
        after = _commands(admin)
        row = Row(lib, resources, instructions / cycles)
        row.commands = {
            name: (calls - before.get(name, 0)) / cycles
            for name, calls in after.items()
            if calls != before.get(name, 0)
        }
        rows.append(row)
        client.close()
    admin.close()
    return rows


def measure_upkeep(server: CallgrindServer, calls: int) -> dict[str, float]:
    """Instructions per call of the liveness upkeep: one ``heartbeat.lua``
    call for one owner (a manager's own heartbeat), and one node tick of a
    worker with 8 idle pool children (``node_heartbeat.lua``, the fleet's
    per-tick cost; benchmarks/fleet.py's simulated node)."""
    from benchmarks import fleet
    from celery_redislock.store.scripts import Scripts
    from celery_redislock.worker.node import Node, new_incarnation

    client = fleet._admin(server.url, scripts=True)
    mgr = fleet._manager(client, "upkeep", owner_ttl=30)
    mgr.acquire("warm", timeout=0).release()  # registers the owner
    scripts = Scripts(client)
    alive = [mgr.keys.alive(mgr.owner_id)]

    def heartbeat() -> None:
        for _ in range(calls):
            scripts.run("heartbeat", alive, ["30000"])

    node = Node(fleet._manager(client, "upkeep", owner_ttl=30), "w0@fleet", new_incarnation())
    node.start()
    fleet._children(client, "upkeep", node.group_key, 8, 0, "n0", 30)

    def ticks() -> None:
        for _ in range(calls):
            node.tick()

    out = {}
    for label, work in (("heartbeat.lua, one owner", heartbeat), ("node tick, 8 children", ticks)):
        work()  # warm-up: scripts loaded, connections open
        out[label] = server.count(work) / calls
    client.close()
    return out


def markdown(rows: list[Row]) -> str:
    """The table: instructions and commands per cycle, and ratios to redis-py's Lock."""
    base = {r.resources: r.instructions for r in rows if r.lib == "redis-py Lock"}
    lines = [
        "| library | resources | redis-server instructions per cycle | x redis-py Lock "
        "| Redis commands per cycle | of which |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = r.instructions / base[r.resources] if base.get(r.resources) else float("nan")
        detail = ", ".join(f"{k} {v:g}" for k, v in sorted(r.commands.items()))
        lines.append(
            f"| {r.lib} | {r.resources} | {r.instructions:,.0f} | {ratio:.2f}x "
            f"| {r.command_count:g} | {detail} |"
        )
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def callgrind_server() -> Iterator[CallgrindServer]:
    with tempfile.TemporaryDirectory(prefix="redislock-callgrind-") as tmp:
        server = CallgrindServer(Path(tmp))
        try:
            yield server
        finally:
            server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=500, help="counted cycles per row")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.cycles < 1:
        ap.error("--cycles must be at least 1")
    began = time.monotonic()
    try:
        with callgrind_server() as server:
            version = ".".join(str(x) for x in binary_version(server.binary))
            rows = measure(server, args.cycles)
            upkeep = measure_upkeep(server, args.cycles)
    except ValgrindMissing as exc:
        print(f"server_work: {exc}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join(
        [
            "# Server work per uncontended lock cycle\n",
            f"{stamp}; redis-server {version} under callgrind; {os.cpu_count()} CPUs "
            f"({cpu_model()}), Python {platform.python_version()}; "
            f"{time.monotonic() - began:.0f} s in all.\n",
            f"Command: `{' '.join(['python -m benchmarks.server_work', *(argv or sys.argv[1:])])}`\n",
            f"{args.cycles} cycles per row from one client, after {WARMUP} uncounted ones. "
            "Instructions: redis-server's user space (parsing, commands, scripts, replies), "
            "counted, not timed (runs agree within about 1%).\n",
            markdown(rows),
            "## Liveness upkeep, per call\n",
            "| call | redis-server instructions |\n| --- | --- |\n"
            + "".join(f"| {k} | {v:,.0f} |\n" for k, v in upkeep.items()),
        ]
    )
    print(text)
    args.out.write_text(text)
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
