"""``@locked``: lock a task's resources while its body runs.

Place it directly above the function, under ``@app.task``, so that it wraps
the function Celery runs (the other order raises TypeError at import)::

    @app.task(bind=True, acks_late=True)
    @locked("repo:{repo_id}", shared=["remote:{remote_id}"], timeout=30)
    def sync(self, repo_id, remote_id):
        lease = current_lease()          # fencing token, lost flag, contenders
        ...

The lock owner is the worker process (its owner id), never the task id: a
task redelivered after a worker loss is a new request, not the old holder.
Only ``on_busy="defer"`` waits as a task owner (``defer:<task id>``) while the
task is parked, until the process that runs it adopts the grant
(docs/defer.md).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import math
import os
import random
import signal
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from . import _validate as _v
from . import guard
from .app import RedisLock
from .exceptions import (
    ConfigurationError,
    LockError,
    LockLost,
    LockTimeout,
    ReplicationTimeout,
    ShuttingDown,
)
from .lease import Lease
from .manager import RequestMoved
from .settings import APP_DEFAULT, ON_BUSY_MODES, ON_LOST_MODES
from .templates import (
    ArgumentBinder,
    check_fields,
    check_templates,
    format_all,
    holder_info,
    holder_record,
    template_list,
)
from .templates import TemplateError as TemplateError  # importable from here, as before

log = logging.getLogger("celery_redislock.task")

F = TypeVar("F", bound=Callable[..., Any])

_leases: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
    "celery_redislock_leases", default=()
)


def current_lease() -> Lease | None:
    """The innermost lease taken by ``@locked`` in this thread or greenlet.

    Returns None outside a ``@locked`` body. The lease gives the fencing token
    (``lease.fencing_token``), whether it was lost (``lease.lost``,
    ``lease.check()``) and how many requests wait for it (``lease.contenders()``).
    """
    stack = _leases.get()
    return stack[-1] if stack else None


def _number(name: str, value: Any, low: float, what: str) -> None:
    """Refuse a non-number, NaN, infinity, a number too large for a float
    (``10**400``: a message, not an OverflowError) or a value below ``low``."""
    try:
        _v.seconds(name, value, minimum=low)
    except ConfigurationError:
        shown = (
            f"a {value.bit_length()}-bit int"
            if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64
            else repr(value)
        )
        raise ConfigurationError(name, f"must be {what}, not {shown}") from None


#: What @locked says when it is given a task instead of the function.
ORDER_HELP = (
    "@locked must be placed directly above the function, under @app.task "
    "(or @shared_task), so that it wraps the function the worker runs:\n"
    "    @app.task(bind=True)\n"
    "    @locked('repo:{repo_id}')\n"
    "    def sync(self, repo_id): ...\n"
    "Placed above @app.task it would leave the registered task unlocked."
)


def _check_target(fun: Any) -> None:
    """Refuse what is not a plain function, notably a Celery task.

    ``app.task`` returns a lazy proxy while the app is not finalized. It is
    recognised by ``type()``, which does not evaluate it: ``isinstance()``
    or any attribute access would create the task there and then, before
    the app's configuration is complete.
    """
    from celery.app.task import Task
    from celery.local import Proxy

    if issubclass(type(fun), Proxy):
        raise TypeError(f"@locked was given a Celery task proxy, not a function. {ORDER_HELP}")
    if isinstance(fun, Task):
        name = getattr(fun, "name", None) or type(fun).__name__
        raise TypeError(f"@locked was given the Celery task {name!r}, not a function. {ORDER_HELP}")
    if isinstance(fun, type) and issubclass(fun, Task):
        raise TypeError(
            f"@locked was given the Task class {fun.__qualname__}, not a function: "
            f"decorate its run method instead (@locked(...) above def run(self, ...)), "
            f"or use the function form. {ORDER_HELP}"
        )
    if isinstance(fun, type) or not callable(fun):
        raise TypeError(f"@locked decorates a function, not {fun!r}")


def _retry_deferred(mgr: Any) -> None:
    """Retry releases the engine deferred (Redis was down at release time).

    A worker's pool children run without the engine's own heartbeat (the
    main process refreshes their liveness), so nothing else would retry
    them; one extra round trip, only when something is pending.
    """
    try:
        mgr.upkeep()
    except Exception as exc:
        log.warning("locked.deferred-release-error error=%r", exc)


def _hand_back(task: Any, label: str, exc: ShuttingDown) -> None:
    """The worker shuts down while the task waits: give its message back.

    With ``acks_late`` the message is rejected with requeue (the broker
    redelivers it, retries not counted); otherwise it was acked on receipt,
    so ``task.retry()`` publishes it again (counted as a retry). The body
    never runs in this worker. Outside a worker, ShuttingDown propagates.
    """
    request = getattr(task, "request", None) if task is not None else None
    if request is None or getattr(request, "called_directly", True):
        return
    acks_late = getattr(request, "acks_late", None)
    if acks_late is None:
        acks_late = bool(getattr(task, "acks_late", False))
    how = "requeue" if acks_late else "retry"
    log.warning(
        "locked.shutdown task=%s id=%s resources=%s: the worker is shutting down; "
        "handing the task back to the broker (%s)",
        label,
        getattr(request, "id", "?"),
        ",".join(exc.resources),
        how,
    )
    if acks_late:
        from celery.exceptions import Reject

        raise Reject(exc, requeue=True) from exc
    raise task.retry(countdown=0, exc=exc) from exc


class _LossWatch:
    """What ``@locked`` does when its lease is marked lost while the body runs.

    ``on_lost="terminate"`` in a prefork pool child: log ``locked.lost`` and
    SIGKILL the child at once (as a hard time limit does); the pool reports
    WorkerLostError and, with ``acks_late`` and
    ``task_reject_on_worker_lost``, the broker redelivers the task. In any
    other process (threads, solo, gevent, eventlet pools: the body runs in
    the worker's main process) nothing is killed: the task fails as with
    ``"fail"`` once the body returns.
    """

    def __init__(self, label: str, task_id: str, mode: str, child_pid: int) -> None:
        self.label = label
        self.task_id = task_id
        self.mode = mode
        self.child_pid = child_pid
        self.active = True
        self.reported = False

    def __call__(self, lease: Lease, cause: str | None) -> None:
        if not self.active or self.mode != "terminate" or os.getpid() != self.child_pid:
            return
        self.reported = True
        log.error(
            'locked.lost task=%s id=%s resources=%s fence=%d cause="%s" on_lost=terminate: '
            "killing this pool child (pid %d) now; with acks_late and "
            "task_reject_on_worker_lost the broker redelivers the task",
            self.label,
            self.task_id,
            ",".join(lease.resources),
            lease.fencing_token,
            cause or "unknown",
            os.getpid(),
        )
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:
                pass
        os.kill(os.getpid(), signal.SIGKILL)


def _lost_after_body(lease: Lease, label: str, task_id: str, mode: str, pool_child: bool) -> None:
    """The body returned under a lost lease: fail the task, or only log."""
    cause = lease.lost_cause or "unknown"
    if mode == "ignore":
        log.warning(
            'locked.lost task=%s id=%s resources=%s fence=%d cause="%s" on_lost=ignore: '
            "the lock was lost while the body ran; its result stands",
            label,
            task_id,
            ",".join(lease.resources),
            lease.fencing_token,
            cause,
        )
        return
    fallback = ""
    if mode == "terminate" and pool_child:
        fallback = " (terminate: the loss was found only as the body returned; failing instead)"
    elif mode == "terminate":
        fallback = " (terminate: no pool child to kill in this pool; failing instead)"
    log.error(
        'locked.lost task=%s id=%s resources=%s fence=%d cause="%s" on_lost=%s: the lock was '
        "lost while the body ran; failing the task with LockLost%s",
        label,
        task_id,
        ",".join(lease.resources),
        lease.fencing_token,
        cause,
        mode,
        fallback,
    )
    raise LockLost(lease.resources, lease.owner_id, lease.fencing_token, lease.lost_cause)


def _shown(on_busy: Any) -> str:
    return "the app default" if on_busy is APP_DEFAULT else repr(on_busy)


@dataclass
class _BodyRun:
    """How ``@locked`` runs its body once it holds the lease: ``on_lost``
    (:class:`_LossWatch`, :func:`_lost_after_body`) and the holder record of
    the acquires the body makes (``holder``: set as the thread's holder while
    the body runs, None to leave the thread's holder as it is)."""

    mgr: Any
    label: str
    task_label: str
    task_id: str
    lost_mode: str
    in_task: bool
    pool_child_pid: int
    holder: str | None


def _holding(mgr: Any, holder: str | None) -> AbstractContextManager[Any]:
    """The block's acquires record ``holder`` (None: keep the thread's own)."""
    return mgr.context.using(holder=holder) if holder is not None else nullcontext()


def _run_body(
    lease: Lease,
    run: _BodyRun,
    fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    after: Callable[[], None] | None = None,
) -> Any:
    """Run the body holding ``lease``; release it however the body ends,
    then ``after``; a lease lost meanwhile is handled as ``on_lost`` says."""
    mgr = run.mgr
    token = _leases.set(_leases.get() + (lease,))
    watch = _LossWatch(run.task_label, run.task_id, run.lost_mode, run.pool_child_pid)
    if run.lost_mode == "terminate" and run.in_task:
        lease.add_lost_hook(watch)
    lost_after = False
    try:
        with _holding(mgr, run.holder):
            try:
                result = fun(*args, **kwargs)
            except BaseException:
                watch.active = False
                if lease.lost:
                    log.error(
                        'locked.lost task=%s id=%s resources=%s cause="%s": the lock was '
                        "lost while the body ran (the body raised as well)",
                        run.task_label,
                        run.task_id,
                        ",".join(lease.resources),
                        lease.lost_cause or "unknown",
                    )
                raise
            watch.active = False
            # Read before the release: a loss seen only by the local
            # deadline (a long pause) is not looked for once released.
            lost_after = lease.lost
    finally:
        watch.active = False
        _leases.reset(token)
        try:
            lease.release()
        except LockError as exc:  # the engine retries a deferred release
            log.error(
                "locked.release-error task=%s resources=%s error=%r",
                run.label,
                ",".join(lease.resources),
                exc,
            )
        if after is not None:
            after()
    # The release itself may be the first to learn of a loss: it released
    # fewer locks than the lease held (Redis lost a grant in a failover, or
    # a cleanup took it before the notice reached this process).
    lost_after = lost_after or lease.lost
    if lost_after:
        _lost_after_body(
            lease,
            run.task_label,
            run.task_id,
            run.lost_mode,
            run.pool_child_pid == os.getpid(),
        )
    return result


def _deferrable(task: Any) -> bool:
    """Whether the call is a task run by a worker (defer needs a message to park)."""
    request = getattr(task, "request", None) if task is not None else None
    return bool(
        request is not None
        and not getattr(request, "called_directly", True)
        and getattr(request, "id", None)
        and not getattr(request, "is_eager", False)
    )


def _grant_header(request: Any) -> tuple[int, int] | None:
    """``(life, fence)`` of the grant a re-dispatched deferred task carries, or None.

    The header is taken off the request's ``headers`` as it is read: Celery's
    ``self.retry()`` copies them into the retry's message, and a retry is a
    new life of the task (a new arrival), not a copy of the grant's message.
    (The request attribute of the same name stays, for the body to read.)
    """
    from .defer import HEADER, PARKED_AT_HEADER, parse_header

    value = getattr(request, HEADER, None)
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        found = headers.pop(HEADER, None)
        headers.pop(PARKED_AT_HEADER, None)  # the grant's, not a retry's
        value = found if value is None else value
    return parse_header(value)


def _header_value(request: Any) -> Any:
    """The raw ``redislock_defer`` header of ``request`` (None if absent)."""
    from .defer import HEADER

    value = getattr(request, HEADER, None)
    if value is None:
        headers = getattr(request, "headers", None) or {}
        value = headers.get(HEADER) if isinstance(headers, dict) else None
    return value.decode() if isinstance(value, bytes) else value


def _send_guard(
    locks: RedisLock, task_id: str, message: dict[str, Any], life: int, guarded: bool
) -> None:
    """Publish the guard of a parked task (docs/defer.md, D12), if guards are on."""
    interval = locks.config.defer_guard_interval
    if not guarded or not interval:
        return
    try:
        guard.send_guard(locks.app, task_id, message, interval, life=life)
    except Exception as exc:  # still parked; only unprotected against a lock-Redis loss
        log.error(
            "defer.guard-error id=%s error=%r: no guard was sent; this parked task is "
            "lost if the lock Redis loses its data",
            task_id,
            exc,
        )


def _attempt(task: Any) -> int:
    """The retry number of ``task``'s current request (0 for the first run)."""
    try:
        return int(getattr(getattr(task, "request", None), "retries", 0) or 0)
    except (TypeError, ValueError):
        return 0


def _redelivered(request: Any) -> bool:
    """Whether the broker delivered ``request``'s message before (kombu marks a
    message it restores after its consumer died ``redelivered``)."""
    info = getattr(request, "delivery_info", None) or {}
    return bool(isinstance(info, dict) and info.get("redelivered"))


def _parked_at(request: Any) -> float | None:
    """When a re-dispatched deferred task parked (its header), or None."""
    from .defer import PARKED_AT_HEADER, parse_parked_at

    value = getattr(request, PARKED_AT_HEADER, None)
    if value is None:
        headers = getattr(request, "headers", None) or {}
        value = headers.get(PARKED_AT_HEADER) if isinstance(headers, dict) else None
    return parse_parked_at(value)


@dataclass
class DeferHooks:
    """What a Task base (``UniqueTask``) asks ``on_busy="defer"`` to tell it
    about one run of a task (:func:`defer_hooks`).

    ``before_body()``: the locks are held and the body is about to run (in
    every path: taken at once, adopted, granted at park, or waited for).
    ``parked(seconds)``: the task was parked and its message stored; it may
    stay parked (and then in transit) for up to ``seconds``.
    ``dropped()``: this copy of the message was dropped as a duplicate
    (another copy of the task is in line, running or done).
    """

    before_body: Callable[[], None]
    parked: Callable[[float], None]
    dropped: Callable[[], None]


#: The hooks of each task run in this thread or greenlet (task id -> hooks).
_hooks: contextvars.ContextVar[tuple[tuple[str, DeferHooks], ...]] = contextvars.ContextVar(
    "celery_redislock_defer_hooks", default=()
)


def defer_hooks(task_id: str, hooks: DeferHooks) -> contextvars.Token[Any]:
    """Install ``hooks`` for the run of task ``task_id`` in this context;
    give the token back to :func:`reset_defer_hooks` when the run ends."""
    return _hooks.set((*_hooks.get(), (task_id, hooks)))


def reset_defer_hooks(token: contextvars.Token[Any]) -> None:
    """Remove hooks installed by :func:`defer_hooks`."""
    _hooks.reset(token)


def _hooks_of(task_id: str) -> DeferHooks | None:
    for tid, hooks in reversed(_hooks.get()):
        if tid == task_id:
            return hooks
    return None


def _task_hooks(task: Any) -> DeferHooks | None:
    """The hooks installed for the task run ``task`` is in, or None."""
    if not _hooks.get() or task is None:
        return None
    task_id = getattr(getattr(task, "request", None), "id", None)
    return _hooks_of(str(task_id)) if task_id else None


def _after_hook(fun: Callable[..., Any], hook: Callable[[], None]) -> Callable[..., Any]:
    """``fun`` preceded by ``hook``, inside the body run: the locks the body
    holds are released however either ends."""

    def body(*args: Any, **kwargs: Any) -> Any:
        hook()
        return fun(*args, **kwargs)

    return body


def defers(task: Any, fun: Any) -> bool:
    """Whether ``task``'s run ``fun`` is an ``@locked`` wrapper that takes
    the deferred path for this request (``on_busy="defer"``, its own or the
    app's default, and a request a worker runs)."""
    spec = getattr(fun, "__redislock__", None)
    if not isinstance(spec, dict) or not _deferrable(task):
        return False
    mode = spec.get("on_busy")
    if mode is None:
        mode = RedisLock.for_task(task).config.default_on_busy
    return bool(mode == "defer")


def _carries_grant(task: Any) -> bool:
    """Whether the task's message carries a deferred grant's header."""
    request = getattr(task, "request", None) if task is not None else None
    return request is not None and _grant_header(request) is not None


def _transit_hook(
    task: Any, locks: RedisLock, label: str, wait: float | None, parked: list[Any]
) -> Callable[[str, Any], bool]:
    """The ``park_behind_transit`` hook of an ``on_busy="wait"`` task's own
    wait (docs/defer.md, "Waiting tasks behind a grant in transit", T3).

    Called by :meth:`LockManager.acquire` with the queued request's token
    when a grant in transit waits ahead of it: parks the task in the
    request's place (:func:`defer.take_over`) and returns True, the result
    appended to ``parked``; returns False to go on waiting (the request is
    no longer queued, a finished record holds the task, the timeout is
    spent, or the arguments do not survive JSON). A copy of a task that is
    parked, in transit or running elsewhere raises ``Ignore`` (dropped).
    """
    from . import defer

    started = time.monotonic()
    cfg = locks.config
    task_id = str(task.request.id)
    guarded = guard.enabled(locks.app, cfg.defer_guard_interval)

    def hook(token: str, req: Any) -> bool:
        park_ttl = cfg.defer_ttl if wait is None else wait - (time.monotonic() - started)
        try:
            message = defer.capture_message(task)
            left = defer.expires_in(message["options"].get("expires"))
            if left is not None:
                park_ttl = min(park_ttl, left)
            if park_ttl <= 0.001:
                return False
            # What a park record's message holds (as _run_deferred builds it).
            message["modes"] = req.modes
            message["resources"] = list(req.resources)
            message["park_ttl"] = park_ttl
            message["grant_ttl"] = cfg.defer_grant_ttl
            result = defer.take_over(
                locks.manager,
                task_id,
                token,
                req,
                message,
                park_ttl=park_ttl,
                grant_ttl=cfg.defer_grant_ttl,
                label=f"{task.name} {task_id}",
                holder=holder_info(task, label, locks.nodename),
            )
        except (TypeError, ValueError) as exc:
            log.info(
                "locked.wait-not-parked task=%s id=%s error=%r: waiting in the pool slot",
                label,
                task_id,
                exc,
            )
            return False
        if result.outcome == "duplicate" and result.state != "done":
            _drop_duplicate(
                task, locks, label, task_id, result.state, list(req.resources), message, guarded
            )
        if result.outcome not in ("parked", "granted"):
            return False
        parked.append((result, message))
        return True

    return hook


def _drop_duplicate(
    task: Any,
    locks: RedisLock,
    label: str,
    task_id: str,
    state: str,
    resources: list[str],
    message: dict[str, Any],
    guarded: bool,
) -> NoReturn:
    """A park record already holds the task: drop this copy (Celery's ``Ignore``).

    The parking child may have died before it sent the guard (D2, D3): a
    record still parked or granted gets a spare guard, which ends at its
    first check if another one watches."""
    from celery.exceptions import Ignore

    log.warning(
        "defer.duplicate task=%s id=%s state=%s: this task is already deferred; dropping this copy",
        label,
        task_id,
        state,
    )
    if guarded and state in ("parked", "granted"):
        _store_deferred(task, task_id, resources)
        _send_guard(locks, task_id, message, 0, guarded)
    raise Ignore()


def _deferred_body_run(
    task: Any, locks: RedisLock, label: str, task_id: str, lost_mode: str
) -> _BodyRun:
    """How a deferred task's adopted body runs: the body's own acquires carry
    this task's holder record, unless an outer ``@locked`` already set one."""
    mgr = locks.manager
    holder = holder_info(task, label, locks.nodename)
    return _BodyRun(
        mgr,
        label,
        str(getattr(task, "name", None) or label),
        task_id,
        lost_mode,
        True,
        locks.pool_child_pid,
        holder if mgr.context.current().holder is None else None,
    )


def _parked_behind_transit(
    task: Any,
    locks: RedisLock,
    label: str,
    resources: list[str],
    lost_mode: str,
    fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    parked: tuple[Any, dict[str, Any]],
    moved: RequestMoved,
) -> Any:
    """The wait was parked in its place (:func:`_transit_hook`): run the
    body with the grant adopted at once, or free the pool slot, as a parked
    task does (``DEFERRED``, its guard, ``Ignore``)."""
    from celery.exceptions import Ignore

    result, message = parked
    guarded = guard.enabled(locks.app, locks.config.defer_guard_interval)
    mgr = locks.manager
    task_id = str(task.request.id)
    log.info(
        "locked.wait-parked task=%s id=%s resources=%s behind=%s: a grant in transit "
        "waits for a pool slot; parked in this task's place in line",
        label,
        task_id,
        ",".join(resources),
        moved.behind or "-",
    )
    if result.outcome == "granted":
        run = _deferred_body_run(task, locks, label, task_id, lost_mode)
        leases = result.leases

        def mark() -> None:  # done once the result is stored, as _run_deferred's
            _mark_done_after_store(task, mgr, task_id, leases[0].owner_id)

        if guarded:  # a guard that later finds no record must not recover a started task
            guard.mark_adopted(locks.app, task_id, result.life, _attempt(task))
        return _run_adopted(leases, resources, run, fun, args, kwargs, mark)
    _store_deferred(task, task_id, resources)
    _send_guard(locks, task_id, message, result.life, guarded)
    raise Ignore()


def _run_adopted(
    leases: list[Lease],
    resources: list[str],
    run: _BodyRun,
    fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    after: Callable[[], None],
) -> Any:
    """Run the body with adopted grants: the one for ``resources`` is the
    task's lease (``current_lease()``); any other grant of the task owner is
    released with it. The grants count as held by this thread, so the body's
    nested acquires of their resources re-enter them."""
    main = next((x for x in leases if set(x.resources) == set(resources)), leases[0])
    rest = [x for x in leases if x is not main]
    run.mgr.hold_in_thread(leases)

    def finish() -> None:
        for lease in rest:
            try:
                lease.release()
            except LockError as exc:
                log.error("locked.release-error task=%s error=%r", run.label, exc)
        after()

    return _run_body(main, run, fun, args, kwargs, finish)


#: Park records this process marks ``done`` once Celery has stored the
#: result of the task run that adopted them: task id -> (the run's request,
#: the mark). Filled when an adopted body ends, emptied by
#: :func:`deferred_run_ended` (``task_postrun``).
_done_after_store: dict[str, tuple[Any, Callable[[], None]]] = {}


def _mark_done_after_store(task: Any, mgr: Any, task_id: str, owner: str) -> None:
    """Mark the park record ``done`` when this run's result is stored.

    Celery stores the result after the function returns, then sends
    ``task_postrun``: marking the record in between would let a kill
    before the store leave a ``done`` record and no result (the
    redelivered copy dropped as a duplicate, the state ``DEFERRED`` for
    ever). Until the mark, the record stays ``adopted`` by this process,
    so a copy redelivered after its death runs again (docs/defer.md, D8).
    """

    from .defer import mark_done

    def mark() -> None:
        try:
            mark_done(mgr, task_id, owner)
        except Exception as exc:  # the record expires on its own
            log.warning("defer.done-error id=%s error=%r", task_id, exc)

    _done_after_store[task_id] = (getattr(task, "request", None), mark)


def deferred_run_ended(task: Any, task_id: Any, state: Any) -> None:
    """``task_postrun`` (connected by :class:`RedisLock`): a deferred task's
    run that adopted its grant has ended and Celery has stored its result
    (or, with ``ignore_result``, stored nothing): mark its park record
    ``done`` now, so that a stale copy of its message is dropped.

    ``state`` None (the body ended with a BaseException such as
    ``SystemExit``: nothing was stored, the process is going) leaves the
    record ``adopted``: a copy redelivered after this process's death runs
    again. Only the run that registered the mark (its own request, in this
    thread or greenlet) takes it. Any other task: one dict look-up.
    """
    if not _done_after_store or task_id is None:
        return
    entry = _done_after_store.get(str(task_id))
    if entry is None or entry[0] is not getattr(task, "request", None):
        return
    _done_after_store.pop(str(task_id), None)
    if state is not None:
        entry[1]()


def _run_deferred(
    task: Any,
    locks: RedisLock,
    label: str,
    exclusive_names: list[str],
    shared_names: list[str],
    timeout: Any,
    lost_mode: str,
    fun: Callable[..., Any],
    args: Any,
    kwargs: Any,
    hooks: DeferHooks | None = None,
) -> Any:
    """``on_busy="defer"`` (docs/defer.md): adopt a grant, run, or park and free the slot.

    ``hooks`` (a Task base's, :class:`DeferHooks`): told when the task
    parks or its copy is dropped (``fun`` already calls ``before_body``).
    """
    from celery.exceptions import Ignore

    from . import defer

    mgr = locks.manager
    cfg = locks.config
    request = task.request
    task_id = str(request.id)
    resources = exclusive_names + shared_names
    if mgr.state.deferred and not mgr.liveness.own_heartbeat:
        _retry_deferred(mgr)
    mgr._defer_done_ttl = cfg.defer_ttl  # type: ignore[attr-defined]
    # Who holds the locks, for operators: the park request, the adopted
    # grants and the body's own acquires carry this task's holder record.
    holder = holder_info(task, label, locks.nodename)
    outer_holder = mgr.context.current().holder
    run = _deferred_body_run(task, locks, label, task_id, lost_mode)

    def acquire(timeout: Any) -> Lease:
        with _holding(mgr, holder if outer_holder is None else None):
            return mgr.acquire(exclusive_names, shared_names, timeout=timeout)

    def done_marker(leases: list[Lease]) -> Callable[[], None]:
        return lambda: _mark_done_after_store(task, mgr, task_id, leases[0].owner_id)

    def replication_short(exc: ReplicationTimeout) -> None:
        # Adopted, then released again (too few replicas have it): the task
        # ends with the error, as a wait-mode task's does; a stale copy of
        # its message finds it done once the failure is stored.
        log.warning("defer.replication-short task=%s id=%s: %s", label, task_id, exc)
        _mark_done_after_store(task, mgr, task_id, mgr.owner_id)

    # Guards of parked tasks against a loss of the lock Redis's data (D12).
    guarded = guard.enabled(locks.app, cfg.defer_guard_interval)

    def adopted(life: int, via: int | None) -> None:
        if guarded:  # a guard that later finds no record must not recover a started task
            guard.mark_adopted(locks.app, task_id, life, _attempt(task), via)

    # A copy parked record-first (below): the life its grant header names
    # (None: a recovery copy or a redelivery), and the lowest life to park in.
    copy_life: int | None = None
    record_first = False
    min_life = 0
    grant = _grant_header(request)
    if grant is not None:
        life, fence = grant
        try:
            outcome, leases = defer.adopt(
                mgr, task_id, life, holder=holder, parked_at=_parked_at(request)
            )
        except ReplicationTimeout as exc:
            replication_short(exc)
            raise
        if leases:
            adopted(life, life)
            return _run_adopted(leases, resources, run, fun, args, kwargs, done_marker(leases))
        log.info(
            "defer.not-adopted task=%s id=%s life=%d fence=%d why=%s: parking this copy "
            "(dropped if the task is in line or done)",
            label,
            task_id,
            life,
            fence,
            outcome,
        )
        lease = None  # a copy of a dispatched message never tries once: park decides
        # Parked as a new arrival, it takes a life above the grant's: a later
        # loss of its record must not leave a life number the adoption
        # marker has passed already (D12).
        copy_life, record_first, min_life = life, True, life + 1
    elif _header_value(request) == guard.RECOVER:
        # An earlier release's recovery copy (D12): the park record decides,
        # as for a stale grant's copy: none makes it a new arrival, any a duplicate.
        log.info("defer.recovery-copy task=%s id=%s: parking this copy", label, task_id)
        lease, record_first = None, True
    elif _redelivered(request):
        # The broker gave the message back (its worker died before the ack):
        # the task may have parked, and even run, meanwhile (D2). The park
        # record decides, as for a recovery copy; only redeliveries pay for it.
        log.info("defer.redelivered task=%s id=%s: parking this copy", label, task_id)
        lease, record_first = None, True
    else:
        # A new arrival: try once, as on_busy="raise" does (busy is no
        # timeout for the metrics: the park says what happened).
        try:
            with mgr.context.using(parking=True):
                lease = acquire(0)
        except LockTimeout:
            lease = None
        if lease is not None:
            return _run_body(lease, run, fun, args, kwargs)
    if record_first and guarded:
        # No record at all may mean the lock Redis lost the record of a task
        # that ran or started: then the result backend says so (D12).
        stale = guard.copy_is_stale(
            locks, task_id, _attempt(task), copy_life, _redelivered(request)
        )
        if stale is not None:
            log.warning(
                "defer.stale-copy task=%s id=%s why=%s: no park record, but this task ran "
                "or started; dropping this copy",
                label,
                task_id,
                stale,
            )
            if hooks is not None:
                hooks.dropped()
            raise Ignore()
    try:
        message = defer.capture_message(task)
        park_ttl = cfg.defer_ttl if timeout is APP_DEFAULT or timeout is None else float(timeout)
        message["resources"] = resources
        message["park_ttl"] = park_ttl  # the time-out (LockTimeout's), not capped
        # Never parked past the task's own expires (then it is revoked as expired).
        park_ttl = defer.park_limit(message, park_ttl)
        message["grant_ttl"] = cfg.defer_grant_ttl
        req = mgr.request(exclusive_names, shared_names)
        message["modes"] = req.modes
        message["resources"] = list(req.resources)
        result = defer.park(
            mgr,
            task_id,
            req,
            message,
            park_ttl=max(park_ttl, 0.001),
            grant_ttl=cfg.defer_grant_ttl,
            label=f"{task.name} {task_id}",
            holder=holder,
            min_life=min_life,
        )
    except ReplicationTimeout as exc:  # granted at once, adopted, replicas short
        replication_short(exc)
        raise
    except (TypeError, ValueError) as exc:
        log.warning(
            "locked.defer-unserializable task=%s id=%s error=%r: waiting instead",
            label,
            task_id,
            exc,
        )
        wait = cfg.default_timeout if timeout is APP_DEFAULT else timeout
        # The body has not started: this wait may give way to a warm
        # shutdown, as @locked's own wait does.
        try:
            with mgr.context.using(haltable=True):
                lease = acquire(wait)
        except ShuttingDown as exc:
            _hand_back(task, label, exc)
            raise
        return _run_body(lease, run, fun, args, kwargs)
    if result.outcome == "granted" and result.leases:
        adopted(result.life, copy_life)
        return _run_adopted(
            result.leases, resources, run, fun, args, kwargs, done_marker(result.leases)
        )
    if result.outcome == "duplicate":
        if hooks is not None:
            hooks.dropped()
        _drop_duplicate(task, locks, label, task_id, result.state, resources, message, guarded)
    log.info("locked.deferred task=%s id=%s resources=%s", label, task_id, ",".join(resources))
    if hooks is not None:
        # Parked, then in transit for up to three grant TTLs (the record's TTL).
        hooks.parked(max(park_ttl, 0.001) + 3 * cfg.defer_grant_ttl + mgr.owner_ttl)
    _store_deferred(task, task_id, resources)
    # After DEFERRED (a guard finding no record and no result knows the
    # result backend lost it too) and before the message is acked (Ignore):
    # from now on the guard is the task's copy outside the lock Redis.
    _send_guard(locks, task_id, message, result.life, guarded)
    raise Ignore()


def _store_deferred(task: Any, task_id: str, resources: list[str]) -> None:
    """Store state ``DEFERRED`` in the result backend (best effort)."""
    from . import defer

    try:
        task.update_state(
            task_id=task_id,
            state=defer.DEFERRED,
            meta={"resources": resources, "parked_at": time.time()},
        )
    except Exception as exc:  # the task stays parked; only the visible state is missing
        log.warning("defer.state-error id=%s error=%r", task_id, exc)


def locked(
    *exclusive: str,
    shared: str | Iterable[str] = (),
    timeout: float | None = APP_DEFAULT,
    on_busy: str = APP_DEFAULT,
    retry_countdown: float = APP_DEFAULT,
    retry_backoff: float = APP_DEFAULT,
    retry_backoff_max: float = APP_DEFAULT,
    retry_jitter: bool = APP_DEFAULT,
    max_retries: int | None = APP_DEFAULT,
    on_lost: str = APP_DEFAULT,
) -> Callable[[F], F]:
    """Hold locks on the formatted resource names while the task body runs.

    Place it directly above the function and under ``@app.task`` (or
    ``@shared_task``); given a task, a task proxy or a
    :class:`~celery.app.task.Task` class it raises
    TypeError saying so, since the registered task would run unlocked.

    Args:
        exclusive: resource templates locked exclusively, formatted with
            ``str.format`` from the task's bound arguments (defaults
            applied), e.g. ``"repo:{repo_id}"``. Fields name parameters
            (``{repo.id}`` and ``{ids[0]}`` use ``repo`` and ``ids``);
            positional fields (``{}``, ``{0}``) are refused.
        shared: templates locked in shared (reader) mode. A name that also
            formats as an exclusive one is locked exclusively only.
        timeout: seconds ``on_busy="wait"`` waits; default: the app's
            ``redislock_default_timeout`` (None or ``inf`` = until granted).
        on_busy: what to do when the locks are taken:
            ``"wait"``: queue fairly (first come, first served) up to
            ``timeout``, then raise :class:`LockTimeout`. The fair mode.
            ``"retry"``: try once, then
            :meth:`task.retry(countdown=...) <celery.app.task.Task.retry>`; the
            task leaves the queue and loses its place in line.
            ``"raise"``: try once, raise :class:`LockTimeout`.
            ``"skip"``: try once, log ``locked.skipped`` and return None.
            ``"defer"``: try once; if busy, keep the place in line as a parked
            request, free the pool slot (result state ``DEFERRED``) and run
            when the lock is handed over: the task is published again with
            the same id (docs/defer.md). ``timeout``: the longest it stays
            parked (default ``redislock_defer_ttl``).
            Default: the app's ``redislock_default_on_busy`` (``"wait"``).
        retry_countdown, retry_backoff, retry_backoff_max, retry_jitter:
            countdown of ``on_busy="retry"`` (only allowed with it):
            ``retry_countdown`` (default 5 s, >= 0) ``* retry_backoff``
            (default 2, >= 1) ``** request.retries``, capped at
            ``retry_backoff_max`` (default 600 s), randomised to
            [50%, 100%] when ``retry_jitter`` (default True).
        max_retries: passed to :meth:`~celery.app.task.Task.retry` (default: the task's own;
            ``on_busy="retry"`` only).
        on_lost: what happens when the lock is lost while the body runs
            (an operator's ``redislock release --force``, the owner declared
            dead, its liveness expired in a pause, Redis lost the lock);
            default: the app's ``redislock_on_lost`` (``"fail"``).
            ``"fail"``: once the body returns, the task fails with
            :class:`LockLost` whose ``cause`` says why (an exception of
            the body's own wins). ``"terminate"``: a prefork pool child is
            killed at once (SIGKILL, as a hard time limit does; with
            ``acks_late`` and ``task_reject_on_worker_lost`` the broker
            redelivers the task); in threads, solo, gevent or eventlet pools
            there is no child to kill and it acts as ``"fail"``.
            ``"ignore"``: the result stands; ``locked.lost`` is logged.

    Raises:
        TypeError: (these are raised when decorating, so at import time) not applied to a plain function (see above).
        TemplateError: a template field names no parameter of the function
            (unless it takes ``**kwargs``: then each call checks), or is
            positional.
        ConfigurationError: a malformed or non-str template, no template,
            one template both exclusive and shared, or a bad option value.

    At call time, a template naming an argument the call lacks, or a value
    it cannot format, raises :class:`TemplateError` before anything is
    locked. The locks are released when the body returns
    or raises (including ``self.retry()`` and ``SoftTimeLimitExceeded``); a
    child killed by a hard time limit or revoke-terminate has its locks freed
    by the worker's main process within one heartbeat tick.
    """
    ex = check_templates("locked", exclusive)
    sh = template_list("locked(shared=)", shared)
    if not ex and not sh:
        raise ConfigurationError("locked", "needs at least one resource template")
    both = sorted(set(ex) & set(sh))
    if both:
        raise ConfigurationError(
            "locked",
            f"templates {both} are both exclusive and shared; an exclusive lock "
            "already covers reading: drop them from shared=",
        )
    if on_lost is not APP_DEFAULT and (
        not isinstance(on_lost, str) or on_lost not in ON_LOST_MODES
    ):
        raise ConfigurationError(
            "locked(on_lost=)", f"must be one of {', '.join(ON_LOST_MODES)}, not {on_lost!r}"
        )
    if on_busy is not APP_DEFAULT and (
        not isinstance(on_busy, str) or on_busy not in ON_BUSY_MODES
    ):
        raise ConfigurationError(
            "locked(on_busy=)", f"must be one of {', '.join(ON_BUSY_MODES)}, not {on_busy!r}"
        )
    if timeout is not APP_DEFAULT:
        # None, or seconds >= 0 (infinity: None); 10**400 is refused, not an OverflowError.
        timeout = _v.seconds("locked(timeout=)", timeout, allow_none=True, allow_inf=True)
        if timeout is not None and math.isinf(timeout):
            timeout = None
    if on_busy not in ("wait", "defer", APP_DEFAULT) and timeout is not APP_DEFAULT:
        raise ConfigurationError(
            "locked(timeout=)",
            f"applies to on_busy='wait' or 'defer' only (on_busy={on_busy!r} tries once)",
        )
    retry_opts = {
        "retry_countdown": retry_countdown,
        "retry_backoff": retry_backoff,
        "retry_backoff_max": retry_backoff_max,
        "retry_jitter": retry_jitter,
        "max_retries": max_retries,
    }
    given = [name for name, value in retry_opts.items() if value is not APP_DEFAULT]
    if given and on_busy != "retry":
        raise ConfigurationError(
            f"locked({given[0]}=)",
            f"applies to on_busy='retry' only (on_busy={on_busy!r}); "
            "add on_busy='retry' or drop it",
        )
    countdown0 = 5.0 if retry_countdown is APP_DEFAULT else retry_countdown
    backoff = 2.0 if retry_backoff is APP_DEFAULT else retry_backoff
    backoff_max = 600.0 if retry_backoff_max is APP_DEFAULT else retry_backoff_max
    jitter = True if retry_jitter is APP_DEFAULT else retry_jitter
    _number("locked(retry_countdown=)", countdown0, 0, "seconds >= 0")
    _number("locked(retry_backoff=)", backoff, 1, "a factor >= 1 (1: the same countdown each time)")
    _number("locked(retry_backoff_max=)", backoff_max, 0, "seconds >= 0")
    if not isinstance(jitter, bool):
        raise ConfigurationError("locked(retry_jitter=)", f"must be True or False, not {jitter!r}")
    if (
        max_retries is not APP_DEFAULT
        and max_retries is not None
        and (isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0)
    ):
        raise ConfigurationError(
            "locked(max_retries=)", f"must be an int >= 0 or None, not {max_retries!r}"
        )

    def decorate(fun: F) -> F:
        _check_target(fun)
        sig = inspect.signature(fun)
        label = getattr(fun, "__qualname__", repr(fun))
        check_fields(ex + sh, sig, label)
        binder = ArgumentBinder(sig, label)

        from celery import current_task

        @functools.wraps(fun)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            mapping = binder.bind(args, kwargs)
            exclusive_names = format_all(ex, mapping, label)
            # A resource both exclusive and shared (two templates formatting
            # to one name) is locked exclusively: that covers reading too.
            shared_names = [n for n in format_all(sh, mapping, label) if n not in exclusive_names]
            # The task being run (None outside one): one look-up of Celery's task stack.
            task = current_task._get_current_object()
            locks = RedisLock.for_task(task)
            mode = locks.config.default_on_busy if on_busy is APP_DEFAULT else on_busy
            hooks = _task_hooks(task)
            body = fun if hooks is None else _after_hook(fun, hooks.before_body)
            # The task's own @locked (not one called in a @locked body: that
            # one re-enters the adopted grant) adopts a message's grant
            # whatever on_busy says: a waiting task parked behind a grant in
            # transit, then dispatched.
            outermost = not _leases.get()
            if (mode == "defer" or (outermost and _carries_grant(task))) and _deferrable(task):
                lost = locks.config.on_lost if on_lost is APP_DEFAULT else on_lost
                return _run_deferred(
                    task,
                    locks,
                    label,
                    exclusive_names,
                    shared_names,
                    timeout,
                    lost,
                    body,
                    args,
                    kwargs,
                    hooks,
                )
            if mode in ("wait", "defer"):
                wait = locks.config.default_timeout if timeout is APP_DEFAULT else timeout
            else:
                wait = 0
            mgr = locks.manager
            if mgr.state.deferred and not mgr.liveness.own_heartbeat:
                _retry_deferred(mgr)
            lost_mode = locks.config.on_lost if on_lost is APP_DEFAULT else on_lost
            request = getattr(task, "request", None) if task is not None else None
            in_task = request is not None and not getattr(request, "called_directly", True)
            request_id = getattr(request, "id", None) if in_task else None
            task_id = str(request_id or "-")
            # Log lines name the registered task (e.g. proj.sync) when there is one.
            task_label = str(getattr(task, "name", None) or label) if in_task else label
            # Who holds the locks, for operators (`redislock locks`): recorded
            # beside the grant only when a task takes them; every acquire the
            # body makes in this thread is labelled the same way.
            outer_holder = mgr.context.current().holder
            holder = (
                holder_record(task_label, request_id, locks.nodename, request)
                if in_task and outer_holder is None
                else None
            )
            # A waiting task run by a worker gives its pool slot up when a
            # grant in transit waits ahead of it (docs/defer.md, T3).
            parked: list[Any] = []
            # Not a UniqueTask holding its key: the key lives with this
            # process, and parking would free it while the task is parked.
            if (
                mode == "wait"
                and outermost
                and _deferrable(task)
                and getattr(task, "unique_lease", None) is None
            ):
                take_over = _transit_hook(task, locks, label, wait, parked)
            else:
                take_over = None
            try:
                # The body has not started: this wait may give way to a
                # warm shutdown (ShuttingDown, below).
                with _holding(mgr, holder), mgr.context.using(haltable=True, take_over=take_over):
                    lease = mgr.acquire(exclusive_names, shared_names, timeout=wait)
            except RequestMoved as moved:
                return _parked_behind_transit(
                    task,
                    locks,
                    label,
                    exclusive_names + shared_names,
                    lost_mode,
                    body,
                    args,
                    kwargs,
                    parked[0],
                    moved,
                )
            except ShuttingDown as exc:
                _hand_back(task, label, exc)
                raise
            except LockTimeout as exc:
                if mode == "skip":
                    log.info(
                        "locked.skipped task=%s resources=%s",
                        label,
                        ",".join(exclusive_names + shared_names),
                    )
                    return None
                if mode == "retry":
                    if task is None or not hasattr(task, "retry"):
                        raise
                    retries = int(getattr(task.request, "retries", 0) or 0)
                    countdown = min(backoff_max, countdown0 * backoff**retries)
                    if jitter:
                        countdown = countdown * (0.5 + random.random() / 2)
                    opts: dict[str, Any] = {"countdown": countdown, "exc": exc}
                    if max_retries is not APP_DEFAULT:
                        opts["max_retries"] = max_retries
                    limit = max_retries if max_retries is not APP_DEFAULT else task.max_retries
                    resources = ",".join(exclusive_names + shared_names)
                    if limit is not None and retries >= limit:
                        # task.retry() raises the LockTimeout itself: no retry.
                        log.warning(
                            "locked.retries-exhausted task=%s resources=%s retries=%d "
                            "max_retries=%d: failing with LockTimeout",
                            label,
                            resources,
                            retries,
                            limit,
                        )
                    else:
                        log.info(
                            "locked.retry task=%s resources=%s countdown=%.1f",
                            label,
                            resources,
                            countdown,
                        )
                    raise task.retry(**opts) from exc
                raise
            run = _BodyRun(
                mgr,
                label,
                task_label,
                task_id,
                lost_mode,
                in_task,
                locks.pool_child_pid,
                holder,
            )
            return _run_body(lease, run, body, args, kwargs)

        wrapper.__signature__ = sig  # type: ignore[attr-defined]
        wrapper.__redislock__ = {  # type: ignore[attr-defined]
            "exclusive": ex,
            "shared": sh,
            "on_busy": None if on_busy is APP_DEFAULT else on_busy,
            "on_lost": None if on_lost is APP_DEFAULT else on_lost,
        }
        return wrapper  # type: ignore[return-value]

    return decorate
