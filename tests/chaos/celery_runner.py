"""The chaos run's Celery participants: real prefork workers, ``@locked`` tasks, faults.

Phases:

1. Start two redis-servers (no persistence): the *lock server* (the
   engine's only Redis, hit by ``lock_restart``) and the *broker server*
   (broker and result backend, never touched).
2. Start ``workers`` ``celery worker -P prefork -c <concurrency>``
   processes (:class:`e2e.harness.Cluster`, app :mod:`chaos.celery_app`);
   every one runs a dispatcher.
3. For ``duration`` seconds a producer thread sends tasks (seeded: kind,
   resource, mode, hold) while a fault thread injects the enabled faults.
4. Drain: wait until every sent task is SUCCESS, FAILURE or REVOKED, at
   most ``drain`` seconds (a bound, not a pause), then a short linger for
   late copies; read every task's final state.
5. Stop the workers and run :func:`chaos.checker.check` on the folder.

The participants (:data:`PARTICIPANTS`) are switched on one by one: each is
a kind of task (``defer``, ``retry``, ``unique``, ``mixed``), a way to make
adoptions land near the grant deadline (``adopt_deadline``) or a fault.
Files of a run: ``run.json``, ``sent.jsonl`` (the producer), ``faults.jsonl``
(the fault thread: faults and worker starts), ``bodies/<pid>.jsonl`` (every
pool child's stamps), ``final.json`` (task states after the drain),
``logs/`` (the workers' logs), ``summary.json``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
from celery import Celery

from e2e.harness import Cluster, Worker
from redis_server import RedisServer

from .participants import ALL_PARTICIPANTS
from .runner import Outcome, RunnerBase


@dataclass
class CeleryConfig:
    seed: int
    duration: float = 60.0
    participants: tuple[str, ...] = ALL_PARTICIPANTS
    workers: int = 2
    concurrency: int = 2
    resources: int = 3
    owner_ttl: float = 2.0
    heartbeat: float = 0.25
    #: redislock_defer_grant_ttl: short, so that adoptions can be made to land near it.
    grant_ttl: float = 3.0
    #: redislock_defer_guard_interval: short, so that parked tasks the lock
    #: Redis lost are recovered within the drain.
    guard_interval: float = 2.0
    #: redislock_defer_guard_rate: the guards' budget (checks a second). The
    #: producer's backlog bound keeps about 45 tasks outstanding, so at 40 a
    #: second the 2 s interval stretches a little at the peaks; a lost task
    #: is still recovered within the lock restart's settling time.
    guard_rate: float = 40.0
    #: The broker's visibility timeout (0: 20 s with wait-mode tasks, else 10 s).
    visibility: float = 0.0
    #: Seconds between two sends, and between two faults.
    send_gap: tuple[float, float] = (0.05, 0.35)
    #: Most tasks of one resource outstanding (sent, not yet SUCCESS, FAILURE
    #: or REVOKED) before the producer sends another on it (0: no bound). The
    #: load is a little above what four pool slots serve on c:r0, so without
    #: a bound its line grows for as long as the run lasts: after a few
    #: minutes waiting tasks time out behind it and the drain cannot end.
    #: 15: what one resource serves (about 0.3 s a body, with pauses of 3 to
    #: 4 s while faults hit its holders) within the wait-mode tasks' timeout
    #: (the visibility timeout less 5 s, 15 s): at 30 such tasks timed out in
    #: line, their place kept.
    max_backlog: int = 15
    fault_gap: tuple[float, float] = (2.0, 5.0)
    #: Longest drain (0: derived from the TTLs and the visibility timeout).
    drain: float = 0.0
    #: A resource idle longer than this while a task waits for it is a violation
    #: (0: two heartbeat intervals plus 0.5 s for one dispatch round trip).
    idle_bound: float = 0.0
    namespace: str = "chaosc"
    out: str = ""
    verbose: bool = True

    def __post_init__(self) -> None:
        if not self.visibility:
            self.visibility = 20.0 if "mixed" in self.participants else 10.0
        if not self.drain:
            self.drain = (
                self.visibility
                + 2 * self.grant_ttl
                + 2 * self.owner_ttl
                + 3 * self.guard_interval
                + 10.0
            )
        if not self.idle_bound:
            self.idle_bound = 2 * self.heartbeat + 0.5


CeleryOutcome = Outcome[CeleryConfig]

FINAL_STATES = ("SUCCESS", "FAILURE", "REVOKED")


class CeleryRunner(RunnerBase[CeleryConfig]):
    label = "chaos-celery"

    def __init__(self, cfg: CeleryConfig) -> None:
        super().__init__(cfg, "redislock-chaos-celery-", "bodies")
        self.broker_srv = RedisServer(workdir=self.out / "broker-redis")
        self.fault_rng = random.Random(f"celery-faults:{cfg.seed}")
        self.send_rng = random.Random(f"celery-sends:{cfg.seed}")
        self.stop = threading.Event()
        self.faults_over = threading.Event()
        self.finished = threading.Event()
        self.fault_thread: threading.Thread | None = None
        self.sent_file = open(self.out / "sent.jsonl", "a", buffering=1)  # noqa: SIM115
        self.workers: dict[str, Worker] = {}
        self.sent_ids: list[str] = []
        #: Resource -> ids sent and not yet seen final (the producer's bound).
        self.open_ids: dict[str, set[str]] = {}
        self.held_s = 0.0
        self.key_ids: dict[str, set[str]] = {}
        self.last_stall = 0.0
        self.cluster: Cluster | None = None
        self.fault_error: BaseException | None = None

    # -- helpers ------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.cfg.participants

    # -- workers --------------------------------------------------------------

    def start_worker(self, name: str, wait: bool = True) -> Worker:
        assert self.cluster is not None
        worker = self.cluster.start_worker(name, concurrency=self.cfg.concurrency, wait=False)
        if wait:
            self.up(name, worker)
        return worker

    def up(self, name: str, worker: Worker) -> None:
        assert self.cluster is not None
        self.cluster.wait_ready(worker)
        self.workers[name] = worker
        self.record("worker_up", time.monotonic(), node=worker.nodename, pid=worker.pid,
                    slots=self.cfg.concurrency)  # fmt: skip
        self.say(f"worker {worker.nodename} up (pid {worker.pid})")

    def children(self, worker: Worker) -> list[int]:
        return sorted(p for p in worker.group_pids() if p != worker.pid)

    def _gone(self, worker: Worker, how: str, t: float) -> None:
        self.record("worker_down", t, node=worker.nodename, pid=worker.pid, how=how)

    # -- faults ---------------------------------------------------------------

    def pick_child(self) -> tuple[Worker, int] | None:
        """A random worker and a random pool child of it (None: it has none)."""
        worker = self.workers[self.fault_rng.choice(sorted(self.workers))]
        kids = self.children(worker)
        if not kids:
            return None
        return worker, self.fault_rng.choice(kids)

    def fault_kill_child(self) -> None:
        picked = self.pick_child()
        if picked is None:
            return
        worker, pid = picked
        t = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.record("kill_child", t, node=worker.nodename, pid=pid)
        self.say(f"kill_child {pid} of {worker.nodename}")

    def _restart(self, name: str, kind: str) -> None:
        worker = self.workers[name]
        t = time.monotonic()
        if kind == "kill_main":
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(15)
            # The orphaned pool children exit once they see their parent gone;
            # any still there after a few seconds are killed with the group.
            deadline = time.monotonic() + 5
            while self.children(worker) and time.monotonic() < deadline:
                time.sleep(0.05)
        worker.destroy()
        self.record(kind, t, time.monotonic(), node=worker.nodename, pid=worker.pid)
        self._gone(worker, kind, t)
        self.say(f"{kind} {worker.nodename}")
        self.start_worker(name)

    def fault_kill_main(self) -> None:
        self._restart(self.fault_rng.choice(sorted(self.workers)), "kill_main")

    def fault_kill_worker(self) -> None:
        self._restart(self.fault_rng.choice(sorted(self.workers)), "kill_worker")

    def fault_lock_restart(self) -> None:
        self.restart_lock_server("lock_restart")

    def fault_stop_child(self) -> None:
        picked = self.pick_child()
        if picked is None:
            return
        worker, pid = picked
        pause = self.cfg.grant_ttl * self.fault_rng.uniform(0.5, 1.3)
        t = time.monotonic()
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(pause)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.record("stop_child", t, time.monotonic(), node=worker.nodename, pid=pid)
        self.say(f"stop_child {pid} of {worker.nodename} for {pause:.2f}s")

    def fault_kinds(self) -> list[str]:
        kinds = [
            k for k in ("lock_restart", "kill_child", "kill_main", "kill_worker") if self.has(k)
        ]
        if self.has("adopt_deadline"):
            kinds.append("stop_child")
        return kinds

    def fault_loop(self, end: float) -> None:
        kinds = self.fault_kinds()
        try:
            while kinds:
                gap = self.fault_rng.uniform(*self.cfg.fault_gap)
                if time.monotonic() + gap >= end - 1.0 or self.stop.wait(gap):
                    break
                getattr(self, f"fault_{self.fault_rng.choice(kinds)}")()
        except BaseException as exc:  # the run ends; the error is reported
            self.fault_error = exc
            self.say(f"fault thread failed: {exc!r}")
        finally:
            self.faults_over.set()
        # A worker started from this thread gets SIGKILL when the thread ends
        # (PR_SET_PDEATHSIG follows the thread that forked it): stay until the
        # run has stopped every worker.
        self.finished.wait()

    # -- load -----------------------------------------------------------------

    def producer(self) -> tuple[Celery, Any]:
        from celery_redislock import RedisLock

        from .celery_app import define_unique

        app = Celery("chaosc-producer")
        assert self.cluster is not None
        app.conf.update(
            broker_url=self.broker_srv.url,
            result_backend=self.broker_srv.url,
            task_default_queue=self.cluster.queue,
            result_expires=3600,
            redislock_namespace=self.cfg.namespace,
            redislock_url=self.lock_srv.url,
            redislock_owner_ttl=self.cfg.owner_ttl,
            redislock_unique_ttl=600,
        )
        RedisLock(app)
        return app, define_unique(app)

    def kinds(self) -> list[tuple[str, float]]:
        out = []
        if self.has("defer"):
            out.append(("defer", 3.0))
        if self.has("retry"):
            out.append(("retry", 1.0))
        if self.has("unique"):
            out.append(("unique", 1.5))
        if self.has("mixed"):
            out.append(("wait", 2.0))
        if self.has("adopt_deadline"):
            out.append(("stall", 2.0))
        return out

    def hold_back(self, client: redis.Redis, res: str) -> float:
        """Wait while ``res`` has ``max_backlog`` tasks outstanding; seconds waited.
        Waiting draws nothing from the seeded generator: the sends stay the seed's."""
        bound, t = self.cfg.max_backlog, time.monotonic()
        ids = self.open_ids.setdefault(res, set())
        while bound and len(ids) >= bound and not self.stop.is_set():
            chunk = sorted(ids)
            for tid, raw in zip(chunk, client.mget([f"celery-task-meta-{x}" for x in chunk])):
                if raw and json.loads(raw)["status"] in FINAL_STATES:
                    ids.discard(tid)
            if len(ids) >= bound:
                self.stop.wait(0.25)
        return time.monotonic() - t

    def send_one(
        self,
        app: Celery,
        unique: Any,
        recent: list[tuple[str, str, float]],
        res: str = "",
        client: redis.Redis | None = None,
    ) -> None:
        rng = self.send_rng
        kinds = self.kinds()
        kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        n = self.cfg.resources
        res = res or f"r{rng.choices(range(n), [1 / (i + 1) for i in range(n)])[0]}"
        held = self.hold_back(client, res) if client is not None else 0.0
        self.held_s += held
        if kind == "stall":
            # One stalled task at a time: each holds its resource idle for
            # about the grant TTL, more would starve the rest of the load.
            if time.monotonic() - self.last_stall < 2 * self.cfg.grant_ttl:
                kind = "defer"
            else:
                self.last_stall = time.monotonic()
        mode = "x" if kind == "unique" or rng.random() < 0.7 else "s"
        hold = round(rng.uniform(0.05, 0.4), 3)
        rec: dict[str, Any] = {"kind": kind, "res": res, "mode": mode, "hold": hold}
        if held >= 0.01:
            rec["held_back_s"] = round(held, 3)
        kwargs: dict[str, Any] = {"res": res, "hold": hold}
        if kind == "retry":
            kwargs["retry"] = True
        elif kind == "stall":
            g = self.cfg.grant_ttl
            # Land the adoption near the grant deadline, and stall between its
            # two steps for a while (sometimes across the deadline).
            kwargs["stall_pre"] = round(g * rng.uniform(0.6, 1.0), 3)
            kwargs["stall_mid"] = round(g * rng.uniform(0.0, 0.6), 3)
        t0 = time.monotonic()
        try:
            if kind == "unique":
                now = time.monotonic()
                live = [r for r in recent if now - r[2] < 3.0]
                if live and rng.random() < 0.3:
                    key = rng.choice(live)[0]
                    rec["dup_attempt"] = True
                else:
                    key = f"k{len(self.sent_ids)}"
                rec["key"] = key
                result = unique.apply_async(kwargs={"key": key, **kwargs})
            else:
                name = f"chaos.{'wait' if kind == 'wait' else 'defer'}_{mode}"
                result = app.send_task(name, kwargs=kwargs)
        except Exception as exc:
            rec.update(t0=t0, t1=time.monotonic(), error=repr(exc))
            with self.io_lock:
                self.sent_file.write(json.dumps(rec) + "\n")
            return
        rec.update(id=result.id, t0=t0, t1=time.monotonic(), args=kwargs)
        if kind == "unique":
            ids = self.key_ids.setdefault(rec["key"], set())
            rec["dup_of"] = result.id if result.id in ids else None
            if result.id not in ids:
                ids.add(result.id)
                recent.append((rec["key"], result.id, rec["t1"]))
                del recent[:-50]
        if not rec.get("dup_of"):
            self.sent_ids.append(result.id)
            self.open_ids.setdefault(res, set()).add(result.id)
        with self.io_lock:
            self.sent_file.write(json.dumps(rec) + "\n")

    def produce(self, end: float) -> None:
        app, unique = self.producer()
        client = redis.Redis.from_url(self.broker_srv.url, decode_responses=True)
        recent: list[tuple[str, str, float]] = []
        try:
            while time.monotonic() < end and not self.stop.is_set():
                if self.send_rng.random() < 0.12:
                    # A burst on one resource: more tasks than pool slots queue for it.
                    res = f"r{self.send_rng.randrange(self.cfg.resources)}"
                    self.held_s += self.hold_back(client, res)
                    for _ in range(self.send_rng.randint(4, 8)):
                        self.send_one(app, unique, recent, res)
                else:
                    self.send_one(app, unique, recent, client=client)
                self.stop.wait(self.send_rng.uniform(*self.cfg.send_gap))
        finally:
            app.close()
            client.close()

    # -- drain ----------------------------------------------------------------

    def states(self, client: redis.Redis, errors: dict[str, str] | None = None) -> dict[str, str]:
        """Every sent task's state (and, into ``errors``, a failure's exception type)."""
        out: dict[str, str] = {}
        ids = list(self.sent_ids)
        for i in range(0, len(ids), 200):
            chunk = ids[i : i + 200]
            for tid, raw in zip(chunk, client.mget([f"celery-task-meta-{t}" for t in chunk])):
                meta = json.loads(raw) if raw else {"status": "PENDING"}
                out[tid] = meta["status"]
                result = meta.get("result")
                if errors is not None and meta["status"] == "FAILURE" and isinstance(result, dict):
                    errors[tid] = str(result.get("exc_type"))
        return out

    def drain(self) -> dict[str, Any]:
        client = redis.Redis.from_url(self.broker_srv.url, decode_responses=True)
        t = time.monotonic()
        deadline = t + self.cfg.drain
        try:
            while True:
                states = self.states(client)
                left = [i for i, s in states.items() if s not in FINAL_STATES]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            drained = not left
            # Late copies (a redelivery, a second publish) show up within a
            # dispatch round trip or two.
            time.sleep(2 * self.cfg.heartbeat + 1.0)
            errors: dict[str, str] = {}
            states = self.states(client, errors)
        finally:
            client.close()
        took = time.monotonic() - t
        self.say(f"drain: {'done' if drained else 'NOT done'} in {took:.1f}s")
        return {"states": states, "errors": errors, "drained": drained, "drain_s": took,
                "t_end": time.monotonic()}  # fmt: skip

    # -- phases ---------------------------------------------------------------

    def run(self) -> CeleryOutcome:
        self.lock_srv.start()
        self.broker_srv.start()
        try:
            return self._run()
        finally:
            self.stop.set()
            if self.cluster is not None:
                self.cluster.close()
            self.finished.set()
            if self.fault_thread is not None:
                self.fault_thread.join()
            self.sent_file.close()
            self.fault_file.close()
            self.lock_srv.stop()
            self.broker_srv.stop()

    def _run(self) -> CeleryOutcome:
        c = self.cfg
        self.cluster = Cluster(
            self.broker_srv.url,
            self.out / "logs",
            namespace=c.namespace,
            lock_url=self.lock_srv.url,
            app_module="chaos.celery_app",
            owner_ttl=c.owner_ttl,
            heartbeat=c.heartbeat,
            defer_grant_ttl=c.grant_ttl,
            defer_guard=c.guard_interval,
            defer_guard_rate=c.guard_rate,
            defer_ttl=600,
            unique_ttl=600,
            visibility=c.visibility,
            wait_timeout_s=max(5.0, c.visibility - 5.0),
            bodies=str(self.out / "bodies"),
        )
        self.t0 = time.monotonic()
        (self.out / "run.json").write_text(
            json.dumps(
                {"config": asdict(c), "t0": self.t0, "w0": time.time(), "celery": True}, indent=1
            )  # fmt: skip
        )
        self.say(
            f"seed={c.seed} duration={c.duration}s workers={c.workers}x{c.concurrency} "
            f"participants={','.join(c.participants) or 'none'} out={self.out}"
        )
        # Start them all, then wait for each (they start side by side).
        started = [(f"cw{i}", self.start_worker(f"cw{i}", wait=False)) for i in range(c.workers)]
        for name, worker in started:
            self.up(name, worker)
        t_load = time.monotonic()
        self.record("load", t_load, t_load + c.duration)
        end = t_load + c.duration
        self.fault_thread = threading.Thread(target=self.fault_loop, args=(end,), name="faults")
        self.fault_thread.start()
        try:
            self.produce(end)
        finally:
            self.stop.set()
            self.faults_over.wait()
        if self.fault_error is not None:
            raise self.fault_error
        self.say(
            f"load done: {len(self.sent_ids)} tasks sent "
            f"(held back {self.held_s:.1f}s by the backlog bound)"
        )
        final = self.drain()
        (self.out / "final.json").write_text(json.dumps(final, indent=1))
        return self.checked()


def run(cfg: CeleryConfig) -> CeleryOutcome:
    return CeleryRunner(cfg).run()
