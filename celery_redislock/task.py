"""``@locked``: lock a task's resources while its body runs.

Place it under ``@app.task`` so that it wraps the function Celery runs::

    @app.task(bind=True, acks_late=True)
    @locked("repo:{repo_id}", shared=["remote:{remote_id}"], timeout=30)
    def sync(self, repo_id, remote_id):
        lease = current_lease()          # fencing token, lost flag, contenders
        ...

The lock owner is the worker process (its owner id), never the task id: a
task redelivered after a worker loss is a new request, not the old holder.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import random
import string
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .exceptions import ConfigurationError, LockError, LockTimeout, ShuttingDown
from .lease import Lease
from .settings import ON_BUSY_MODES

if TYPE_CHECKING:
    from .app import RedisLock

log = logging.getLogger("celery_redislock.task")

F = TypeVar("F", bound=Callable[..., Any])

_leases: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
    "celery_redislock_leases", default=()
)

#: Marks "use the app's redislock_default_timeout".
_DEFAULT: Any = object()


class TemplateError(LockError, ValueError):
    """A resource template names an argument the task call does not have.

    Raised before anything is locked. Attributes: ``template``, ``argument``.
    """

    def __init__(self, template: str, argument: str = "?", task: str = "the task") -> None:
        self.template = template
        self.argument = argument
        self.task = task
        # args are the fields, so the error survives Celery's result backend.
        super().__init__(template, argument, task)

    def __str__(self) -> str:
        return (
            f"@locked template {self.template!r} of {self.task} needs argument "
            f"{self.argument!r}, which this call does not have; pass it or fix the template"
        )


def current_lease() -> Lease | None:
    """The innermost lease taken by ``@locked`` in this thread or greenlet.

    Returns None outside a ``@locked`` body. The lease gives the fencing token
    (``lease.fencing_token``), whether it was lost (``lease.lost``,
    ``lease.check()``) and how many requests wait for it (``lease.contenders()``).
    """
    stack = _leases.get()
    return stack[-1] if stack else None


def _fields(template: str) -> list[str]:
    out = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            out.append(field.split(".", 1)[0].split("[", 1)[0])
    return out


def _format(templates: Iterable[str], args: Mapping[str, Any], task: str) -> list[str]:
    out = []
    for template in templates:
        for field in _fields(template):
            if field == "" or field.isdigit():
                raise TemplateError(template, field or "{}", task)
            if field not in args:
                raise TemplateError(template, field, task)
        try:
            out.append(template.format_map(args))
        except (KeyError, AttributeError, IndexError) as exc:
            raise TemplateError(template, str(exc), task) from exc
    return out


def _check_templates(name: str, templates: Iterable[Any]) -> tuple[str, ...]:
    out = []
    for t in templates:
        if not isinstance(t, str) or not t:
            raise ConfigurationError(name, f"resource templates must be non-empty str, not {t!r}")
        out.append(t)
    return tuple(out)


def _find_locks(task: Any) -> RedisLock:
    from .app import RedisLock

    app = getattr(task, "app", None) if task is not None else None
    if app is None:
        from celery import current_app

        app = current_app
    locks = RedisLock.of(app)
    if locks is None:
        raise ConfigurationError(
            "RedisLock",
            f"app {getattr(app, 'main', app)!r} has no RedisLock: call RedisLock(app) "
            "where the app is created, before @locked tasks run",
        )
    return locks


def _retry_deferred(mgr: Any) -> None:
    """Retry releases the engine deferred (Redis was down at release time).

    A worker's pool children run without the engine's own heartbeat (the
    main process refreshes their liveness), so nothing else would retry
    them; one extra round trip, only when something is pending.
    """
    try:
        mgr._beat()
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


def locked(
    *exclusive: str,
    shared: str | Iterable[str] = (),
    timeout: float | None = _DEFAULT,
    on_busy: str = "wait",
    retry_countdown: float = 5.0,
    retry_backoff: float = 2.0,
    retry_backoff_max: float = 600.0,
    retry_jitter: bool = True,
    max_retries: int | None = _DEFAULT,
) -> Callable[[F], F]:
    """Hold locks on the formatted resource names while the task body runs.

    Args:
        exclusive: resource templates locked exclusively, formatted with
            ``str.format`` from the task's bound arguments (defaults
            applied), e.g. ``"repo:{repo_id}"``.
        shared: templates locked in shared (reader) mode.
        timeout: seconds ``on_busy="wait"`` waits; default: the app's
            ``redislock_default_timeout`` (None = until granted).
        on_busy: what to do when the locks are taken:
            ``"wait"``: queue fairly (first come, first served) up to
            ``timeout``, then raise :class:`LockTimeout`. The fair mode.
            ``"retry"``: try once, then ``task.retry(countdown=...)``; the
            task leaves the queue and loses its place in line.
            ``"raise"``: try once, raise :class:`LockTimeout`.
            ``"skip"``: try once, log ``locked.skipped`` and return None.
        retry_countdown, retry_backoff, retry_backoff_max, retry_jitter:
            countdown of ``on_busy="retry"``: ``retry_countdown *
            retry_backoff ** request.retries``, capped at
            ``retry_backoff_max``, randomised to [50%, 100%] with jitter.
        max_retries: passed to ``task.retry`` (default: the task's own).

    A template naming an argument the call lacks raises :class:`TemplateError`
    before anything is locked. The locks are released when the body returns
    or raises (including ``self.retry()`` and ``SoftTimeLimitExceeded``); a
    child killed by a hard time limit or revoke-terminate has its locks freed
    by the worker's main process within one heartbeat tick.
    """
    ex = _check_templates("locked", exclusive)
    sh = _check_templates("locked(shared=)", [shared] if isinstance(shared, str) else shared)
    if not ex and not sh:
        raise ConfigurationError("locked", "needs at least one resource template")
    if on_busy not in ON_BUSY_MODES:
        raise ConfigurationError(
            "locked(on_busy=)", f"must be one of {', '.join(ON_BUSY_MODES)}, not {on_busy!r}"
        )
    if (
        timeout is not _DEFAULT
        and timeout is not None
        and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0)
    ):
        raise ConfigurationError("locked(timeout=)", f"must be >= 0 or None, not {timeout!r}")
    if on_busy != "wait" and timeout is not _DEFAULT:
        raise ConfigurationError(
            "locked(timeout=)", f"applies to on_busy='wait' only (on_busy={on_busy!r} tries once)"
        )

    def decorate(fun: F) -> F:
        sig = inspect.signature(fun)
        label = getattr(fun, "__qualname__", repr(fun))
        var_kw = next(
            (p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD),
            None,
        )

        @functools.wraps(fun)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from celery import current_task

            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{label}: {exc}") from exc
            bound.apply_defaults()
            mapping = dict(bound.arguments)
            if var_kw is not None:
                mapping.update(mapping.pop(var_kw, {}) or {})
            exclusive_names = _format(ex, mapping, label)
            shared_names = _format(sh, mapping, label)
            task = current_task._get_current_object() if current_task else None
            locks = _find_locks(task)
            if on_busy == "wait":
                wait = locks.config.default_timeout if timeout is _DEFAULT else timeout
            else:
                wait = 0
            mgr = locks.manager
            if mgr._orphans and not mgr._own_heartbeat:
                _retry_deferred(mgr)
            try:
                # The body has not started: this wait may give way to a
                # warm shutdown (ShuttingDown, below).
                mgr._local.halt_ok = True
                try:
                    lease = mgr.acquire(exclusive_names, shared_names, timeout=wait)
                finally:
                    mgr._local.halt_ok = False
            except ShuttingDown as exc:
                _hand_back(task, label, exc)
                raise
            except LockTimeout as exc:
                if on_busy == "skip":
                    log.info(
                        "locked.skipped task=%s resources=%s",
                        label,
                        ",".join(exclusive_names + shared_names),
                    )
                    return None
                if on_busy == "retry":
                    if task is None or not hasattr(task, "retry"):
                        raise
                    retries = int(getattr(task.request, "retries", 0) or 0)
                    countdown = min(retry_backoff_max, retry_countdown * retry_backoff**retries)
                    if retry_jitter:
                        countdown = countdown * (0.5 + random.random() / 2)
                    opts: dict[str, Any] = {"countdown": countdown, "exc": exc}
                    if max_retries is not _DEFAULT:
                        opts["max_retries"] = max_retries
                    limit = max_retries if max_retries is not _DEFAULT else task.max_retries
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
            token = _leases.set(_leases.get() + (lease,))
            try:
                return fun(*args, **kwargs)
            finally:
                _leases.reset(token)
                try:
                    lease.release()
                except LockError as exc:  # the engine retries a deferred release
                    log.error(
                        "locked.release-error task=%s resources=%s error=%r",
                        label,
                        ",".join(lease.resources),
                        exc,
                    )

        wrapper.__signature__ = sig  # type: ignore[attr-defined]
        wrapper.__redislock__ = {  # type: ignore[attr-defined]
            "exclusive": ex,
            "shared": sh,
            "on_busy": on_busy,
        }
        return wrapper  # type: ignore[return-value]

    return decorate
