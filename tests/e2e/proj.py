"""The Celery app that end-to-end worker subprocesses run (``celery -A e2e.proj``).

Everything comes from environment variables, so one module serves every
test (each test gets its own broker queue, lock namespace and TTLs):

======================  =========================================================
``E2E_BROKER_URL``      broker (and, unless ``E2E_BACKEND_URL``, result backend)
``E2E_BACKEND_URL``     result backend URL
``E2E_LOCK_URL``        ``redislock_url``; unset: the library's default (broker)
``E2E_DATA_URL``        Redis for the tasks' counters and markers (default broker)
``E2E_NAMESPACE``       ``redislock_namespace``
``E2E_QUEUE``           ``task_default_queue``
``E2E_OWNER_TTL``       ``redislock_owner_ttl`` (seconds)
``E2E_HEARTBEAT``       ``redislock_heartbeat_interval`` (seconds)
``E2E_RECONCILE``       ``redislock_reconcile_interval`` (seconds)
``E2E_UNIQUE_TTL``      ``redislock_unique_ttl`` (seconds)
``E2E_FAST_RESTART``    ``redislock_fast_restart_cleanup`` (``0``/``1``)
``E2E_EVICTION_CHECK``  ``redislock_eviction_check`` (``warn``/``raise``/``ignore``)
``E2E_MAIN_HELPER``     ``"<resource> <tag>"``: at ``worker_ready``, the main
                        process forks a helper (:func:`_helper`) holding it
``E2E_WAIT_REPLICAS``   ``redislock_wait_replicas``; ``E2E_WAIT_TIMEOUT``: ``_wait_timeout``
``E2E_METRICS_PORT``    ``redislock_metrics_port`` (the worker's Prometheus endpoint)
``E2E_DEFER_TTL``       ``redislock_defer_ttl``; ``E2E_DEFER_GRANT_TTL``: ``_defer_grant_ttl``
``E2E_DEFER_GUARD``     ``redislock_defer_guard_interval`` (seconds)
``E2E_RECORD_THREADS``  ``1``: at ``worker_shutdown`` the main process records
                        the threads still alive (:func:`_record_threads`)
======================  =========================================================

Every key the tasks write for the test lives under ``e2e:`` (outside the lock
namespace): counters, "inside" markers, pids, and the lists the tests push to
let a blocked task finish.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import billiard
import redis
from celery import Celery, signals
from celery.backends.base import Backend

from celery_redislock import LockLost, LockManager, LockTimeout, RedisLock, current_lease, locked

from . import unique_tasks
from .settings import env_float, worker_settings

#: Longest a ``hold`` task blocks waiting for its go signal, seconds.
HOLD_LIMIT = 300.0


def _build() -> Celery:
    broker = os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0")
    app = Celery("e2e", broker=broker, backend=os.environ.get("E2E_BACKEND_URL", broker))
    conf = worker_settings("redislock", result_expires=600)
    if os.environ.get("E2E_FAST_RESTART"):
        conf["redislock_fast_restart_cleanup"] = os.environ["E2E_FAST_RESTART"] == "1"
    if os.environ.get("E2E_EVICTION_CHECK"):
        conf["redislock_eviction_check"] = os.environ["E2E_EVICTION_CHECK"]
    if os.environ.get("E2E_METRICS_PORT"):
        conf["redislock_metrics_port"] = int(os.environ["E2E_METRICS_PORT"])
        conf["redislock_metrics_address"] = "127.0.0.1"
    if os.environ.get("E2E_WAIT_REPLICAS"):
        conf["redislock_wait_replicas"] = int(os.environ["E2E_WAIT_REPLICAS"])
        conf["redislock_wait_timeout"] = env_float("E2E_WAIT_TIMEOUT") or 1.0
    app.conf.update(conf)
    return app


app = _build()
locks = RedisLock(app)

_data: redis.Redis | None = None
_data_pid = 0


def data() -> redis.Redis:
    """This process's client for the test's own keys (re-made after fork)."""
    global _data, _data_pid
    if _data is None or _data_pid != os.getpid():
        url = os.environ.get("E2E_DATA_URL") or os.environ.get("E2E_BROKER_URL", "")
        _data = redis.Redis.from_url(url, decode_responses=True)
        _data_pid = os.getpid()
    return _data


def _lease_info() -> dict[str, Any]:
    lease = current_lease()
    return {
        "pid": os.getpid(),
        "owner": lease.owner_id if lease is not None else None,
        "token": lease.token if lease is not None else None,
        "fence": lease.fencing_token if lease is not None else None,
    }


@app.task(name="e2e.ping", bind=True)
def ping(self: Any) -> dict[str, Any]:
    """Readiness probe: which worker process answered."""
    return {"pid": os.getpid(), "hostname": self.request.hostname}


@app.task(name="e2e.write", bind=True, acks_late=True)
@locked("res:{res}", timeout=120, on_busy="wait")
def write(self: Any, res: str, pause: float = 0.005) -> int:
    """Exclusive writer: a non-atomic read-modify-write of ``e2e:counter:<res>``.

    Records an exclusion violation when another writer or any reader is
    inside the same resource at the same time.
    """
    r = data()
    try:
        if r.incr(f"e2e:inside:w:{res}") != 1 or int(r.get(f"e2e:inside:r:{res}") or 0):
            r.rpush("e2e:violations", f"write {res} pid={os.getpid()}")
        value = int(r.get(f"e2e:counter:{res}") or 0)
        time.sleep(pause)  # widen the read-modify-write window
        r.set(f"e2e:counter:{res}", value + 1)
        r.rpush(f"e2e:order:{res}", f"w{value + 1}")
        return value + 1
    finally:
        r.decr(f"e2e:inside:w:{res}")


@app.task(name="e2e.read", bind=True, acks_late=True)
@locked(shared=["res:{res}"], timeout=120, on_busy="wait")
def read(self: Any, res: str, pause: float = 0.02) -> int:
    """Shared reader: no writer may be inside; other readers may.

    Records in ``e2e:readers-max:<res>`` the most readers seen together.
    """
    r = data()
    try:
        n = r.incr(f"e2e:inside:r:{res}")
        if int(r.get(f"e2e:inside:w:{res}") or 0):
            r.rpush("e2e:violations", f"read {res} pid={os.getpid()}")
        best = int(r.get(f"e2e:readers-max:{res}") or 0)
        if n > best:
            r.set(f"e2e:readers-max:{res}", n)
        time.sleep(pause)
        return int(r.get(f"e2e:counter:{res}") or 0)
    finally:
        r.decr(f"e2e:inside:r:{res}")


@app.task(name="e2e.hold", bind=True, acks_late=True)
@locked("res:{res}", timeout=120, on_busy="wait")
def hold(self: Any, res: str, tag: str, block: int = 1000) -> dict[str, Any]:
    """Hold ``res:<res>`` until the test pushes to ``e2e:go:<tag>``.

    Attempts (deliveries) up to ``block`` wait for the go signal; a later
    one completes at once (a redelivered task after its child was killed).
    Writes ``e2e:held:<tag>`` (JSON: pid, owner, token, fence) once the
    lock is held, and ``e2e:done:<tag>`` when it finishes (with ``lost``:
    whether the lease was marked lost by then); sets ``e2e:lost:<tag>`` as
    soon as it sees its lease marked lost while it waits. A lost lease
    fails the task with LockLost once it returns (``on_lost="fail"``).
    """
    return _hold(self, res, tag, block)


@app.task(name="e2e.hold_ignore", bind=True, acks_late=True)
@locked("res:{res}", timeout=120, on_busy="wait", on_lost="ignore")
def hold_ignore(self: Any, res: str, tag: str, block: int = 1000) -> dict[str, Any]:
    """:func:`hold` with ``on_lost="ignore"``: a lost lease only logs."""
    return _hold(self, res, tag, block)


@app.task(name="e2e.hold_terminate", bind=True, acks_late=True)
@locked("res:{res}", timeout=120, on_busy="wait", on_lost="terminate")
def hold_terminate(self: Any, res: str, tag: str, block: int = 1000) -> dict[str, Any]:
    """:func:`hold` with ``on_lost="terminate"``: a lost lease kills the child."""
    return _hold(self, res, tag, block)


@app.task(name="e2e.reenter", bind=True, acks_late=True)
@locked("res:{res}", timeout=120, on_busy="wait")
def reenter(self: Any, res: str) -> dict[str, Any]:
    """Calls another @locked function on the same resource from its body."""
    outer = current_lease()
    inner = _inner_locked(res)
    return {"outer_fence": outer.fencing_token if outer else None, **inner}


@locked("res:{res}")
def _inner_locked(res: str) -> dict[str, Any]:
    lease = current_lease()
    return {"inner_fence": lease.fencing_token if lease else None}


def _hold(task: Any, res: str, tag: str, block: int) -> dict[str, Any]:
    r = data()
    attempt = int(r.incr(f"e2e:attempts:{tag}"))
    info = _lease_info()
    info["attempt"] = attempt
    info["task_id"] = task.request.id
    r.set(f"e2e:held:{tag}", json.dumps(info))
    r.rpush(f"e2e:held-log:{tag}", json.dumps(info))
    lease = current_lease()
    if attempt <= block:
        deadline = time.monotonic() + HOLD_LIMIT
        while time.monotonic() < deadline:
            if lease is not None and lease.lost and not r.exists(f"e2e:lost:{tag}"):
                r.set(f"e2e:lost:{tag}", json.dumps(info))  # the body was told
            if r.blpop([f"e2e:go:{tag}"], timeout=0.5):
                break
    info["lost"] = lease.lost if lease is not None else None
    r.rpush(f"e2e:done:{tag}", json.dumps(info))
    return info


def _helper(resource: str, tag: str) -> None:
    """Body of a helper process forked by ``fork_helper``.

    Takes ``resource`` with a lease of its own (``locks.manager``, inherited
    across the fork), pushes ``e2e:helper:<tag>`` (JSON: pid, ppid, owner,
    token, fence), and holds it until the test pushes ``e2e:go:<tag>``; meanwhile
    sets ``e2e:helper-lost:<tag>`` if it ever sees its lease lost. Then it
    pushes ``e2e:helper-done:<tag>`` (``lost`` and ``check``: whether
    ``lease.check()`` passed) and releases.
    """
    r = data()
    try:
        lease = locks.manager.acquire(resource, timeout=60)
    except Exception as exc:
        r.rpush(f"e2e:helper:{tag}", json.dumps({"error": repr(exc)}))
        raise
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "owner": lease.owner_id,
        "token": lease.token,
        "fence": lease.fencing_token,
    }
    r.rpush(f"e2e:helper:{tag}", json.dumps(info))
    deadline = time.monotonic() + HOLD_LIMIT
    while time.monotonic() < deadline:
        if lease.lost:
            r.set(f"e2e:helper-lost:{tag}", "1")
        if r.blpop([f"e2e:go:{tag}"], timeout=0.1):
            break
    info["lost"] = lease.lost
    try:
        lease.check()
        info["check"] = True
    except LockLost:
        info["check"] = False
    lease.release()
    r.rpush(f"e2e:helper-done:{tag}", json.dumps(info))


def _start_helper_process(how: str, resource: str, tag: str) -> Any:
    """Start :func:`_helper` in a fork-context ``multiprocessing`` or ``billiard`` Process."""
    if how == "billiard":
        proc = billiard.get_context("fork").Process(target=_helper, args=(resource, tag))
        proc.start()
        return proc
    # A prefork pool child is marked daemonic for multiprocessing, which then
    # refuses to start children: lift the flag around start(), as users who
    # fork from a task do (or they use billiard).
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        proc = multiprocessing.get_context("fork").Process(target=_helper, args=(resource, tag))
        proc.start()
    finally:
        if daemon is not None:
            config["daemon"] = daemon
    return proc


def _fork_helper(resource: str, tag: str) -> int:
    """``os.fork()`` a helper that runs :func:`_helper` and exits (0 once it
    returned, 1 if it raised); its pid."""
    pid = os.fork()
    if pid == 0:  # the helper
        code = 1
        try:
            _helper(resource, tag)
            code = 0
        finally:
            os._exit(code)
    return pid


@app.task(name="e2e.fork_helper", bind=True)
def fork_helper(self: Any, resource: str, tag: str, how: str = "multiprocessing") -> dict[str, Any]:
    """Fork a helper process running :func:`_helper`; return once it exited.

    ``how``: ``multiprocessing`` or ``billiard`` (a fork-context Process),
    or ``fork`` (``os.fork()`` directly). Returns this process's pid and the
    helper's pid and exit code (negative: killed by that signal).
    """
    if how == "fork":
        pid = _fork_helper(resource, tag)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
    else:
        proc = _start_helper_process(how, resource, tag)
        pid = int(proc.pid or 0)
        proc.join()
        code = int(proc.exitcode if proc.exitcode is not None else -999)
    return {"pid": os.getpid(), "helper_pid": pid, "helper_exit": code}


@app.task(name="e2e.try_take", bind=True)
def try_take(self: Any, resource: str) -> bool:
    """Try once (timeout=0) to take ``resource``; release at once if granted."""
    try:
        lease = locks.manager.acquire(resource, timeout=0)
    except LockTimeout:
        return False
    lease.release()
    return True


def _fork_main_helper(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` (main process): fork a helper if ``E2E_MAIN_HELPER`` asks."""
    spec = os.environ.get("E2E_MAIN_HELPER")
    if not spec:
        return
    resource, tag = spec.split()
    pid = _fork_helper(resource, tag)

    def reap() -> None:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # reaped by the pool's own waitpid
            pass

    threading.Thread(target=reap, name="e2e-reap-helper", daemon=True).start()


signals.worker_ready.connect(_fork_main_helper, weak=False)


def _record_threads(sender: Any = None, **_: Any) -> None:
    """``worker_shutdown`` (main process, after the locks were released), if
    ``E2E_RECORD_THREADS`` is set: the names of the threads still alive, as a
    JSON list in ``e2e:threads-at-exit:<node name>``."""
    if not os.environ.get("E2E_RECORD_THREADS"):
        return
    names = sorted(t.name for t in threading.enumerate() if t.is_alive())
    data().rpush(f"e2e:threads-at-exit:{getattr(sender, 'hostname', '?')}", json.dumps(names))


signals.worker_shutdown.connect(_record_threads, weak=False)

unique_hold = unique_tasks.define(app, data)
unique_defer = unique_tasks.define_deferred(app, data)

# -- deferred tasks (on_busy="defer", docs/defer.md) ---------------------------


def _wait_go(r: redis.Redis, tag: str) -> None:
    """Block until ``e2e:go:<tag>`` (at most ``HOLD_LIMIT``), in short BLPOPs: one
    long BLPOP would end at the client's socket timeout (5 s by default in
    redis-py 8), not at the go signal."""
    deadline = time.monotonic() + HOLD_LIMIT
    while time.monotonic() < deadline:
        if r.blpop([f"e2e:go:{tag}"], timeout=0.5):
            return


@app.task(name="e2e.dhold", bind=True, acks_late=True)
@locked("res:{res}", on_busy="defer")
def dhold(self: Any, res: str, tag: str) -> dict[str, Any]:
    """Like ``hold``, deferred when busy: holds ``res:<res>`` until ``e2e:go:<tag>``."""
    r = data()
    info = _lease_info()
    info["attempt"] = int(r.incr(f"e2e:attempts:{tag}"))
    r.rpush(f"e2e:held-log:{tag}", json.dumps(info))
    r.rpush(f"e2e:order:{res}", tag)
    _wait_go(r, tag)
    r.rpush(f"e2e:done:{tag}", json.dumps(info))
    return info


def _ordered_write(task: str, res: str, tag: str, pause: float = 0.0) -> dict[str, Any]:
    """Count a run of ``tag`` and append it to ``e2e:order:<res>`` (``pause``
    seconds inside); a second body inside on ``res`` is a violation."""
    r = data()
    if r.incr(f"e2e:inside:w:{res}") != 1:
        r.rpush("e2e:violations", f"{task} {res} {tag}")
    try:
        r.incr(f"e2e:runs:{tag}")
        r.rpush(f"e2e:order:{res}", tag)
        if pause:
            time.sleep(pause)
        return _lease_info()
    finally:
        r.decr(f"e2e:inside:w:{res}")


@app.task(name="e2e.dwrite", bind=True, acks_late=True)
@locked("res:{res}", on_busy="defer")
def dwrite(self: Any, res: str, tag: str, pause: float = 0.0) -> dict[str, Any]:
    """Deferred when busy: appends ``tag`` to ``e2e:order:<res>`` (and counts runs)."""
    return _ordered_write("dwrite", res, tag, pause)


@app.task(name="e2e.dshort1", bind=True, acks_late=True)
@locked("res:{res}", on_busy="defer", timeout=1)
def dshort1(self: Any, res: str, tag: str) -> dict[str, Any]:
    """Deferred when busy for at most 1 s (then it fails with LockTimeout)."""
    data().incr(f"e2e:runs:{tag}")
    return _lease_info()


@app.task(name="e2e.wwrite", bind=True, acks_late=True)
@locked("res:{res}", on_busy="wait", timeout=120)
def wwrite(self: Any, res: str, tag: str) -> dict[str, Any]:
    """Waits when busy (holding its pool slot): appends ``tag`` to ``e2e:order:<res>``."""
    return _ordered_write("wwrite", res, tag)


@app.task(name="e2e.dreenter", bind=True, acks_late=True)
@locked("res:{res}", on_busy="defer")
def dreenter(self: Any, res: str, tag: str) -> dict[str, Any]:
    """Deferred when busy; its body re-enters ``res:<res>`` through another
    ``@locked`` function (which would time out if it queued behind the
    task's own grant), logs its lease, then waits for ``e2e:go:<tag>``."""
    outer = current_lease()
    inner = _inner_locked_briefly(res)
    info = {
        "outer_fence": outer.fencing_token if outer else None,
        "token": outer.token if outer else None,
        **inner,
    }
    r = data()
    r.rpush(f"e2e:held-log:{tag}", json.dumps(info))
    _wait_go(r, tag)
    return info


@app.task(name="e2e.dretry", bind=True, acks_late=True, max_retries=5)
@locked("res:{res}", on_busy="defer")
def dretry(self: Any, res: str, tag: str, retries: int = 1, countdown: float = 0.0) -> int:
    """Deferred when busy; retries (``self.retry``) until its ``retries``-th
    retry runs. Logs each attempt (``request.retries``) to ``e2e:attempts-log:<tag>``
    and appends ``tag`` to ``e2e:order:<res>``."""
    r = data()
    r.incr(f"e2e:runs:{tag}")
    r.rpush(f"e2e:attempts-log:{tag}", self.request.retries)
    r.rpush(f"e2e:order:{res}", tag)
    if self.request.retries < retries:
        raise self.retry(countdown=countdown)
    return int(self.request.retries)


@locked("res:{res}", timeout=5)
def _inner_locked_briefly(res: str) -> dict[str, Any]:
    lease = current_lease()
    return {"inner_fence": lease.fencing_token if lease else None}


@app.task(name="e2e.dshort", bind=True, acks_late=True)
@locked("res:{res}", on_busy="defer", timeout=2)
def dshort(self: Any, res: str, tag: str) -> str:
    """Deferred when busy, parked 2 s at most (then it fails with LockTimeout)."""
    data().incr(f"e2e:runs:{tag}")
    return tag


@app.task(name="e2e.derrback")
def derrback(request: Any, exc: BaseException, traceback: Any) -> None:
    """An errback taking (request, exc, traceback): records the failed task's id,
    the exception's type and where it ran in ``e2e:errback:<task id>``."""
    record = {"kind": "request", "exc": type(exc).__name__, "pid": os.getpid()}
    data().rpush(f"e2e:errback:{request.id}", json.dumps(record))


@app.task(name="e2e.derrback_id")
def derrback_id(task_id: str) -> None:
    """An errback taking the failed task's id only (sent as a task of its own)."""
    data().rpush(f"e2e:errback:{task_id}", json.dumps({"kind": "id", "pid": os.getpid()}))


def _note_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """``task_revoked``: ``e2e:revoked-signal:<task id>`` records ``expired``."""
    task_id = getattr(request, "id", None)
    if task_id:
        data().rpush(f"e2e:revoked-signal:{task_id}", json.dumps({"expired": bool(expired)}))


signals.task_revoked.connect(_note_revoked, weak=False)


def _kill_before_adopt(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """``task_prerun`` in the pool child: a re-dispatched deferred task whose id
    the test marked (``e2e:kill-before-adopt:<id>`` = ``child`` or ``worker``)
    is SIGKILLed before it adopts its grant (the child alone, or the whole
    worker's process group). One shot: the marker is deleted first."""
    request = getattr(sender, "request", None)
    if request is None or getattr(request, "redislock_defer", None) is None:
        return
    how = data().getdel(f"e2e:kill-before-adopt:{task_id}")
    if how == "child":
        os.kill(os.getpid(), 9)
    elif how == "worker":
        os.killpg(os.getpgid(0), 9)


signals.task_prerun.connect(_kill_before_adopt, weak=False)

_engine_adopt = LockManager.adopt


def _adopt_then_maybe_stall(self: LockManager, task_id: str, *args: Any, **kwargs: Any) -> Any:
    """:meth:`LockManager.adopt`, then, for a task id the test marked
    (``e2e:stall-after-adopt:<id>``), a stall: the process writes its pid to
    ``e2e:stalled:<id>`` and stops itself (SIGSTOP) right after the engine's
    adoption returned, before anything else of the task runs; the test
    resumes it (SIGCONT). One shot: the marker is deleted first."""
    adoption = _engine_adopt(self, task_id, *args, **kwargs)
    if adoption.adopted and data().getdel(f"e2e:stall-after-adopt:{task_id}"):
        data().set(f"e2e:stalled:{task_id}", os.getpid())
        os.kill(os.getpid(), signal.SIGSTOP)
    return adoption


LockManager.adopt = _adopt_then_maybe_stall  # type: ignore[method-assign]

_backend_mark_as_done = Backend.mark_as_done


def _stop_before_store(self: Backend, task_id: str, *args: Any, **kwargs: Any) -> Any:
    """The result backend's ``mark_as_done``, which Celery calls after the
    function returned, to store its result; first, for a re-dispatched
    deferred task whose id the test marked (``e2e:stop-before-store:<id>``),
    a stop: the pool child writes its pid to ``e2e:stopped:<id>`` and stops
    itself (SIGSTOP) before the result is stored; the test kills it. One
    shot: the marker is deleted first."""
    request = kwargs.get("request", args[1] if len(args) > 1 else None)
    if getattr(request, "redislock_defer", None) is not None and data().getdel(
        f"e2e:stop-before-store:{task_id}"
    ):
        data().set(f"e2e:stopped:{task_id}", os.getpid())
        os.kill(os.getpid(), signal.SIGSTOP)
    return _backend_mark_as_done(self, task_id, *args, **kwargs)


Backend.mark_as_done = _stop_before_store  # type: ignore[method-assign]


# -- limited resources (@locked(limited=...), tests/e2e/test_limited_e2e.py) ---

#: Counts a body in on ``e2e:lim-in:<partner>`` and keeps the most seen at
#: once in ``e2e:lim-peak:<partner>``, in one step.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def _limited_body(task: Any, partner: str, tag: str, block: bool, pause: float) -> dict[str, Any]:
    """A body holding one slot of ``api:<partner>``: counted in and out
    (peak), logged to ``e2e:held-log:<tag>`` (with its lease's limits) and
    appended to ``e2e:order:<partner>``; a first delivery with ``block``
    waits for ``e2e:go:<tag>``, else it stays ``pause`` seconds."""
    r = data()
    attempt = int(r.incr(f"e2e:attempts:{tag}"))
    r.eval(_ENTER, 2, f"e2e:lim-in:{partner}", f"e2e:lim-peak:{partner}")
    try:
        lease = current_lease()
        info = _lease_info()
        info.update(
            attempt=attempt,
            tag=tag,
            task_id=task.request.id,
            limited=lease.limited if lease is not None else None,
        )
        r.rpush(f"e2e:held-log:{tag}", json.dumps(info))
        r.rpush(f"e2e:order:{partner}", tag)
        if block and attempt == 1:
            _wait_go(r, tag)
        elif pause:
            time.sleep(pause)
        return info
    finally:
        r.decr(f"e2e:lim-in:{partner}")


def _limited_task(name: str, doc: str, *, task_options: Any = None, **locked_options: Any) -> Any:
    """The task ``e2e.<name>``: :func:`_limited_body` under
    ``@locked(limited={"api:{partner}": 2}, **locked_options)``."""

    def body(
        self: Any, partner: str, tag: str, block: bool = False, pause: float = 0.0
    ) -> dict[str, Any]:
        return _limited_body(self, partner, tag, block, pause)

    body.__name__ = body.__qualname__ = name  # @locked's label in the log lines
    body.__doc__ = doc
    locked_body = locked(limited={"api:{partner}": 2}, **locked_options)(body)
    return app.task(name=f"e2e.{name}", bind=True, acks_late=True, **(task_options or {}))(
        locked_body
    )


lim_wait = _limited_task(
    "lim_wait",
    "At most 2 at once on ``api:<partner>``, waiting in its pool slot.",
    on_busy="wait",
    timeout=120,
)
lim_defer = _limited_task(
    "lim_defer",
    "At most 2 at once on ``api:<partner>``, parked (no pool slot) when full.",
    on_busy="defer",
)
lim_raise = _limited_task(
    "lim_raise",
    "At most 2 at once on ``api:<partner>``; LockTimeout when full.",
    on_busy="raise",
    on_lost="ignore",
)
lim_skip = _limited_task(
    "lim_skip",
    "At most 2 at once on ``api:<partner>``; skipped (None) when full.",
    on_busy="skip",
    on_lost="terminate",
)
lim_retry = _limited_task(
    "lim_retry",
    "At most 2 at once on ``api:<partner>``; retried every 0.2 s when full.",
    task_options={"max_retries": None},
    on_busy="retry",
    retry_countdown=0.2,
    retry_backoff=1,
    retry_jitter=False,
)


# -- the head-of-line benchmark (benchmarks/defer.py) -------------------------


def _bench_body(res: str, tag: str, seconds: float) -> float:
    time.sleep(seconds)
    now = time.time()
    data().rpush("e2e:bench-finish", json.dumps({"tag": tag, "res": res, "at": now}))
    return now


@app.task(name="e2e.bench_defer", bind=True, acks_late=True)
@locked("bench:{res}", on_busy="defer")
def bench_defer(self: Any, res: str, tag: str, seconds: float) -> float:
    """Benchmark task, deferred when busy."""
    return _bench_body(res, tag, seconds)


@app.task(name="e2e.bench_wait", bind=True, acks_late=True)
@locked("bench:{res}", on_busy="wait", timeout=300)
def bench_wait(self: Any, res: str, tag: str, seconds: float) -> float:
    """Benchmark task, waiting in its pool slot when busy."""
    return _bench_body(res, tag, seconds)


def _bench_span(res: str, tag: str, seconds: float) -> float:
    """A benchmark body that records when it started too (``start``)."""
    start = time.time()
    time.sleep(seconds)
    now = time.time()
    entry = {"tag": tag, "res": res, "start": start, "at": now}
    data().rpush("e2e:bench-finish", json.dumps(entry))
    return now


@app.task(name="e2e.bench_limited_defer", bind=True, acks_late=True)
@locked(limited={"bench:api:{partner}": 3}, on_busy="defer")
def bench_limited_defer(self: Any, partner: str, tag: str, seconds: float) -> float:
    """Benchmark task (benchmarks/limited_celery.py): at most 3 at once on a
    partner, parked without a pool slot when full."""
    return _bench_span(partner, tag, seconds)


@app.task(name="e2e.bench_limited_wait", bind=True, acks_late=True)
@locked(limited={"bench:api:{partner}": 3}, on_busy="wait", timeout=300)
def bench_limited_wait(self: Any, partner: str, tag: str, seconds: float) -> float:
    """Benchmark task (benchmarks/limited_celery.py): at most 3 at once on a
    partner, waiting in its pool slot when full."""
    return _bench_span(partner, tag, seconds)


@app.task(name="e2e.bench_plain", bind=True, acks_late=True)
def bench_plain(self: Any, tag: str, seconds: float) -> float:
    """Benchmark task (benchmarks/limited_celery.py): no lock."""
    return _bench_span("-", tag, seconds)


@app.task(name="e2e.bench_retry", bind=True, acks_late=True, max_retries=None)
@locked("bench:{res}", on_busy="retry", retry_countdown=0.2, retry_backoff=1.5)
def bench_retry(self: Any, res: str, tag: str, seconds: float) -> float:
    """Benchmark task, retried later (leaving the line) when busy."""
    return _bench_body(res, tag, seconds)
