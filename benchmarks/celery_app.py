"""The Celery app the worker subprocesses of :mod:`benchmarks.celery_e2e` run.

Started as ``celery -A benchmarks.celery_app worker`` by the end-to-end
harness (``tests/e2e/harness.py``), which sets the environment it reads:
``E2E_BROKER_URL`` (broker, result backend and lock store), ``E2E_DATA_URL``
(the tasks' own counters), ``E2E_NAMESPACE``, ``E2E_QUEUE``,
``E2E_OWNER_TTL``, ``E2E_HEARTBEAT`` and, to put the lock store on a
Redis of its own, ``E2E_LOCK_URL``. Kept apart from the tests' app
(``tests/e2e/proj.py``) so that the no-op tasks the cost measurement times
run with no signal handler but the one the contention measurement needs.

Every key the tasks write lives under ``cebench:`` (outside the lock
namespace).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_redislock import RedisLock, current_lease, locked


def _build() -> Celery:
    broker = os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0")
    app = Celery("cebench", broker=broker, backend=broker)
    conf: dict[str, Any] = {
        "task_default_queue": os.environ.get("E2E_QUEUE", "celery"),
        "broker_connection_retry_on_startup": True,
        "result_expires": 600,
        "redislock_namespace": os.environ.get("E2E_NAMESPACE", "cebench"),
    }
    if os.environ.get("E2E_LOCK_URL"):  # the lock store on a Redis of its own
        conf["redislock_url"] = os.environ["E2E_LOCK_URL"]
    if os.environ.get("E2E_OWNER_TTL"):
        conf["redislock_owner_ttl"] = float(os.environ["E2E_OWNER_TTL"])
    if os.environ.get("E2E_HEARTBEAT"):
        conf["redislock_heartbeat_interval"] = float(os.environ["E2E_HEARTBEAT"])
    app.conf.update(conf)
    return app


app = _build()
locks = RedisLock(app)

#: name -> (pid, client): this process's clients (made again after a fork).
_clients: dict[str, tuple[int, redis.Redis]] = {}


def _client(name: str, url: str, **kwargs: Any) -> redis.Redis:
    pid, client = _clients.get(name) or (0, None)
    if client is None or pid != os.getpid():
        client = redis.Redis.from_url(url, **kwargs)
        _clients[name] = (os.getpid(), client)
    return client


def data() -> redis.Redis:
    """This process's client for the benchmark's own keys."""
    url = os.environ.get("E2E_DATA_URL") or os.environ.get("E2E_BROKER_URL", "")
    return _client("data", url, decode_responses=True)


@app.task(name="e2e.ping", bind=True)
def ping(self: Any) -> dict[str, Any]:
    """Readiness probe of the harness: which worker process answered."""
    return {"pid": os.getpid(), "hostname": self.request.hostname}


# -- contention: lock wait measured inside the task ----------------------------

#: ``time.time()`` when the task that runs now in this process started
#: (``task_prerun``, sent just before ``@locked``'s wrapper asks for the lock).
_started = 0.0


@signals.task_prerun.connect
def _note_start(sender: Any = None, **_: Any) -> None:
    global _started
    _started = time.time()


@app.task(name="cebench.write", bind=True, acks_late=True, ignore_result=True)
@locked("cebench:{res}", timeout=300)
def write(self: Any, res: str, run: str, work: float) -> None:
    """A non-atomic increment of ``cebench:<run>:count:<res>`` under the lock.

    GET, ``work`` seconds of "work", SET + 1: two writers inside at once lose
    an increment. Pushes the lock wait (seconds from the task's start, just
    before the acquire, to the grant: ``Lease.acquired_at``) to
    ``cebench:<run>:waits``, which is also how the producer counts finished
    tasks.
    """
    lease = current_lease()
    assert lease is not None
    wait = lease.acquired_at - _started
    r = data()
    key = f"cebench:{run}:count:{res}"
    value = int(r.get(key) or 0)
    time.sleep(work)
    r.set(key, value + 1)
    r.rpush(f"cebench:{run}:waits", f"{wait:.6f}")


# -- the cost of @locked: no-op tasks, timed in the process that runs them -------

#: Every no-op body run in this process since the last :func:`stamps` call:
#: ``(time.perf_counter(), kind)`` (kind ``p``: plain, ``l``: @locked,
#: ``r``: inside redis-py's ``Lock``) or, while :func:`cpu_watch` watches,
#: ``(time.perf_counter(), kind, [ns on CPU of each watched process])``.
_stamps: list[tuple[Any, ...]] = []


class _CpuWatch:
    """Cumulative ns on CPU of a set of processes, read from a task body.

    This process: ``time.process_time_ns()`` (all its threads). Another: the
    sum over its threads alive when the watch starts of the first field of
    ``/proc/<pid>/task/<tid>/schedstat`` (ns on the CPU), each file opened
    once and read again with ``pread``. A thread that exits keeps its last
    reading; one started later is not counted.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = list(pids)
        #: pid -> [fd, last reading] per thread (not for this process).
        self.threads: dict[int, list[list[int]]] = {}
        for pid in self.pids:
            if pid == os.getpid():
                continue
            fds = []
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):  # a thread that just exited
                        fds.append([os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY), 0])
            except OSError:
                pass  # no such process, or no /proc: read as -1
            self.threads[pid] = fds

    def read(self) -> list[int]:
        """ns on CPU of each watched process so far; -1 for one not readable."""
        out = []
        for pid in self.pids:
            if pid == os.getpid():
                out.append(time.process_time_ns())
                continue
            threads = self.threads[pid]
            for thread in threads:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    thread[1] = int(os.pread(thread[0], 64, 0).split(None, 1)[0])
            out.append(sum(t[1] for t in threads) if threads else -1)
        return out

    def close(self) -> None:
        for threads in self.threads.values():
            for fd, _ in threads:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.threads.clear()


#: The processes the no-op bodies read the CPU of (None: none, the default).
_watch: _CpuWatch | None = None


def _stamp(kind: str) -> None:
    now = time.perf_counter()
    if _watch is None:
        _stamps.append((now, kind))
    else:
        _stamps.append((now, kind, _watch.read()))


@app.task(name="cebench.cpu_watch")
def cpu_watch(pids: list[int]) -> dict[str, Any]:
    """From now on, each no-op body run in this process also records the ns
    on CPU of the processes ``pids`` (this one's own pid included as
    ``os.getpid()``; an empty list turns it off).

    Returns one reading (``reading``: ns per pid, -1 where unreadable, 0
    where the kernel keeps no schedstats) and ``read_ns``, this process's
    CPU per reading (ns, mean of 200).
    """
    global _watch
    if _watch is not None:
        _watch.close()
        _watch = None
    if not pids:
        return {"reading": [], "read_ns": 0}
    watch = _CpuWatch(pids)
    reading = watch.read()
    n = 200
    began = time.process_time_ns()
    for _ in range(n):
        watch.read()
    read_ns = (time.process_time_ns() - began) // n
    _watch = watch
    return {"reading": reading, "read_ns": read_ns}


@app.task(name="cebench.gate", ignore_result=True)
def gate(key: str) -> None:
    """Hold this pool slot until the producer pushes to ``key``.

    Lets the producer queue a whole batch before the worker runs any of it,
    so the batch is timed at the worker's pace, not the producer's.
    """
    r = data()
    r.rpush(f"{key}:in", "1")
    r.blpop([key], timeout=120)


@app.task(name="cebench.noop", ignore_result=True)
def noop(key: str) -> None:
    """A no-op task (``key`` only to take the same argument as noop_locked)."""
    _stamp("p")


@app.task(name="cebench.noop_locked", ignore_result=True)
@locked("cebench-cost:{key}")
def noop_locked(key: str) -> None:
    """The same no-op task under ``@locked`` (an uncontended resource)."""
    _stamp("l")


def peer_client() -> redis.Redis:
    """This process's client of the lock store, for the peer lock."""
    url = os.environ.get("E2E_LOCK_URL") or os.environ.get("E2E_BROKER_URL", "")
    return _client("peer", url or "redis://127.0.0.1:6379/0")


@app.task(name="cebench.noop_redis_py_lock", ignore_result=True)
def noop_redis_py_lock(key: str) -> None:
    """The same no-op task inside the simplest Redis lock, for contrast:
    redis-py's ``Lock`` (SET NX PX to take it, a script to release it: two
    round trips, like ``@locked``) on the same Redis, uncontended."""
    lock = peer_client().lock(f"cebench-rp:{key}", timeout=60)
    lock.acquire()
    try:
        _stamp("r")
    finally:
        lock.release()


@app.task(name="cebench.stamps")
def stamps() -> list[tuple[Any, ...]]:
    """Return and forget this process's no-op stamps (:data:`_stamps`)."""
    out = list(_stamps)
    _stamps.clear()
    return out


# -- profiling the task-side path (CEBENCH_PROFILE=1, solo pool) -----------------

if os.environ.get("CEBENCH_PROFILE"):
    import cProfile

    _profile = cProfile.Profile()

    @signals.task_prerun.connect
    def _profile_on(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", "").startswith("cebench.noop"):
            _profile.enable()

    @signals.task_postrun.connect
    def _profile_off(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "name", "").startswith("cebench.noop"):
            _profile.disable()

    @app.task(name="cebench.profile_dump")
    def profile_dump(path: str) -> str:
        """Write the profile of the no-op tasks run so far to ``path``; reset it."""
        _profile.dump_stats(path)
        _profile.clear()
        return path
