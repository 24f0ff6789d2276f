"""Running an ``@locked`` body while it holds its lease.

What ``@locked`` and the ``on_busy="defer"`` path share once the locks are
taken: the body runs with its lease on the :func:`current_lease` stack and
the task's holder record on the thread (:class:`BodyRun`,
:func:`run_body`); the lease is released however the body ends; a lease
lost meanwhile is handled as ``on_lost`` says (``terminate``: the pool
child is killed at once; ``fail``: :class:`LockLost` once the body
returns; ``ignore``: logged). Also the two things a wait does on either
path: :func:`hand_back` (the worker shuts down while the task waits) and
:func:`upkeep_if_due` (a pool child retries its deferred releases).

Below both ``celery_redislock.integration.locked`` and ``celery_redislock.integration.deferred``;
it logs to the ``celery_redislock.task`` logger, as it always did.
"""

from __future__ import annotations

import contextvars
import logging
import os
import signal
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..engine.lease import Lease
from ..exceptions import LockError, LockLost, ShuttingDown

log = logging.getLogger("celery_redislock.task")

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


def in_locked_body() -> bool:
    """Whether this thread or greenlet runs inside a ``@locked`` body."""
    return bool(_leases.get())


def upkeep_if_due(mgr: Any) -> None:
    """Retry releases the engine deferred (Redis was down at release time).

    A worker's pool children run without the engine's own heartbeat (the
    main process refreshes their liveness), so nothing else would retry
    them; one extra round trip, only when something is pending.
    """
    if not mgr.upkeep_due:
        return
    try:
        mgr.upkeep()
    except Exception as exc:
        log.warning("locked.deferred-release-error error=%r", exc)


def hand_back(task: Any, label: str, exc: ShuttingDown) -> None:
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


@dataclass
class BodyRun:
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


def holding(mgr: Any, holder: str | None) -> AbstractContextManager[Any]:
    """The block's acquires record ``holder`` (None: keep the thread's own)."""
    return mgr.context.using(holder=holder) if holder is not None else nullcontext()


def run_body(
    lease: Lease,
    run: BodyRun,
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
        with holding(mgr, run.holder):
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
