"""Runs one chaos experiment: servers, workers, faults, drain, audit, check.

Phases:

1. Start two redis-servers (tests/redis_server.py): the lock server, which
   faults hit, and the store server, which they never touch.
2. Start ``processes`` workers (:mod:`chaos.worker`).
3. Until ``duration`` has passed, alternate storms (8-16 s: a random
   fault from ``faults`` every 0.3-2 s, one at a time; a paused process is
   always resumed) and calms (8-14 s without faults, in which only one
   thread per worker makes requests, slowly).
4. Drain: SIGTERM every worker (each finishes its current operation), or
   with ``end="kill"`` SIGKILL them all wherever they are.
5. Wait until every owner's liveness key has expired, then run
   ``reconcile()`` from three processes at once.
6. Audit the lock namespace with SCAN (the only SCAN anywhere: the checker
   may, the engine may not), snapshot the store, and run the checker.

Everything the run wrote stays in ``out`` (timelines, fault log, server
and worker logs, ``summary.json``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import redis

from redis_server import RedisServer, _die_with_parent

from . import checker
from .faults import ALL_FAULTS
from .store import Store

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent

#: Keys allowed in the lock namespace after the final reconcile: the
#: counters, the data set's birth and the format version (no TTL), and the kinds documented with a TTL (docs/design.md,
#: Data model) provided they still carry one.
FIXED_KEYS = ("fence", "born", "seq", "format")
TTL_KINDS = ("req", "wake", "contend", "lost", "dead")


@dataclass
class Config:
    seed: int
    duration: float = 60.0
    processes: int = 4
    threads: int = 3
    resources: int = 8
    owner_ttl: float = 1.5
    faults: tuple[str, ...] = ALL_FAULTS
    fault_gap: tuple[float, float] = (0.3, 2.0)
    #: Faults come in storms (seconds) separated by calms without faults.
    storm: tuple[float, float] = (8.0, 16.0)
    calm: tuple[float, float] = (8.0, 14.0)
    long_timeout: tuple[float, float] = (5.0, 8.0)
    #: The share of requests that take one slot of the limited resource
    #: (``limited={limited_name: limited_slots}``), alone or with one
    #: exclusive resource; 0: none.
    limited_share: float = 0.25
    limited_name: str = "lim"
    limited_slots: int = 3
    #: Every ``asyncio_every``-th worker started (w3, w7, ... with 4) is an
    #: asyncio service (``AsyncLockManager``, coroutines for threads); 0: none.
    asyncio_every: int = 4
    namespace: str = "chaos"
    #: How the workers end: "term" (finish the current request, exit) or
    #: "kill" (SIGKILL mid-flight: reconcile must then clear everything).
    end: str = "term"
    out: str = ""
    verbose: bool = True


class RunConfig(Protocol):
    """What :class:`RunnerBase` reads of a run's configuration."""

    seed: int
    out: str
    verbose: bool


CfgT = TypeVar("CfgT", bound=RunConfig)
OutT = TypeVar("OutT")


@dataclass
class Outcome(Generic[OutT]):
    config: OutT
    stats: dict[str, Any] = field(default_factory=dict)
    violations: list[checker.Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


class RunnerBase(Generic[CfgT]):
    """What the engine run and the Celery run (:mod:`chaos.celery_runner`) share.

    ``label`` prefixes what :meth:`say` prints.
    """

    label = "chaos"

    def __init__(self, cfg: CfgT, prefix: str, data_dir: str) -> None:
        """Make ``cfg.out`` (a temp dir named ``prefix...`` when unset) with
        ``data_dir`` and ``logs`` in it; open the fault log."""
        self.cfg = cfg
        self.out = Path(cfg.out or tempfile.mkdtemp(prefix=prefix))
        cfg.out = str(self.out)
        (self.out / data_dir).mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        self.lock_srv = RedisServer(workdir=self.out / "lock-redis")
        self.io_lock = threading.Lock()
        self.fault_file = open(self.out / "faults.jsonl", "a", buffering=1)  # noqa: SIM115
        self.t0 = time.monotonic()

    def say(self, msg: str) -> None:
        if self.cfg.verbose:
            print(f"{self.label}: +{time.monotonic() - self.t0:7.2f}s {msg}", flush=True)

    def record(self, kind: str, t0: float, t1: float | None = None, **fields: Any) -> None:
        rec = {"kind": kind, "t0": t0, "t1": t0 if t1 is None else t1, **fields}
        with self.io_lock:
            self.fault_file.write(json.dumps(rec) + "\n")

    def restart_lock_server(self, kind: str) -> None:
        """Restart the lock server (the fault ``kind``) and record it."""
        t = time.monotonic()
        self.lock_srv.restart()
        self.record(kind, t, time.monotonic())
        self.say(kind)

    def checked(self) -> Outcome[CfgT]:
        """Run the checker on ``out``; write ``summary.json``; return the outcome."""
        report = checker.check(self.out)
        (self.out / "summary.json").write_text(
            json.dumps(
                {
                    "config": asdict(self.cfg),  # type: ignore[call-overload]
                    "stats": report.stats,
                    "violations": [v.as_dict() for v in report.violations],
                },
                indent=1,
            )
        )
        return Outcome(self.cfg, report.stats, report.violations)


class Runner(RunnerBase[Config]):
    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg, "redislock-chaos-", "timelines")
        self.rng = random.Random(f"faults:{cfg.seed}")
        self.store_srv = RedisServer(workdir=self.out / "store-redis")
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned = 0
        self.quiet_flag = self.out / "quiet"

    # -- helpers ------------------------------------------------------------

    def worker_cmd(self, label: str, *extra: str) -> list[str]:
        c = self.cfg
        return [
            sys.executable, "-m", "chaos.worker",
            "--url", self.lock_srv.url,
            "--store-url", self.store_srv.url,
            "--namespace", c.namespace,
            "--timeline", str(self.out / "timelines" / f"{label}.jsonl"),
            "--label", label,
            "--seed", str(c.seed),
            "--threads", str(c.threads),
            "--resources", str(c.resources),
            "--owner-ttl", str(c.owner_ttl),
            "--long-timeout", *(str(x) for x in c.long_timeout),
            "--quiet-flag", str(self.quiet_flag),
            "--limited-share", str(c.limited_share),
            "--limited-name", c.limited_name,
            "--limited-slots", str(c.limited_slots),
            *extra,
        ]  # fmt: skip

    def popen(self, label: str, *extra: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), str(TESTS_DIR), *filter(None, [env.get("PYTHONPATH")])]
        )
        log = open(self.out / "logs" / f"{label}.log", "ab")  # noqa: SIM115
        try:
            return subprocess.Popen(
                self.worker_cmd(label, *extra),
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()

    def spawn_worker(self) -> str:
        label = f"w{self.spawned}"
        self.spawned += 1
        every = self.cfg.asyncio_every
        extra = ("--asyncio",) if every and self.spawned % every == 0 else ()
        self.workers[label] = self.popen(label, *extra)
        return label

    def live_workers(self) -> list[str]:
        return sorted(k for k, p in self.workers.items() if p.poll() is None)

    def lock_client(self) -> redis.Redis:
        return redis.Redis(
            host=self.lock_srv.host, port=self.lock_srv.port, decode_responses=True,
            socket_timeout=5,
        )  # fmt: skip

    # -- faults ---------------------------------------------------------------

    def inject(self, kind: str) -> None:
        getattr(self, f"fault_{kind}")()

    def fault_kill_worker(self) -> None:
        live = self.live_workers()
        if not live:
            return
        label = self.rng.choice(live)
        proc = self.workers[label]
        t = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        new = self.spawn_worker()
        self.record("kill_worker", t, target=label, respawned=new)
        self.say(f"kill_worker {label} (respawned as {new})")

    def fault_stop_worker(self) -> None:
        live = self.live_workers()
        if not live:
            return
        label = self.rng.choice(live)
        pause = self.cfg.owner_ttl * self.rng.uniform(1.5, 2.5)
        proc = self.workers[label]
        t = time.monotonic()
        proc.send_signal(signal.SIGSTOP)
        time.sleep(pause)
        proc.send_signal(signal.SIGCONT)
        self.record("stop_worker", t, time.monotonic(), target=label)
        self.say(f"stop_worker {label} for {pause:.2f}s")

    def fault_redis_restart(self) -> None:
        self.restart_lock_server("redis_restart")

    def fault_redis_stop(self) -> None:
        proc = self.lock_srv.process
        if proc is None:
            return
        pause = self.rng.uniform(1.0, 3.0)
        t = time.monotonic()
        proc.send_signal(signal.SIGSTOP)
        time.sleep(pause)
        proc.send_signal(signal.SIGCONT)
        self.record("redis_stop", t, time.monotonic())
        self.say(f"redis_stop for {pause:.2f}s")

    def fault_client_kill(self) -> None:
        client = self.lock_client()
        try:
            me = client.client_id()
            ids = [int(c["id"]) for c in client.client_list() if int(c["id"]) != me]
            victims = self.rng.sample(ids, (len(ids) + 1) // 2) if ids else []
            t = time.monotonic()
            for cid in victims:
                client.execute_command("CLIENT", "KILL", "ID", str(cid))
        finally:
            client.close()
        self.record("client_kill", t, time.monotonic(), killed=len(victims), of=len(ids))
        self.say(f"client_kill {len(victims)} of {len(ids)} clients")

    def fault_script_flush(self) -> None:
        client = self.lock_client()
        try:
            t = time.monotonic()
            client.script_flush()
        finally:
            client.close()
        self.record("script_flush", t)
        self.say("script_flush")

    def fault_force_cleanup(self) -> None:
        from celery_redislock import LockManager

        client = self.lock_client()
        try:
            owners = sorted(client.smembers("{" + self.cfg.namespace + "}:owners"))
        finally:
            client.close()
        if not owners:
            return
        owner = self.rng.choice(owners)
        manager = LockManager(self.lock_srv.url, self.cfg.namespace, owner_ttl=self.cfg.owner_ttl)
        try:
            t = time.monotonic()
            rep = manager.cleanup_owner(owner, force=True)
        finally:
            manager.close()
        self.record("force_cleanup", t, time.monotonic(), owner=owner, released=rep.released)
        self.say(f"force_cleanup {owner} released={rep.released} status={rep.status}")

    def fault_reconcile(self) -> None:
        live = self.live_workers()
        if not live:
            return
        chosen = self.rng.sample(live, min(len(live), self.rng.choice((2, 3))))
        t = time.monotonic()
        for label in chosen:
            self.workers[label].send_signal(signal.SIGUSR1)
        self.record("reconcile", t, targets=chosen)
        self.say(f"reconcile from {','.join(chosen)}")

    # -- phases -------------------------------------------------------------

    def run(self) -> Outcome[Config]:
        self.lock_srv.start()
        self.store_srv.start()
        try:
            return self._run()
        finally:
            for proc in self.workers.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    proc.wait()
            self.fault_file.close()
            if self.lock_srv.process is not None:  # interrupted during a redis_stop
                self.lock_srv.process.send_signal(signal.SIGCONT)
            self.lock_srv.stop()
            self.store_srv.stop()

    def _run(self) -> Outcome[Config]:
        c = self.cfg
        self.t0 = time.monotonic()
        (self.out / "run.json").write_text(
            json.dumps({"config": asdict(c), "t0": self.t0, "w0": time.time()}, indent=1)
        )
        self.say(
            f"seed={c.seed} duration={c.duration}s processes={c.processes} threads={c.threads} "
            f"owner_ttl={c.owner_ttl} faults={','.join(c.faults) or 'none'} out={self.out}"
        )
        for _ in range(c.processes):
            self.spawn_worker()
        end = self.t0 + c.duration
        storm_end = self.t0 + self.rng.uniform(*c.storm)
        while True:
            now = time.monotonic()
            if now >= storm_end:
                # A calm: no fault for a while, so that the waiter check has
                # quiet windows and damage left by the storm shows up.
                calm = min(self.rng.uniform(*c.calm), max(0.0, end - now))
                self.record("calm", now, now + calm)
                self.say(f"calm for {calm:.1f}s")
                self.quiet_flag.touch()
                time.sleep(calm)
                self.quiet_flag.unlink()
                storm_end = time.monotonic() + self.rng.uniform(*c.storm)
                continue
            gap = self.rng.uniform(*c.fault_gap)
            if time.monotonic() + gap >= end:
                break
            time.sleep(gap)
            if c.faults:
                self.inject(self.rng.choice(c.faults))
        time.sleep(max(0.0, end - time.monotonic()))
        self.drain()
        self.final_reconcile()
        audit = self.audit()
        store = Store(self.store_srv.url)
        try:
            snapshot = store.snapshot([f"r{i}" for i in range(c.resources)])
            anomalies = store.anomalies()
        finally:
            store.close()
        (self.out / "audit.json").write_text(
            json.dumps({"keys": audit, "store": snapshot, "anomalies": anomalies}, indent=1)
        )
        return self.checked()

    def drain(self) -> None:
        if self.cfg.end == "kill":
            self.say("end: SIGKILL to every worker")
            for label in self.live_workers():
                proc = self.workers[label]
                now = time.monotonic()
                proc.kill()
                proc.wait()
                self.record("end_kill", now, target=label)
            return
        self.say("drain: SIGTERM to every worker")
        t = time.monotonic()
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        limit = self.cfg.long_timeout[1] + 10.0
        for label, proc in self.workers.items():
            try:
                proc.wait(max(0.1, t + limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                proc.kill()
                proc.wait()
                self.record("drain_kill", now, target=label)
                self.say(f"drain: {label} did not exit within {limit:.0f}s: SIGKILLed")
        self.say(f"drain: done in {time.monotonic() - t:.1f}s")

    def final_reconcile(self) -> None:
        ns = "{" + self.cfg.namespace + "}:"
        client = self.lock_client()
        deadline = time.monotonic() + self.cfg.owner_ttl * 2 + 5
        try:
            while time.monotonic() < deadline:
                owners = client.smembers(ns + "owners")
                if not any(client.exists(ns + "alive:" + o) for o in owners):
                    break
                time.sleep(0.1)
        finally:
            client.close()
        procs = [self.popen(f"final-reconcile-{i}", "--reconcile-once") for i in range(3)]
        for proc in procs:
            proc.wait(60)
        self.say("final reconcile from 3 processes done")

    def audit(self) -> list[dict[str, Any]]:
        """Every key left in the namespace, with its type and TTL (SCAN)."""
        prefix = "{" + self.cfg.namespace + "}:"
        client = self.lock_client()
        out = []
        try:
            for key in client.scan_iter(match=prefix.replace("{", "\\{").replace("}", "\\}") + "*"):
                kind = key[len(prefix) :].split(":", 1)[0]
                pttl = client.pttl(key)
                entry: dict[str, Any] = {"key": key, "type": client.type(key), "pttl": pttl}
                if entry["type"] == "zset":
                    entry["members"] = client.zrange(key, 0, 20)
                elif entry["type"] == "set":
                    entry["members"] = sorted(client.smembers(key))[:20]
                elif entry["type"] == "hash":
                    entry["members"] = client.hgetall(key)
                entry["allowed"] = (key[len(prefix) :] in FIXED_KEYS) or (
                    kind in TTL_KINDS and pttl > 0
                )
                out.append(entry)
        finally:
            client.close()
        return out


def run(cfg: Config) -> Outcome[Config]:
    return Runner(cfg).run()
