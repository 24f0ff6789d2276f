"""Real ``celery worker`` and ``celery beat`` subprocesses for end-to-end tests.

Each process runs in its own session (process group), with stdout and stderr
in a log file under the test's tmp_path. :class:`Cluster` starts them with
the environment :mod:`e2e.proj` reads, and at teardown kills every process
group it started (SIGKILL), whatever happened. Readiness is a condition
(a ping task answered by the worker's own queue), never a fixed sleep.

Also usable outside pytest (nothing here imports pytest).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import redis
from celery import Celery

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
#: ``celery`` of this interpreter (works whether or not its script is on PATH).
CELERY = [sys.executable, "-m", "celery"]
HOST = "e2e"

#: Seconds a worker may take to answer its first ping (a loaded 2-core box).
START_TIMEOUT = float(os.environ.get("E2E_START_TIMEOUT", "90"))

T = TypeVar("T")

_live: dict[int, subprocess.Popen[bytes]] = {}


def wait_for(
    cond: Callable[[], T | None | bool],
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.02,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``cond`` until it returns a truthy value; return that value.

    Raises AssertionError naming ``what`` (and ``on_timeout()``'s text) when
    the deadline passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            extra = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def redis_ms(c: Cluster) -> int:
    """The lock Redis's clock (``TIME``), in milliseconds."""
    sec, usec = c.lock_redis.time()
    return int(sec) * 1000 + int(usec) // 1000


def _new_session() -> None:  # pragma: no cover - runs in the child
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


class CeleryProcess:
    """One ``celery`` subprocess (worker or beat) in its own process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        with open(log, "ab") as out:
            out.write(f"### {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=str(REPO_ROOT),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_new_session,
            )
        self.pid = self.proc.pid
        _live[self.pid] = self.proc

    def __repr__(self) -> str:
        return f"<CeleryProcess {self.name} pid={self.pid} rc={self.proc.poll()}>"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        """The whole log so far."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def log_lines(self, *needles: str) -> list[str]:
        """Log lines containing every needle (case-insensitive)."""
        low = [n.lower() for n in needles]
        return [ln for ln in self.text().splitlines() if all(n in ln.lower() for n in low)]

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the main process only (e.g. SIGTERM: warm shutdown)."""
        if self.alive:
            os.kill(self.pid, sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (main process and pool)."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        """Wait for the main process to exit; return its exit code."""
        return self.proc.wait(timeout)

    def group_pids(self) -> list[int]:
        """Pids still in this process group (main process and children)."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getpgid(int(entry)) == self.pid:
                    out.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
        return out

    def destroy(self) -> None:
        """SIGKILL the process group and reap the main process."""
        self.kill_group(signal.SIGKILL)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        # pool children re-parented to init die with the group; wait for them
        deadline = time.monotonic() + 10
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        _live.pop(self.pid, None)


@atexit.register
def _kill_leftovers() -> None:
    for pid in list(_live):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Worker(CeleryProcess):
    """A ``celery worker`` subprocess; ``queue`` is its own private queue."""

    def __init__(self, nodename: str, queue: str, *args: Any) -> None:
        self.nodename = nodename
        self.queue = queue
        super().__init__(*args)


class Cluster:
    """Workers and beat for one test, sharing one broker, queue and namespace.

    Args:
        broker_url: the broker (and result backend) Redis URL.
        workdir: directory for logs and beat's schedule file.
        namespace: the lock namespace (``redislock_namespace``).
        lock_url: ``redislock_url``; None leaves the library's default.
        lock_admin_url: URL of the lock Redis for the test's own reads (the
            helpers below use KEYS, HGETALL...); default ``lock_url``. Give
            it when ``lock_url`` is a least-privilege user.
        settings: extra environment for :mod:`e2e.proj` (``E2E_OWNER_TTL``...).
    """

    def __init__(
        self,
        broker_url: str,
        workdir: Path,
        *,
        namespace: str | None = None,
        lock_url: str | None = None,
        lock_admin_url: str | None = None,
        app_module: str = "e2e.proj",
        **settings: Any,
    ) -> None:
        self.broker_url = broker_url
        self.lock_url = lock_url or broker_url
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace or f"e2e{uuid.uuid4().hex[:8]}"
        self.queue = f"q-{self.namespace}"
        self.app_module = app_module
        self.env = dict(os.environ)
        self.env.update(
            {
                "PYTHONPATH": os.pathsep.join(
                    [str(TESTS_DIR), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
                ),
                "PYTHONUNBUFFERED": "1",
                "E2E_BROKER_URL": broker_url,
                "E2E_DATA_URL": broker_url,
                "E2E_NAMESPACE": self.namespace,
                "E2E_QUEUE": self.queue,
            }
        )
        if lock_url:
            self.env["E2E_LOCK_URL"] = lock_url
        for key, value in settings.items():
            self.env[f"E2E_{key.upper()}"] = str(value)
        self.processes: list[CeleryProcess] = []
        self.producer = Celery("e2e-producer", broker=broker_url, backend=broker_url)
        self.producer.conf.update(task_default_queue=self.queue, result_expires=600)
        self.data = redis.Redis.from_url(broker_url, decode_responses=True)
        self.lock_redis = redis.Redis.from_url(
            lock_admin_url or self.lock_url, decode_responses=True
        )
        self._seq = 0

    # -- processes ------------------------------------------------------

    def _log(self, label: str) -> Path:
        self._seq += 1
        return self.workdir / f"{self._seq:02d}-{label}.log"

    def start_worker(
        self,
        name: str,
        *,
        concurrency: int = 2,
        pool: str = "prefork",
        extra_args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Worker:
        """Start ``celery worker -P POOL -c N -n NAME@e2e``; wait until it answers.

        Pass the pool as ``pool``, never in ``extra_args``: Celery applies
        gevent/eventlet monkey-patching from the first ``-P`` on the command line.

        The worker consumes the cluster's queue and its own ``<queue>.<name>``.
        Several workers may share a node name (for the duplicate test); each
        start gets its own private queue.
        """
        nodename = f"{name}@{HOST}"
        private = f"{self.queue}.{name}.{uuid.uuid4().hex[:6]}"
        argv = [
            *CELERY,
            "-A",
            self.app_module,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            nodename,
            "-Q",
            f"{self.queue},{private}",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "INFO",
            *extra_args,
        ]
        proc_env = dict(self.env)
        proc_env.update(env or {})
        worker = Worker(nodename, private, name, argv, proc_env, self._log(f"worker-{name}"))
        self.processes.append(worker)
        if wait:
            self.wait_ready(worker)
        return worker

    def start_ready_workers(self, *names: str, **kwargs: Any) -> list[Worker]:
        """Start the workers ``names`` side by side, then wait until each answers.

        ``kwargs`` go to :meth:`start_worker` (not ``wait``).
        """
        workers = [self.start_worker(name, wait=False, **kwargs) for name in names]
        for worker in workers:
            self.wait_ready(worker)
        return workers

    def wait_ready(self, worker: Worker, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """Block until ``worker`` answers a ping task sent to its private queue."""
        result = self.producer.send_task("e2e.ping", queue=worker.queue)
        deadline = time.monotonic() + timeout
        while True:
            if not worker.alive:
                raise AssertionError(f"{worker} exited before it was ready:\n{worker.tail()}")
            if result.ready():
                answer: dict[str, Any] = result.get(timeout=1)
                return answer
            if time.monotonic() > deadline:
                raise AssertionError(f"{worker} not ready within {timeout}s:\n{worker.tail()}")
            time.sleep(0.05)

    def start_beat(self) -> CeleryProcess:
        """Start ``celery beat`` with its schedule file under the workdir."""
        label = f"beat{self._seq + 1}"
        argv = [
            *CELERY,
            "-A",
            self.app_module,
            "beat",
            "-l",
            "INFO",
            "-s",
            str(self.workdir / f"{label}-schedule"),
            "--pidfile=",
        ]
        beat = CeleryProcess("beat", argv, dict(self.env), self._log(label))
        self.processes.append(beat)
        return beat

    def stop_all(self) -> None:
        """SIGKILL every process group this cluster started."""
        for proc in self.processes:
            proc.destroy()

    def close(self) -> None:
        self.stop_all()
        self.data.close()
        self.lock_redis.close()
        self.producer.close()

    def report(self) -> str:
        """Every log's tail, for a failed test."""
        parts = []
        for proc in self.processes:
            parts.append(f"===== {proc} log {proc.log} =====\n{proc.tail(150)}")
        return "\n".join(parts)

    # -- tasks and Redis state -------------------------------------------

    def send(self, task: str, *args: Any, queue: str | None = None, **kwargs: Any) -> Any:
        """Send task ``e2e.<task>`` (to the shared queue unless ``queue``)."""
        return self.producer.send_task(
            f"e2e.{task}", args=args, kwargs=kwargs, queue=queue or self.queue
        )

    def wait_held(self, tag: str, timeout: float = 60.0, attempt: int = 1) -> dict[str, Any]:
        """Wait until a ``hold`` task (delivery ``attempt``) holds its lock."""
        what = f"hold task {tag} attempt {attempt}"
        return self.wait_logged(f"e2e:held-log:{tag}", attempt, what, timeout)

    def wait_logged(
        self, log: str, attempt: int, what: str, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Wait until the JSON list ``log`` has the entry of delivery ``attempt``; return it."""

        def seen() -> dict[str, Any] | None:
            for raw in self.data.lrange(log, 0, -1):
                info: dict[str, Any] = json.loads(raw)
                if info["attempt"] == attempt:
                    return info
            return None

        return wait_for(seen, timeout, what, on_timeout=self.report)

    def go(self, tag: str) -> None:
        """Let a blocked ``hold`` task finish."""
        self.data.rpush(f"e2e:go:{tag}", "go")

    def key(self, kind: str, name: str = "") -> str:
        """A key of the lock namespace: ``{ns}:<kind>:<name>`` (or ``{ns}:<kind>``)."""
        prefix = "{" + self.namespace + "}:"
        return f"{prefix}{kind}:{name}" if name else f"{prefix}{kind}"

    def lock_holders(self, resource: str) -> dict[str, str]:
        """Holder token -> mode of a resource's lock (empty when free).

        The stored value is the mode followed by the grant's fencing token;
        only the mode is returned.
        """
        raw = self.lock_redis.hgetall(self.key("lock", resource))
        return {str(k): str(v)[:1] for k, v in raw.items()}

    def owners_holding(self, resource: str) -> set[str]:
        """Owner ids holding ``resource``."""
        return {token.split("|", 1)[0] for token in self.lock_holders(resource)}

    def namespace_keys(self, kind: str) -> list[str]:
        """Keys ``{ns}:<kind>:*`` (KEYS is fine on the test's own Redis)."""
        return sorted(str(k) for k in self.lock_redis.keys(self.key(kind, "*")))

    def no_lock_keys_left(self) -> bool:
        """No lock key and no holder registry is left in the namespace."""
        return not self.namespace_keys("lock") and not self.namespace_keys("held")

    def wait_no_lock_keys(self, timeout: float = 20.0) -> None:
        """Wait until :meth:`no_lock_keys_left`."""
        wait_for(self.no_lock_keys_left, timeout, "all locks released", on_timeout=self.report)

    def wait_freed(self, owner: str, resource: str, what: str, timeout: float = 30.0) -> None:
        """Wait until ``owner`` no longer holds ``resource``; ``what`` names the wait."""
        wait_for(
            lambda: owner not in self.owners_holding(resource),
            timeout=timeout,
            what=what,
            on_timeout=self.report,
        )

    def active_owners(self) -> set[str]:
        return {str(m) for m in self.lock_redis.smembers(self.key("owners"))}

    def alive_pttl(self, owner: str) -> int:
        """PTTL of an owner's liveness key (-2 when gone)."""
        return int(self.lock_redis.pttl(self.key("alive", owner)))

    def wait_beats(self, owner: str, beats: int, timeout: float = 60.0) -> None:
        """Wait until ``owner``'s liveness key was refreshed ``beats`` times.

        A refresh shows as its PTTL going up. Fails if the key disappears.
        """
        last = self.alive_pttl(owner)
        seen = 0
        deadline = time.monotonic() + timeout
        while seen < beats:
            now = self.alive_pttl(owner)
            if now == -2:
                raise AssertionError(f"liveness of {owner} vanished\n{self.report()}")
            if now > last:
                seen += 1
            last = now
            if time.monotonic() > deadline:
                raise AssertionError(f"{owner}: only {seen}/{beats} beats in {timeout}s")
            time.sleep(0.05)
