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

This module holds the decorator and the wait of a call; the templates are
checked and formatted by :mod:`celery_redislock.templates`, the body runs
through :mod:`celery_redislock.body`, and ``on_busy="defer"`` takes
:mod:`celery_redislock.deferred`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# A name imported "as" itself is re-exported: importable from this module,
# where it was defined before the body runner, the defer path and the
# templates had modules of their own.
from .. import _validate as _v
from ..engine.manager import RequestMoved
from ..exceptions import ConfigurationError, InvalidResource, LockTimeout, ShuttingDown
from ..protocol.request import MAX_LIMIT
from .app import RedisLock
from .body import BodyRun, hand_back, holding, in_locked_body, run_body, upkeep_if_due
from .body import current_lease as current_lease
from .deferred import DeferHooks as DeferHooks
from .deferred import (
    carries_grant,
    deferrable,
    drop_redelivered_wait,
    parked_behind_transit,
    preceded_by,
    run_deferred,
    task_hooks,
    transit_hook,
)
from .deferred import defer_hooks as defer_hooks
from .deferred import deferred_run_ended as deferred_run_ended
from .deferred import defers as defers
from .deferred import reset_defer_hooks as reset_defer_hooks
from .settings import APP_DEFAULT, ON_BUSY_MODES, ON_LOST_MODES
from .templates import (
    ArgumentBinder,
    check_fields,
    check_templates,
    format_all,
    holder_record,
    template_list,
)
from .templates import TemplateError as TemplateError
from .templates import holder_info as holder_info

log = logging.getLogger("celery_redislock.task")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class _Retry:
    """The countdown of ``on_busy="retry"`` (its defaults filled in)."""

    countdown: float
    backoff: float
    backoff_max: float
    jitter: bool
    #: ``APP_DEFAULT``: the task's own ``max_retries``.
    max_retries: Any

    def countdown_for(self, retries: int) -> float:
        countdown = min(self.backoff_max, self.countdown * self.backoff**retries)
        if self.jitter:
            countdown = countdown * (0.5 + random.random() / 2)
        return countdown


@dataclass(frozen=True)
class _Options:
    """What one ``@locked(...)`` was given, validated (:func:`_options`).

    ``timeout``, ``on_busy`` and ``on_lost`` may be ``APP_DEFAULT``: the
    app's setting, read at each call.
    """

    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    timeout: Any
    on_busy: Any
    on_lost: Any
    retry: _Retry
    #: ``limited=`` as given (checked with the function: :func:`_limited`).
    limited_given: Any = None
    #: The limited templates and their limits, once checked.
    limited: tuple[tuple[str, int], ...] = ()

    def spec(self) -> dict[str, Any]:
        """The wrapper's ``__redislock__`` (what ``UniqueTask`` reads)."""
        return {
            "exclusive": self.exclusive,
            "shared": self.shared,
            "limited": dict(self.limited),
            "on_busy": None if self.on_busy is APP_DEFAULT else self.on_busy,
            "on_lost": None if self.on_lost is APP_DEFAULT else self.on_lost,
        }


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


def _templates(
    exclusive: tuple[Any, ...], shared: Any, limited: Any = None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    ex = check_templates("locked", exclusive)
    sh = template_list("locked(shared=)", shared)
    if not ex and not sh and not limited:
        raise ConfigurationError("locked", "needs at least one resource template")
    both = sorted(set(ex) & set(sh))
    if both:
        raise ConfigurationError(
            "locked",
            f"templates {both} are both exclusive and shared; an exclusive lock "
            "already covers reading: drop them from shared=",
        )
    return ex, sh


def _limited(opts: _Options, label: str) -> tuple[tuple[str, int], ...]:
    """``limited=`` of the ``@locked`` of ``label``, checked when it decorates
    the function: a mapping of templates to an int limit from 1 to
    ``MAX_LIMIT``, none of them also
    an exclusive or shared template."""
    given = opts.limited_given
    setting = f"locked(limited=) of {label}"
    if given is None:
        return ()
    if not isinstance(given, Mapping):
        raise ConfigurationError(
            setting,
            "must be a dict of resource template to its limit, e.g. "
            f"limited={{'api:{{partner}}': 5}}, not {type(given).__name__} {given!r}",
        )
    out: list[tuple[str, int]] = []
    for template, limit in given.items():
        (template,) = check_templates(setting, [template])
        if type(limit) is not int or not 1 <= limit <= MAX_LIMIT:
            raise ConfigurationError(
                setting,
                f"the limit of {template!r} must be an int from 1 to {MAX_LIMIT} "
                f"(how many tasks may hold it at once), not {limit!r}",
            )
        if template in opts.exclusive or template in opts.shared:
            kind = "exclusive" if template in opts.exclusive else "shared"
            raise ConfigurationError(
                setting,
                f"template {template!r} is also {kind}; a resource is taken limited "
                "or exclusive/shared, never both: drop it from one of them",
            )
        out.append((template, limit))
    return tuple(out)


def _mode(option: str, value: Any, modes: tuple[str, ...]) -> None:
    if value is not APP_DEFAULT and (not isinstance(value, str) or value not in modes):
        raise ConfigurationError(
            f"locked({option}=)", f"must be one of {', '.join(modes)}, not {value!r}"
        )


def _timeout(timeout: Any, on_busy: Any) -> Any:
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
    return timeout


#: The retry options of ``@locked`` and their defaults.
_RETRY_DEFAULTS = {
    "retry_countdown": 5.0,
    "retry_backoff": 2.0,
    "retry_backoff_max": 600.0,
    "retry_jitter": True,
    "max_retries": APP_DEFAULT,
}


def _retry(on_busy: Any, given: dict[str, Any]) -> _Retry:
    named = [name for name, value in given.items() if value is not APP_DEFAULT]
    if named and on_busy != "retry":
        raise ConfigurationError(
            f"locked({named[0]}=)",
            f"applies to on_busy='retry' only (on_busy={on_busy!r}); "
            "add on_busy='retry' or drop it",
        )
    v = {k: _RETRY_DEFAULTS[k] if x is APP_DEFAULT else x for k, x in given.items()}
    _number("locked(retry_countdown=)", v["retry_countdown"], 0, "seconds >= 0")
    _number(
        "locked(retry_backoff=)",
        v["retry_backoff"],
        1,
        "a factor >= 1 (1: the same countdown each time)",
    )
    _number("locked(retry_backoff_max=)", v["retry_backoff_max"], 0, "seconds >= 0")
    jitter, max_retries = v["retry_jitter"], v["max_retries"]
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
    return _Retry(
        v["retry_countdown"], v["retry_backoff"], v["retry_backoff_max"], jitter, max_retries
    )


def _options(
    exclusive: tuple[Any, ...],
    shared: Any,
    timeout: Any,
    on_busy: Any,
    on_lost: Any,
    retry: dict[str, Any],
    limited: Any = None,
) -> _Options:
    """Validate ``@locked``'s arguments (when decorating: at import time;
    ``limited`` is checked with the function, :func:`_limited`)."""
    ex, sh = _templates(exclusive, shared, limited)
    _mode("on_lost", on_lost, ON_LOST_MODES)
    _mode("on_busy", on_busy, ON_BUSY_MODES)
    timeout = _timeout(timeout, on_busy)
    return _Options(ex, sh, timeout, on_busy, on_lost, _retry(on_busy, retry), limited)


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


def locked(
    *exclusive: str,
    shared: str | Iterable[str] = (),
    limited: Mapping[str, int] | None = None,
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
        limited: templates of *limited* resources and their limits, e.g.
            ``{"api:{partner}": 5}``: the task takes one slot of each, granted
            only while fewer than that many tasks (on any worker) hold the
            resource, first come, first served, all at once with the
            exclusive and shared ones. A limit is an int from 1 to
            ``MAX_LIMIT`` (10 000). A resource
            is only ever taken limited or exclusive/shared: a name formatted
            both ways by one call raises :class:`InvalidResource`, and one
            held or waited for in the other kind by another task too.
            Every ``on_busy`` mode applies (``"defer"`` parks the task in
            line for a slot, without a pool slot).
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
            one template both exclusive and shared (or limited and either),
            a ``limited`` limit that is not an int from 1 to ``MAX_LIMIT``,
            or a bad option value.

    At call time, a template naming an argument the call lacks, or a value
    it cannot format, raises :class:`TemplateError` before anything is
    locked. The locks are released when the body returns
    or raises (including ``self.retry()`` and ``SoftTimeLimitExceeded``); a
    child killed by a hard time limit or revoke-terminate has its locks freed
    by the worker's main process within one heartbeat tick.
    """
    # Over 80 lines for its docstring only: the whole reference of @locked,
    # rendered in docs/api.md. The work is in _options and _decorate.
    opts = _options(
        exclusive,
        shared,
        timeout,
        on_busy,
        on_lost,
        {
            "retry_countdown": retry_countdown,
            "retry_backoff": retry_backoff,
            "retry_backoff_max": retry_backoff_max,
            "retry_jitter": retry_jitter,
            "max_retries": max_retries,
        },
        limited,
    )

    def decorate(fun: F) -> F:
        return _decorate(fun, opts)

    return decorate


def _decorate(fun: F, opts: _Options) -> F:
    """The wrapper Celery runs: each call binds, formats, locks and runs."""
    _check_target(fun)
    sig = inspect.signature(fun)
    label = getattr(fun, "__qualname__", repr(fun))
    opts = dataclasses.replace(opts, limited=_limited(opts, label))
    check_fields(opts.exclusive + opts.shared + tuple(t for t, _ in opts.limited), sig, label)
    binder = ArgumentBinder(sig, label)

    from celery import current_task

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call(opts, fun, binder, current_task, args, kwargs)

    wrapper.__signature__ = sig  # type: ignore[attr-defined]
    wrapper.__redislock__ = opts.spec()  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


@dataclass
class _Call:
    """One call of an ``@locked`` function: the task it runs in (None
    outside one), the resource names formatted from its arguments, its
    ``on_busy`` mode and the body to run (``fun`` preceded by a Task base's
    ``before_body`` hook, if any)."""

    opts: _Options
    label: str
    task: Any
    locks: RedisLock
    exclusive_names: list[str]
    shared_names: list[str]
    mode: str
    body: Callable[..., Any]
    args: Any
    kwargs: Any
    #: The limited resources and their limits.
    limited: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def resources(self) -> list[str]:
        return self.exclusive_names + self.shared_names + list(self.limited)

    @property
    def lost_mode(self) -> str:
        on_lost = self.opts.on_lost
        return str(self.locks.config.on_lost if on_lost is APP_DEFAULT else on_lost)


def _call(
    opts: _Options,
    fun: Callable[..., Any],
    binder: ArgumentBinder,
    current_task: Any,
    args: Any,
    kwargs: Any,
) -> Any:
    """One call of the wrapper: format the names, then take the deferred
    path or wait (:func:`_wait_and_run`)."""
    label = binder.label
    mapping = binder.bind(args, kwargs)
    exclusive_names = format_all(opts.exclusive, mapping, label)
    # A resource both exclusive and shared (two templates formatting
    # to one name) is locked exclusively: that covers reading too.
    shared_names = [n for n in format_all(opts.shared, mapping, label) if n not in exclusive_names]
    limited = _limited_names(opts, mapping, label, exclusive_names + shared_names)
    # The task being run (None outside one): one look-up of Celery's task
    # stack (_get_current_object is the documented way to unwrap a Proxy).
    task = current_task._get_current_object()  # noqa: SLF001
    locks = RedisLock.for_task(task)
    mode = locks.config.default_on_busy if opts.on_busy is APP_DEFAULT else opts.on_busy
    hooks = task_hooks(task)
    body = fun if hooks is None else preceded_by(fun, hooks.before_body)
    call = _Call(
        opts, label, task, locks, exclusive_names, shared_names, mode, body, args, kwargs, limited
    )
    # The task's own @locked (not one called in a @locked body: that
    # one re-enters the adopted grant) adopts a message's grant
    # whatever on_busy says: a waiting task parked behind a grant in
    # transit, then dispatched.
    outermost = not in_locked_body()
    if (mode == "defer" or (outermost and carries_grant(task))) and deferrable(task):
        return run_deferred(
            task,
            locks,
            label,
            exclusive_names,
            shared_names,
            opts.timeout,
            call.lost_mode,
            body,
            args,
            kwargs,
            hooks,
            limited,
        )
    return _wait_and_run(call, outermost)


def _limited_names(opts: _Options, mapping: Any, label: str, others: list[str]) -> dict[str, int]:
    """The limited resources of one call: name -> limit. A name also
    formatted as an exclusive or shared resource, or by two limited
    templates of different limits, raises :class:`InvalidResource`."""
    if not opts.limited:
        return {}
    templates = [t for t, _ in opts.limited]
    out: dict[str, int] = {}
    for (template, limit), name in zip(opts.limited, format_all(templates, mapping, label)):
        if name in others:
            raise InvalidResource(
                f"@locked of {label}: limited template {template!r} formats to {name!r}, "
                "which this call also takes exclusive or shared; a resource is taken "
                "limited or exclusive/shared, never both",
                name,
            )
        if out.get(name, limit) != limit:
            raise InvalidResource(
                f"@locked of {label}: limited templates format to {name!r} with two "
                f"limits ({out[name]} and {limit}); give one resource one limit",
                name,
            )
        out[name] = limit
    return out


@dataclass
class _Holder:
    """Who runs the call, for log lines and the holder record."""

    in_task: bool
    task_id: str
    #: The registered task's name (e.g. proj.sync) when there is one.
    task_label: str
    #: Recorded beside the grant (None: keep the thread's own).
    holder: str | None


def _holder(call: _Call) -> _Holder:
    task, label = call.task, call.label
    request = getattr(task, "request", None) if task is not None else None
    in_task = request is not None and not getattr(request, "called_directly", True)
    request_id = getattr(request, "id", None) if in_task else None
    task_label = str(getattr(task, "name", None) or label) if in_task else label
    # Who holds the locks, for operators (`redislock locks`): recorded
    # beside the grant only when a task takes them; every acquire the
    # body makes in this thread is labelled the same way.
    outer_holder = call.locks.manager.context.current().holder
    holder = (
        holder_record(task_label, request_id, call.locks.nodename, request)
        if in_task and outer_holder is None
        else None
    )
    return _Holder(in_task, str(request_id or "-"), task_label, holder)


def _wait_and_run(call: _Call, outermost: bool) -> Any:
    """Take the locks as ``on_busy`` says (wait, or try once), then run the body."""
    task, locks, label, mode = call.task, call.locks, call.label, call.mode
    if mode in ("wait", "defer"):
        wait = (
            locks.config.default_timeout if call.opts.timeout is APP_DEFAULT else call.opts.timeout
        )
    else:
        wait = 0
    mgr = locks.manager
    upkeep_if_due(mgr)
    lost_mode = call.lost_mode
    who = _holder(call)
    # A waiting task run by a worker gives its pool slot up when a
    # grant in transit waits ahead of it (docs/defer.md, T3).
    parked: list[Any] = []
    # Not a UniqueTask holding its key: the key lives with this
    # process, and parking would free it while the task is parked.
    take_over = None
    if (
        mode == "wait"
        and outermost
        and deferrable(task)
        and getattr(task, "unique_lease", None) is None
    ):
        drop_redelivered_wait(
            task, locks, label, call.exclusive_names, call.shared_names, call.limited
        )
        take_over = transit_hook(task, locks, label, wait, parked)
    try:
        # The body has not started: this wait may give way to a
        # warm shutdown (ShuttingDown, below).
        with holding(mgr, who.holder), mgr.context.using(haltable=True, take_over=take_over):
            lease = mgr.acquire(
                call.exclusive_names,
                call.shared_names,
                limited=call.limited or None,
                timeout=wait,
            )
    except RequestMoved as moved:
        return parked_behind_transit(
            task,
            locks,
            label,
            call.resources,
            lost_mode,
            call.body,
            call.args,
            call.kwargs,
            parked[0],
            moved,
        )
    except ShuttingDown as exc:
        hand_back(task, label, exc)
        raise
    except LockTimeout as exc:
        if mode == "skip":
            log.info("locked.skipped task=%s resources=%s", label, ",".join(call.resources))
            return None
        if mode == "retry" and task is not None and hasattr(task, "retry"):
            raise _retry_task(call, exc) from exc
        raise
    run = BodyRun(
        mgr,
        label,
        who.task_label,
        who.task_id,
        lost_mode,
        who.in_task,
        locks.pool_child_pid,
        who.holder,
    )
    return run_body(lease, run, call.body, call.args, call.kwargs)


def _retry_task(call: _Call, exc: LockTimeout) -> Any:
    """``on_busy="retry"``: ``task.retry()`` with the countdown (it raises)."""
    task, policy = call.task, call.opts.retry
    retries = int(getattr(task.request, "retries", 0) or 0)
    countdown = policy.countdown_for(retries)
    opts: dict[str, Any] = {"countdown": countdown, "exc": exc}
    if policy.max_retries is not APP_DEFAULT:
        opts["max_retries"] = policy.max_retries
    limit = policy.max_retries if policy.max_retries is not APP_DEFAULT else task.max_retries
    resources = ",".join(call.resources)
    if limit is not None and retries >= limit:
        # task.retry() raises the LockTimeout itself: no retry.
        log.warning(
            "locked.retries-exhausted task=%s resources=%s retries=%d "
            "max_retries=%d: failing with LockTimeout",
            call.label,
            resources,
            retries,
            limit,
        )
    else:
        log.info(
            "locked.retry task=%s resources=%s countdown=%.1f",
            call.label,
            resources,
            countdown,
        )
    return task.retry(**opts)
