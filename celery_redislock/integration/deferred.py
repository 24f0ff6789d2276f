"""The ``on_busy="defer"`` path of ``@locked`` (docs/defer.md).

A deferred task tries once; when busy it keeps its place in line as a
parked request, frees its pool slot (result state ``DEFERRED``) and runs
when the lock is handed over, published again with the same id and a grant
header; the process that runs it adopts the grant (:func:`run_deferred`).
Also here: an ``on_busy="wait"`` task that gives its slot up behind a grant
in transit (:func:`transit_hook`, :func:`parked_behind_transit`), marking a
park record ``done`` once the run's result is stored
(:func:`deferred_run_ended`), and the hooks a Task base such as
``UniqueTask`` is told through (:class:`DeferHooks`).

It logs to the ``celery_redislock.task`` logger, as it always did.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..engine.lease import Lease
from ..engine.manager import RequestMoved
from ..exceptions import LockError, LockTimeout, ReplicationTimeout, ShuttingDown
from . import guard
from .app import RedisLock
from .body import BodyRun, hand_back, holding, run_body, upkeep_if_due
from .settings import APP_DEFAULT
from .templates import holder_info

log = logging.getLogger("celery_redislock.task")


def deferrable(task: Any) -> bool:
    """Whether the call is a task run by a worker (defer needs a message to park)."""
    request = getattr(task, "request", None) if task is not None else None
    return bool(
        request is not None
        and not getattr(request, "called_directly", True)
        and getattr(request, "id", None)
        and not getattr(request, "is_eager", False)
    )


def grant_header(request: Any) -> tuple[int, int] | None:
    """``(life, fence)`` of the grant a re-dispatched deferred task carries, or None.

    The header is taken off the request's ``headers`` as it is read: Celery's
    ``self.retry()`` copies them into the retry's message, and a retry is a
    new life of the task (a new arrival), not a copy of the grant's message.
    (The request attribute of the same name stays, for the body to read.)
    """
    from ..worker.defer import HEADER, PARKED_AT_HEADER, parse_header

    value = getattr(request, HEADER, None)
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        found = headers.pop(HEADER, None)
        headers.pop(PARKED_AT_HEADER, None)  # the grant's, not a retry's
        value = found if value is None else value
    return parse_header(value)


def _header_value(request: Any) -> Any:
    """The raw ``redislock_defer`` header of ``request`` (None if absent)."""
    from ..worker.defer import HEADER

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
    from ..worker.defer import PARKED_AT_HEADER, parse_parked_at

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


def task_hooks(task: Any) -> DeferHooks | None:
    """The hooks installed for the task run ``task`` is in, or None."""
    if not _hooks.get() or task is None:
        return None
    task_id = getattr(getattr(task, "request", None), "id", None)
    return _hooks_of(str(task_id)) if task_id else None


def preceded_by(fun: Callable[..., Any], hook: Callable[[], None]) -> Callable[..., Any]:
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
    if not isinstance(spec, dict) or not deferrable(task):
        return False
    mode = spec.get("on_busy")
    if mode is None:
        mode = RedisLock.for_task(task).config.default_on_busy
    return bool(mode == "defer")


def carries_grant(task: Any) -> bool:
    """Whether the task's message carries a deferred grant's header."""
    request = getattr(task, "request", None) if task is not None else None
    return request is not None and grant_header(request) is not None


def transit_hook(
    task: Any, locks: RedisLock, label: str, wait: float | None, parked: list[Any]
) -> Callable[[str, Any], bool]:
    """The ``park_behind_transit`` hook of an ``on_busy="wait"`` task's own
    wait (docs/defer.md, "Waiting tasks behind a grant in transit", T3).

    Called by :meth:`LockManager.acquire` with the queued request's token
    when a grant in transit waits ahead of it: parks the task in the
    request's place (:func:`defer.park` with ``waiting``) and returns True, the result
    appended to ``parked``; returns False to go on waiting (the request is
    no longer queued, a finished record holds the task, the timeout is
    spent, or the arguments do not survive JSON). A copy of a task that is
    parked, in transit or running elsewhere raises ``Ignore`` (dropped).
    """
    from ..worker import defer

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
            # What a park record's message holds (as run_deferred builds it);
            # the modes with the limits of limited resources (xl:5).
            message["modes"] = req.spec
            message["resources"] = list(req.resources)
            message["park_ttl"] = park_ttl
            message["grant_ttl"] = cfg.defer_grant_ttl
            result = defer.park(
                locks.manager,
                task_id,
                req,
                message,
                park_ttl=park_ttl,
                grant_ttl=cfg.defer_grant_ttl,
                label=f"{task.name} {task_id}",
                holder=holder_info(task, label, locks.nodename),
                waiting=token,
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


def drop_redelivered_wait(
    task: Any,
    locks: RedisLock,
    label: str,
    exclusive: list[str],
    shared: list[str],
    limited: dict[str, int] | None = None,
) -> None:
    """A redelivered copy of a waiting task (docs/defer-internals.md, T5): if
    an earlier delivery parked the task in its place behind a grant in
    transit, a park record holds it and the task is a deferred one now
    (parked, in transit, running or done): drop this copy (``Ignore``) as a
    deferred task's duplicate is. That delivery's main process died after
    the park, before it acked the message. No record of this attempt (or a
    later one): return, and the copy waits as any redelivered task does.
    One read, for redelivered copies only."""
    from ..protocol.keys import text
    from ..worker import defer

    if not _redelivered(getattr(task, "request", None)):
        return
    mgr = locks.manager
    task_id = str(task.request.id)
    raw_state, raw_retries = mgr.channel.command(
        "hmget", defer.record_key(mgr, task_id), "state", "retries"
    )
    if raw_state is None:
        return
    state = text(raw_state)
    try:
        attempt = int(text(raw_retries)) if raw_retries is not None else 0
    except ValueError:
        attempt = 0
    if attempt < _attempt(task):
        return  # an earlier attempt's record: this attempt never parked
    log.info(
        "locked.wait-redelivered task=%s id=%s state=%s: an earlier delivery parked "
        "this task in its place; the park record decides",
        label,
        task_id,
        state,
    )
    req = mgr.request(exclusive, shared, limited or None)
    message = defer.capture_message(task)
    message.update(
        modes=req.spec,
        resources=list(req.resources),
        park_ttl=locks.config.defer_ttl,
        grant_ttl=locks.config.defer_grant_ttl,
    )
    guarded = guard.enabled(locks.app, locks.config.defer_guard_interval)
    _drop_duplicate(task, locks, label, task_id, state, list(req.resources), message, guarded)


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
) -> BodyRun:
    """How a deferred task's adopted body runs: the body's own acquires carry
    this task's holder record, unless an outer ``@locked`` already set one."""
    mgr = locks.manager
    holder = holder_info(task, label, locks.nodename)
    return BodyRun(
        mgr,
        label,
        str(getattr(task, "name", None) or label),
        task_id,
        lost_mode,
        True,
        locks.pool_child_pid,
        holder if mgr.context.current().holder is None else None,
    )


def parked_behind_transit(
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
    """The wait was parked in its place (:func:`transit_hook`): run the
    body with the grant adopted at once, or free the pool slot, as a parked
    task does (``DEFERRED``, its guard, ``Ignore``)."""

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

        def mark() -> None:  # done once the result is stored, as run_deferred's
            _mark_done_after_store(task, mgr, task_id, leases[0].owner_id)

        if guarded:  # a guard that later finds no record must not recover a started task
            guard.mark_adopted(locks.app, task_id, result.life, _attempt(task))
        return _run_adopted(leases, resources, run, fun, args, kwargs, mark)
    _store_deferred(task, task_id, resources)
    _send_guard(locks, task_id, message, result.life, guarded)
    from .parked import Parked  # imports Celery: only where a task parks

    raise Parked()


def _run_adopted(
    leases: list[Lease],
    resources: list[str],
    run: BodyRun,
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

    return run_body(main, run, fun, args, kwargs, finish)


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

    from ..worker.defer import mark_done

    def mark() -> None:
        try:
            mark_done(mgr, task_id, owner)
        except Exception as exc:  # the record expires on its own
            log.warning("defer.done-error id=%s error=%r", task_id, exc)

    _connect_postrun()
    _done_after_store[task_id] = (getattr(task, "request", None), mark)


_postrun_lock = threading.Lock()
_postrun_connected = False


def _connect_postrun() -> None:
    """Connect :func:`deferred_run_ended` to ``task_postrun`` (once per
    process, before the first mark is registered: Celery is imported by
    then, and only a process that adopts a grant needs it)."""
    global _postrun_connected
    if _postrun_connected:
        return
    with _postrun_lock:
        if not _postrun_connected:
            from celery import signals

            signals.task_postrun.connect(
                _on_task_postrun, weak=False, dispatch_uid="celery_redislock.deferred"
            )
            _postrun_connected = True


def _on_task_postrun(sender: Any = None, task_id: Any = None, state: Any = None, **_: Any) -> None:
    # Celery sends task_postrun after it stored the result.
    deferred_run_ended(sender, task_id, state)


def deferred_run_ended(task: Any, task_id: Any, state: Any) -> None:
    """``task_postrun`` (connected here on first use): a deferred task's
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


def run_deferred(
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
    limited: dict[str, int] | None = None,
) -> Any:
    """``on_busy="defer"`` (docs/defer.md): adopt a grant, run, or park and free the slot.

    ``hooks`` (a Task base's, :class:`DeferHooks`): told when the task
    parks or its copy is dropped (``fun`` already calls ``before_body``).
    ``limited``: the limited resources (name -> limit): one slot of each,
    parked for in line with the others; the park record keeps the limits.
    """
    from ..worker import defer

    mgr = locks.manager
    upkeep_if_due(mgr)
    defer.set_done_ttl(mgr, locks.config.defer_ttl)
    call = _DeferredCall(
        task,
        locks,
        label,
        exclusive_names,
        shared_names,
        lost_mode,
        fun,
        args,
        kwargs,
        hooks,
        limited or {},
    )
    request = call.request
    # A copy parked record-first (below): the life its grant header names
    # (None: a recovery copy or a redelivery).
    copy_life: int | None = None
    grant = grant_header(request)
    if grant is not None:
        life, fence = grant
        leases = call.adopt(life, fence)
        if leases:
            return call.run_adopted(leases, life, life)
        # A copy of a dispatched message never tries once: park decides.
        copy_life = life
    elif _header_value(request) == guard.RECOVER:
        # An earlier release's recovery copy (D12): the park record decides,
        # as for a stale grant's copy: none makes it a new arrival, any a duplicate.
        log.info("defer.recovery-copy task=%s id=%s: parking this copy", label, call.task_id)
    elif _redelivered(request):
        # The broker gave the message back (its worker died before the ack):
        # the task may have parked, and even run, meanwhile (D2). The park
        # record decides, as for a recovery copy; only redeliveries pay for it.
        log.info("defer.redelivered task=%s id=%s: parking this copy", label, call.task_id)
    else:
        lease = call.try_once()
        if lease is not None:
            return call.run_body(lease)
        return call.park(timeout, None, 0)
    # Parked record-first. A stale grant's copy parked as a new arrival takes
    # a life above the grant's: a later loss of its record must not leave a
    # life number the adoption marker has passed already (D12).
    call.drop_if_stale(copy_life)
    return call.park(timeout, copy_life, 0 if copy_life is None else copy_life + 1)


class _DeferredCall:
    """One call of an ``on_busy="defer"`` task (:func:`run_deferred`): its
    request, its holder record, how its body runs, and each way it goes."""

    def __init__(
        self,
        task: Any,
        locks: RedisLock,
        label: str,
        exclusive_names: list[str],
        shared_names: list[str],
        lost_mode: str,
        fun: Callable[..., Any],
        args: Any,
        kwargs: Any,
        hooks: DeferHooks | None,
        limited: dict[str, int],
    ) -> None:
        self.task = task
        self.locks = locks
        self.mgr = locks.manager
        self.cfg = locks.config
        self.label = label
        self.request = task.request
        self.task_id = str(self.request.id)
        self.exclusive_names = exclusive_names
        self.shared_names = shared_names
        self.limited = limited
        self.resources = exclusive_names + shared_names + list(limited)
        self.body = (fun, args, kwargs)
        self.hooks = hooks
        # Who holds the locks, for operators: the park request, the adopted
        # grants and the body's own acquires carry this task's holder record
        # (the acquires and the body: unless an outer @locked set one).
        self.holder = holder_info(task, label, locks.nodename)
        self.run = _deferred_body_run(task, locks, label, self.task_id, lost_mode)
        # Guards of parked tasks against a loss of the lock Redis's data (D12).
        self.guarded = guard.enabled(locks.app, self.cfg.defer_guard_interval)

    def acquire(self, timeout: Any) -> Lease:
        with holding(self.mgr, self.run.holder):
            return self.mgr.acquire(
                self.exclusive_names,
                self.shared_names,
                limited=self.limited or None,
                timeout=timeout,
            )

    def run_body(self, lease: Lease) -> Any:
        fun, args, kwargs = self.body
        return run_body(lease, self.run, fun, args, kwargs)

    def run_adopted(self, leases: list[Lease], life: int, via: int | None) -> Any:
        """Run the body with the grants adopted for this task's life ``life``
        (``via``: the life the message's grant header named, if any)."""
        if self.guarded:  # a guard that later finds no record must not recover a started task
            guard.mark_adopted(self.locks.app, self.task_id, life, _attempt(self.task), via)

        def mark() -> None:  # done once the result is stored
            _mark_done_after_store(self.task, self.mgr, self.task_id, leases[0].owner_id)

        fun, args, kwargs = self.body
        return _run_adopted(leases, self.resources, self.run, fun, args, kwargs, mark)

    def replication_short(self, exc: ReplicationTimeout) -> None:
        # Adopted, then released again (too few replicas have it): the task
        # ends with the error, as a wait-mode task's does; a stale copy of
        # its message finds it done once the failure is stored.
        log.warning("defer.replication-short task=%s id=%s: %s", self.label, self.task_id, exc)
        _mark_done_after_store(self.task, self.mgr, self.task_id, self.mgr.owner_id)

    def adopt(self, life: int, fence: int) -> list[Lease]:
        """Adopt the grant the message carries; [] when it is not this copy's."""
        from ..worker import defer

        try:
            outcome, leases = defer.adopt(
                self.mgr,
                self.task_id,
                life,
                holder=self.holder,
                parked_at=_parked_at(self.request),
            )
        except ReplicationTimeout as exc:
            self.replication_short(exc)
            raise
        if not leases:
            log.info(
                "defer.not-adopted task=%s id=%s life=%d fence=%d why=%s: parking this copy "
                "(dropped if the task is in line or done)",
                self.label,
                self.task_id,
                life,
                fence,
                outcome,
            )
        return leases or []

    def try_once(self) -> Lease | None:
        """A new arrival: try once, as on_busy="raise" does (busy is no
        timeout for the metrics: the park says what happened)."""
        try:
            with self.mgr.context.using(parking=True):
                return self.acquire(0)
        except LockTimeout:
            return None

    def drop_if_stale(self, copy_life: int | None) -> None:
        """A copy parked record-first: no record at all may mean the lock
        Redis lost the record of a task that ran or started; then the result
        backend says so (D12), and this copy is dropped (``Ignore``)."""
        if not self.guarded:
            return
        from celery.exceptions import Ignore

        stale = guard.copy_is_stale(
            self.locks, self.task_id, _attempt(self.task), copy_life, _redelivered(self.request)
        )
        if stale is None:
            return
        log.warning(
            "defer.stale-copy task=%s id=%s why=%s: no park record, but this task ran "
            "or started; dropping this copy",
            self.label,
            self.task_id,
            stale,
        )
        if self.hooks is not None:
            self.hooks.dropped()
        raise Ignore()

    def park(self, timeout: Any, copy_life: int | None, min_life: int) -> Any:
        """Park the task and free the pool slot (``DEFERRED``, its guard,
        ``Ignore``); or run at once when the park is granted; or drop this
        copy as a duplicate; or wait in the slot when the message does not
        survive JSON. ``copy_life``: the life the message's grant header
        named (None: none); ``min_life``: the lowest life to park in."""

        try:
            result, message, park_ttl = self._park_request(timeout, min_life)
        except ReplicationTimeout as exc:  # granted at once, adopted, replicas short
            self.replication_short(exc)
            raise
        except (TypeError, ValueError) as exc:
            return self._wait_instead(timeout, exc)
        if result.outcome == "granted" and result.leases:
            return self.run_adopted(result.leases, result.life, copy_life)
        task, locks, task_id = self.task, self.locks, self.task_id
        if (
            result.outcome == "duplicate"
            and result.state == "adopted"
            and _redelivered(self.request)
        ):
            self._look_again_later(message)
        if result.outcome == "duplicate":
            if self.hooks is not None:
                self.hooks.dropped()
            _drop_duplicate(
                task,
                locks,
                self.label,
                task_id,
                result.state,
                self.resources,
                message,
                self.guarded,
            )
        log.info(
            "locked.deferred task=%s id=%s resources=%s: parked; it runs when its locks are free",
            self.label,
            task_id,
            ",".join(self.resources),
        )
        if self.hooks is not None:
            # Parked, then in transit for up to three grant TTLs (the record's TTL).
            self.hooks.parked(
                max(park_ttl, 0.001) + 3 * self.cfg.defer_grant_ttl + self.mgr.owner_ttl
            )
        _store_deferred(task, task_id, self.resources)
        # After DEFERRED (a guard finding no record and no result knows the
        # result backend lost it too) and before the message is acked (Ignore):
        # from now on the guard is the task's copy outside the lock Redis.
        _send_guard(locks, task_id, message, result.life, self.guarded)
        from .parked import Parked  # imports Celery: only where a task parks

        raise Parked()

    def _look_again_later(self, message: dict[str, Any]) -> NoReturn:
        """A redelivered copy met the task ``adopted`` by an owner whose
        liveness has not run out (docs/defer-internals.md, D13). Its own
        earlier delivery may be that adopter, its child SIGKILLed a moment
        ago: Celery gives the message back at once, before the dead child's
        liveness is gone, and dropping the copy would lose the task. So the
        copy is published again, record-first (header ``recover``), due
        when a dead adopter's liveness has surely run out; then the park
        record decides (a live adopter: dropped; a dead one: it runs again;
        done: dropped), and this delivery is acked (``Ignore``)."""
        from celery.exceptions import Ignore

        from ..worker.defer import HEADER

        delay = self.mgr.owner_ttl + 1.0
        opts = dict(message.get("options") or {})
        log.warning(
            "defer.look-again task=%s id=%s: a redelivered copy found this task adopted "
            "by an owner still alive (maybe its own delivery's, just killed); looking "
            "again in %.1fs",
            self.label,
            self.task_id,
            delay,
        )
        self.locks.app.send_task(
            message["name"],
            args=message.get("args") or [],
            kwargs=message.get("kwargs") or {},
            task_id=self.task_id,
            headers={HEADER: guard.RECOVER},
            countdown=delay,
            add_to_parent=False,
            **opts,
        )
        raise Ignore()

    def _park_request(self, timeout: Any, min_life: int) -> tuple[Any, dict[str, Any], float]:
        """The park (:func:`defer.park`): its result, the message it stored
        and the park TTL (the time-out, capped by the task's ``expires``)."""
        from ..worker import defer

        cfg = self.cfg
        message = defer.capture_message(self.task)
        park_ttl = cfg.defer_ttl if timeout is APP_DEFAULT or timeout is None else float(timeout)
        message["resources"] = self.resources
        message["park_ttl"] = park_ttl  # the time-out (LockTimeout's), not capped
        # Never parked past the task's own expires (then it is revoked as expired).
        park_ttl = defer.park_limit(message, park_ttl)
        message["grant_ttl"] = cfg.defer_grant_ttl
        req = self.mgr.request(self.exclusive_names, self.shared_names, self.limited or None)
        # The modes with the limits of limited resources (xl:5): a
        # dispatcher's re-attempt and a re-park keep each one's own N.
        message["modes"] = req.spec
        message["resources"] = list(req.resources)
        result = defer.park(
            self.mgr,
            self.task_id,
            req,
            message,
            park_ttl=max(park_ttl, 0.001),
            grant_ttl=cfg.defer_grant_ttl,
            label=f"{self.task.name} {self.task_id}",
            holder=self.holder,
            min_life=min_life,
        )
        return result, message, park_ttl

    def _wait_instead(self, timeout: Any, error: Exception) -> Any:
        """The message does not survive JSON: wait in the pool slot, as
        ``on_busy="wait"`` does."""
        log.warning(
            "locked.defer-unserializable task=%s id=%s error=%r: waiting instead",
            self.label,
            self.task_id,
            error,
        )
        wait = self.cfg.default_timeout if timeout is APP_DEFAULT else timeout
        # The body has not started: this wait may give way to a warm
        # shutdown, as @locked's own wait does.
        try:
            with self.mgr.context.using(haltable=True):
                lease = self.acquire(wait)
        except ShuttingDown as exc:
            hand_back(self.task, self.label, exc)
            raise
        return self.run_body(lease)


def _store_deferred(task: Any, task_id: str, resources: list[str]) -> None:
    """Store state ``DEFERRED`` in the result backend (best effort)."""
    from ..worker import defer

    try:
        task.update_state(
            task_id=task_id,
            state=defer.DEFERRED,
            meta={"resources": resources, "parked_at": time.time()},
        )
    except Exception as exc:  # the task stays parked; only the visible state is missing
        log.warning("defer.state-error id=%s error=%r", task_id, exc)
