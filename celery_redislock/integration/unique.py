"""``UniqueTask``: at most one queued-or-running task per unique key.

::

    @app.task(base=UniqueTask, unique_key="report:{user_id}")
    def report(user_id): ...

    r1 = report.delay(7)
    r2 = report.delay(7)      # r2.id == r1.id while r1 is queued or running

The key ``unique:<key>`` is a lock of the engine. ``apply_async`` (and so
``delay``, signatures and canvas, which call it) takes it for the task owner
``task:<task id>`` before the message is sent, without waiting; a duplicate
gets the existing task's result handle (``unique_on_duplicate="return"``)
or :class:`DuplicateTask` (``"raise"``). The task owner's liveness is
``unique_ttl`` (plus any countdown or eta): the time the message may spend
in the broker. When the worker starts the task, the process that runs it
adopts the key (:meth:`LockManager.adopt`), and from then on the key lives
and dies with that process like any lock: freed when the task ends in any
way, or when the process or its worker dies (the node's cleanup, within a
heartbeat tick). A message that never runs frees its key after
``unique_ttl``; one revoked or expired before it starts frees it at once
(``task_revoked`` in the worker).

See docs/unique.md for the lifecycle, the chaos cases and what each
option of celery-once and celery-singleton maps to.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timezone
from decimal import Decimal
from typing import Any, Union

from celery import Task, signals

from .. import _validate as _v
from ..engine.lease import Lease
from ..engine.manager import TaskGrant
from ..exceptions import (
    ConfigurationError,
    DuplicateTask,
    LockError,
    LockTimeout,
    ReplicationTimeout,
)
from ..protocol.keys import TASK_OWNER_PREFIX
from ..worker.node import free_dead_member
from .app import RedisLock
from .deferred import DeferHooks, defer_hooks, defers, reset_defer_hooks
from .templates import bind_arguments, check_fields, format_all, holder_info, template_list

log = logging.getLogger("celery_redislock.unique")

#: Prefix of the resource a unique key is locked as.
UNIQUE_PREFIX = "unique:"
#: Values of ``unique_on_duplicate``.
ON_DUPLICATE_MODES = ("return", "raise")
#: The options ``apply_async`` takes per call (keyword arguments that
#: override the task attribute of the same name for that call only).
PER_CALL_OPTIONS = ("unique_on_duplicate", "unique_ttl")
#: Longest default key kept readable; a longer one is hashed (sha256).
MAX_PLAIN_KEY = 200


class _KeyHold:
    """The unique key of one run of a task, in the process running it.

    ``lease``: the key once this process took it over (None before, or
    when the task runs without it). A deferred task (``@locked(on_busy=
    "defer")``) takes it over only when its body starts: until then the
    key stays with the message's task owner, ``task:<id>`` (attempt
    ``attempt``), also while the task is parked (:meth:`parked`).
    """

    def __init__(self, task: UniqueTask, request: Any, args: Any, kwargs: Any) -> None:
        self.task = task
        self.request = request
        self.args = args
        self.kwargs = kwargs
        self.task_id = str(request.id)
        self.attempt = int(request.retries or 0)
        self.lease: Lease | None = None
        #: What happened to a deferred run: '' (nothing yet), 'taken' (the
        #: body started), 'parked', 'dropped' (a duplicate copy), 'freed'.
        self.state = ""

    def take(self) -> None:
        """Take the key over from the task owner (the body is about to run)."""
        if self.state == "taken":
            return
        self.state = "taken"
        self.lease = self._take_over()

    def parked(self, seconds: float) -> None:
        """The task was parked: the task owner keeps the key while it waits.

        One acquire for the task owner, which already holds the key (the
        same request: its grant is answered again) and whose liveness is
        set to cover the park (or which takes the key again if its liveness
        ran out while the message was queued and the key is free).
        """
        self.state = "parked"
        task = self.task
        try:
            locks = RedisLock.for_task(task)
            key = task.unique_key_for(self.args, self.kwargs)
            ttl = max(float(seconds), _key_ttl(task, locks, {}))
            grant = locks.manager.acquire_for_task(
                self.task_id,
                UNIQUE_PREFIX + key,
                ttl=min(_v.MAX_OWNER_TTL, ttl),
                attempt=self.attempt,
                holder=f"{task.name}\n{self.task_id}\n",
            )
        except Exception as exc:  # the task stays parked; its key follows its TTL
            log.error(
                "unique.park-key-error task=%s id=%s error=%r: the key is not held "
                "for the parked task",
                task.name,
                self.task_id,
                exc,
            )
            return
        if not grant.granted:
            log.warning(
                "unique.parked-without-key task=%s id=%s key=%s holder=%s: another task "
                "holds the key; this one stays parked and runs anyway",
                task.name,
                self.task_id,
                key,
                grant.holder_task_id or grant.holder_owner,
            )

    def dropped(self) -> None:
        """This copy of the message was dropped: the key is the other copy's."""
        self.state = "dropped"

    def free_unused(self) -> None:
        """A deferred run that ended before its body, neither parked nor
        dropped (an error, a shutdown): free the task owner's key."""
        if self.state:
            return
        self.state = "freed"
        try:
            RedisLock.for_task(self.task).manager.release_task(self.task_id, self.attempt)
        except Exception as exc:
            log.error(
                "unique.release-error task=%s id=%s error=%r (the key is freed after unique_ttl)",
                self.task.name,
                self.task_id,
                exc,
            )

    def _abandon(self, mgr: Any, task_id: str, attempt: int) -> None:
        try:
            adoption = mgr.adopt(task_id, attempt)
            for lease in adoption.leases:
                lease.release()
        except BaseException as exc:
            log.error(
                "unique.adopt-interrupted id=%s error=%r: the key is freed when this "
                "process ends (or by reconcile after its liveness)",
                task_id,
                exc,
            )
            if not isinstance(exc, Exception):
                raise

    def _take_over(self) -> Lease | None:
        """Adopt the key from the task owner; or take it afresh; or run without.

        A message whose key was not adopted (its task owner expired while
        queued, or it is redelivered after the process that adopted it died)
        takes the key for this process without waiting. If another task
        holds it meanwhile, the task still runs (it was sent): logged.
        """
        task = self.task
        locks = RedisLock.for_task(task)
        mgr = locks.manager
        task_id = self.request.id
        attempt = self.attempt
        try:
            adoption = mgr.adopt(
                task_id, attempt, holder=holder_info(task, task.name, locks.nodename)
            )
        except ReplicationTimeout as exc:
            # Adopted, then released again (too few replicas have it): the
            # task runs without its key, as when another task holds it.
            log.warning(
                "unique.run-without-key task=%s id=%s adopt=replication-short: %s",
                task.name,
                task_id,
                exc,
            )
            return None
        except BaseException:
            # Interrupted (a soft time limit, a kill) maybe after Redis moved
            # the key to this process: adopt again (idempotent: the same
            # grants come back) and release them, or this long-lived process
            # would keep the key until it exits.
            self._abandon(mgr, task_id, attempt)
            raise
        if adoption.adopted and adoption.leases:
            for extra in adoption.leases[1:]:  # a unique task's owner holds one grant
                extra.release()
            return adoption.leases[0]
        if adoption.by is not None:
            # Adopted by a process that may have died (this is a redelivery):
            # if it was a process of this worker, the node frees it within a
            # tick; don't race that clean-up, do it.
            free_dead_member(mgr, adoption.by)
        key = task.unique_key_for(self.args, self.kwargs)
        try:
            with mgr.context.using(
                request_id=TASK_OWNER_PREFIX + task_id,
                holder=holder_info(task, task.name, locks.nodename),
            ):
                lease = mgr.acquire(UNIQUE_PREFIX + key, timeout=0)
        except LockTimeout:
            log.warning(
                "unique.run-without-key task=%s id=%s key=%s adopt=%s: another task holds the "
                "key; this one runs anyway (it was sent)",
                task.name,
                task_id,
                key,
                adoption.status,
            )
            return None
        log.info(
            "unique.key-retaken task=%s id=%s key=%s adopt=%s",
            task.name,
            task_id,
            key,
            adoption.status,
        )
        return lease


#: The unique key of each task running in this thread or greenlet (task id
#: -> its hold), so that a retry sent from the body hands the key on to its
#: next message.
_running: contextvars.ContextVar[tuple[tuple[str, _KeyHold], ...]] = contextvars.ContextVar(
    "celery_redislock_unique", default=()
)


#: What ``unique_key_encoder`` may be: a callable from a value to JSON data,
#: or a ``json.JSONEncoder`` subclass (its ``default`` is used).
KeyEncoder = Union[Callable[[Any], Any], "type[json.JSONEncoder]"]


def normalise_key_value(value: Any) -> Any:
    """A ``unique_key_encoder`` that gives a value the key of its text form.

    ``uuid.UUID`` and ``decimal.Decimal``: their ``str()``;
    ``datetime``, ``date`` and ``time``: their ``isoformat()`` (what
    Celery's JSON serializer sends). So ``f.delay(u)`` and
    ``f.delay(str(u))`` are one key, and a ``Decimal("1.5")`` and ``"1.5"``
    too (``Decimal("1.50")`` is another: its ``str()`` differs); an aware
    datetime keeps its offset (the same instant in two time zones is two
    keys). Any other value raises TypeError: the default key's own rule
    applies to it (its ``repr``).
    """
    if isinstance(value, uuid.UUID | Decimal):
        return str(value)
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    raise TypeError(f"no key form for {type(value).__qualname__}")


def _encoder_of(hook: Any, where: str) -> Callable[[Any], Any] | None:
    """The callable of a ``unique_key_encoder`` (None for None); refuses
    anything else with :class:`ConfigurationError`."""
    if hook is None:
        return None
    if isinstance(hook, type) and issubclass(hook, json.JSONEncoder):
        return hook().default
    if isinstance(hook, staticmethod):
        hook = hook.__func__
    if callable(hook) and not isinstance(hook, type):
        return hook  # type: ignore[no-any-return]
    raise ConfigurationError(
        where,
        f"must be a callable (value -> JSON data) or a json.JSONEncoder subclass, not {hook!r}",
    )


def _stable(
    value: Mapping[str, Any],
    task: str = "the task",
    encoder: Callable[[Any], Any] | None = None,
) -> str:
    """The default key's text of the bound arguments ``value`` (name -> value):
    the same for equal arguments in every process (whatever the hash seed).

    JSON with sorted keys and no whitespace, as ever for what JSON holds. A
    dict whose keys JSON cannot sort or hold (mixed types, tuples) becomes
    ``{"__dict__": [[key, value], ...]}`` and a set ``{"__set__": [...]}``,
    their entries sorted by their own text; any other value is its
    ``repr``, unless ``encoder`` (the task's ``unique_key_encoder``) turns
    it into JSON data first (raising TypeError for a value it leaves to the
    ``repr``). Raises TypeError, naming the argument, for a value whose repr
    names a memory address (it differs in every process).
    """
    canonical = {name: _canonical(v, task, name, "", encoder) for name, v in value.items()}
    return _dumps(canonical)


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _canonical(
    value: Any,
    task: str,
    name: str,
    where: str,
    encoder: Callable[[Any], Any] | None = None,
) -> Any:
    """``value`` as JSON data that does not depend on the process (see :func:`_stable`)."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, task, name, f"{where}[{i}]", encoder) for i, v in enumerate(value)]
    if isinstance(value, dict):
        items = {k: _canonical(v, task, name, f"{where}[{k!r}]", encoder) for k, v in value.items()}
        if all(k is None or isinstance(k, (str, int, float)) for k in items):
            try:
                sorted(items)  # what json's sort_keys does
                return items
            except TypeError:
                pass
        pairs = [
            [_canonical(k, task, name, f"{where} (a key)", encoder), v] for k, v in items.items()
        ]
        return {"__dict__": sorted(pairs, key=lambda kv: _dumps(kv[0]))}
    if isinstance(value, (set, frozenset)):
        members = [_canonical(v, task, name, f"{where} (a member)", encoder) for v in value]
        return {"__set__": sorted(members, key=_dumps)}
    if encoder is not None:
        try:
            encoded = encoder(value)
        except TypeError:
            pass  # not the encoder's: the rule below
        else:
            if type(encoded) is type(value):
                raise TypeError(
                    f"{task}: unique_key_encoder returned a {type(value).__qualname__} for "
                    f"argument {name!r}{where}, the type it was given; it must return JSON "
                    "data (str, int, float, None, list, dict) or raise TypeError"
                )
            return _canonical(encoded, task, name, where, encoder)
    text = repr(value)
    if " at 0x" in text:
        raise TypeError(
            f"{task}: the default unique key needs arguments whose text is the same in "
            f"every process, and argument {name!r}{where} is a {type(value).__qualname__} "
            f"whose repr names a memory address ({text[:80]}); give the task a unique_key "
            f"template instead (e.g. unique_key='{task}:{{{name}.id}}')"
        )
    return text


def _call_options(task: UniqueTask, options: dict[str, Any]) -> tuple[str, float | None]:
    """Take the per-call ``unique_*`` options out of ``options`` (so that
    Celery's ``apply_async`` never sees them), checked: ``(on_duplicate,
    ttl)``, the task's attributes where not given. Raises
    :class:`ConfigurationError` for an unknown ``unique_*`` keyword or a bad
    value, before any Redis call."""
    given = {k: options.pop(k) for k in [k for k in options if k.startswith("unique_")]}
    unknown = sorted(set(given) - set(PER_CALL_OPTIONS))
    if unknown:
        why = (
            "the worker derives the key from the task's unique_key, so it cannot change "
            "per call (give the task another template, or use another task)"
            if unknown == ["unique_key"]
            else f"unknown option; apply_async takes {', '.join(PER_CALL_OPTIONS)} per call"
        )
        raise ConfigurationError(f"{task.name}.apply_async({', '.join(unknown)}=...)", why)
    # None: the task's own (as if not given).
    mode = given.get("unique_on_duplicate")
    if mode is None:
        mode = task.unique_on_duplicate
    if mode not in ON_DUPLICATE_MODES:
        raise ConfigurationError(
            f"{task.name}.apply_async(unique_on_duplicate=...)",
            f"must be one of {', '.join(ON_DUPLICATE_MODES)}, not {mode!r}",
        )
    ttl = given.get("unique_ttl")
    if ttl is None:
        ttl = task.unique_ttl
    else:
        ttl = _v.duration(
            f"{task.name}.apply_async(unique_ttl=...)",
            ttl,
            minimum=_v.MIN_OWNER_TTL,
            maximum=_v.MAX_OWNER_TTL,
        )
    return mode, ttl


def _check_options(cls: type) -> None:
    """Refuse bad ``unique_*`` attributes when the task class is made (import time)."""
    name = getattr(cls, "name", None) or cls.__qualname__
    key = cls.__dict__.get("unique_key")
    if key is not None:
        [template] = template_list(f"{name}.unique_key", key)
        run = cls.__dict__.get("run")
        fun = getattr(run, "__func__", run)
        if fun is not None and callable(fun):
            try:
                sig = inspect.signature(fun)
            except (TypeError, ValueError):
                sig = None
            if sig is not None:
                check_fields([template], sig, f"{name}.unique_key")
    ttl = cls.__dict__.get("unique_ttl")
    if ttl is not None:
        _v.duration(f"{name}.unique_ttl", ttl, minimum=_v.MIN_OWNER_TTL, maximum=_v.MAX_OWNER_TTL)
    if "unique_key_encoder" in cls.__dict__:
        _encoder_of(cls.__dict__["unique_key_encoder"], f"{name}.unique_key_encoder")  # checked
    mode = cls.__dict__.get("unique_on_duplicate")
    if mode is not None and mode not in ON_DUPLICATE_MODES:
        raise ConfigurationError(
            f"{name}.unique_on_duplicate",
            f"must be one of {', '.join(ON_DUPLICATE_MODES)}, not {mode!r}",
        )


class UniqueTask(Task):
    """A Task base: at most one task per unique key is queued or running.

    Options, as task attributes (``@app.task(base=UniqueTask, unique_key=...)``):

    ``unique_key``
        A ``str.format`` template over the task's bound arguments (defaults
        applied), e.g. ``"report:{user_id}"``; fields name parameters, as in
        ``@locked``. Default (None): the task name and every argument,
        normalised, so ``f.delay(1)`` and ``f.delay(x=1)`` are the same key
        (a key longer than 200 characters is hashed).
    ``unique_key_encoder``
        How the default key writes an argument JSON does not hold: None
        (default) its ``repr``, as ever (so ``uuid.UUID(x)`` and ``x`` are
        two keys); or a callable from such a value to JSON data, raising
        TypeError for values it leaves to the ``repr``, such as
        :func:`normalise_key_value` (UUID, Decimal, datetime: their text
        form); or a ``json.JSONEncoder`` subclass (its ``default``).
        Changing it changes the keys of such arguments: see docs/unique.md.
    ``unique_ttl``
        Seconds the key is held for a message no worker has started yet
        (queued, or its producer died before sending it); a countdown or
        eta is added. Default: the ``redislock_unique_ttl`` setting (1 hour).
        A running task's key does not expire: it lives with its process.
    ``unique_on_duplicate``
        ``"return"`` (default): ``apply_async`` / ``delay`` return the
        ``AsyncResult`` of the task that holds the key; nothing is sent.
        ``"raise"``: raise :class:`DuplicateTask` (with its ``task_id``).

    ``unique_ttl`` and ``unique_on_duplicate`` can also be given to one
    call, ``task.apply_async(args, kwargs, unique_on_duplicate="raise",
    unique_ttl=60)`` (or a signature's options): they override the
    attributes for that call only and are not passed on to Celery.
    ``unique_key`` cannot (the worker derives the key from the attribute);
    any other ``unique_*`` keyword is refused with
    :class:`ConfigurationError` before any Redis call.

    The key is freed when the task ends (success, failure, exhausted
    retries, soft time limit), when the process running it dies (hard time
    limit, revoke with terminate, a crash: the worker's node frees it within
    a heartbeat tick; a dead worker's after its owners' liveness expires),
    when a revoked or expired message is discarded by a worker, and after
    ``unique_ttl`` for a message that never runs. A retry hands the key on
    to the retry's message. Works with ``@locked`` on the same task.
    """

    unique_key: str | None = None
    unique_key_encoder: KeyEncoder | None = None
    unique_ttl: float | None = None
    unique_on_duplicate: str = "return"
    #: Marks unique tasks for the worker's ``task_revoked`` handler.
    _redislock_unique = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_options(cls)

    @property
    def unique_lease(self) -> Lease | None:
        """The lease of the running task's unique key, in its body; else None.

        Its ``fencing_token`` orders this run against every other holder of
        the key; ``lost`` / ``check()`` say whether this process lost its
        liveness (the key may then belong to a newer task). None outside
        the body, or when the task runs without its key (see
        ``unique.run-without-key``).
        """
        request_id = self.request.id
        hold = dict(_running.get()).get(request_id) if request_id else None
        return hold.lease if hold is not None else None

    # -- the key ----------------------------------------------------------

    def unique_key_for(self, args: Any = None, kwargs: Any = None) -> str:
        """The unique key of a call with ``args`` and ``kwargs`` (no prefix).

        Raises TypeError when the arguments do not fit the task's signature,
        :class:`TemplateError` when ``unique_key`` cannot be formatted.
        """
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        mapping = bind_arguments(inspect.signature(self.run), args, kwargs, self.name)
        if self.unique_key is not None:
            [key] = format_all([self.unique_key], mapping, f"{self.name}.unique_key")
            return key
        encoder = _encoder_of(
            # A function set as a class attribute is read as it is, not bound.
            inspect.getattr_static(self, "unique_key_encoder", None),
            f"{self.name}.unique_key_encoder",
        )
        text = _stable(mapping, self.name, encoder)
        key = f"{self.name}:{text}"
        if len(key) > MAX_PLAIN_KEY:
            key = f"{self.name}:sha256:{hashlib.sha256(text.encode()).hexdigest()}"
        return key

    # -- enqueue ----------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Send the task unless one with its unique key is queued or running.

        Takes ``unique:<key>`` for the task owner ``task:<task id>`` (one
        round trip, never waits). Duplicate: the holder's ``AsyncResult``,
        or :class:`DuplicateTask` (see the class doc). If sending fails, the
        key is released before the error propagates.

        ``unique_on_duplicate`` and ``unique_ttl`` in ``options`` override
        the task's attributes for this call (taken out of the options Celery
        sees); another ``unique_*`` keyword raises
        :class:`ConfigurationError`.
        """
        on_duplicate, unique_ttl = _call_options(self, options)
        locks = RedisLock.for_task(self)
        mgr = locks.manager
        key = self.unique_key_for(args, kwargs)
        resource = UNIQUE_PREFIX + key
        explicit_id = task_id is not None
        task_id = task_id or str(uuid.uuid4())
        attempt = int(options.get("retries") or 0)
        ttl = _key_ttl(self, locks, options, unique_ttl)
        if attempt:
            _hand_on(task_id)
        try:
            grant = mgr.acquire_for_task(
                task_id, resource, ttl=ttl, attempt=attempt, holder=f"{self.name}\n{task_id}\n"
            )
        except ReplicationTimeout:
            if not attempt:
                raise  # not sent: too few replicas have the key (released again)
            grant = TaskGrant(task_id, False, None, None, None)  # a retry runs anyway
        if grant.repeated and explicit_id and not attempt:
            # This very task id holds the key already: it was sent before.
            # (Only for an id the caller chose: a fresh uuid cannot repeat,
            # short of redis-py resending the call after a lost reply.)
            return self._duplicate(key, task_id, on_duplicate)
        if not grant.granted:
            existing = grant.holder_task_id
            if attempt:
                # A retry must still run; its key is taken by a newcomer that
                # slipped in during the hand-on (or a plain lock).
                log.warning(
                    "unique.retry-without-key task=%s id=%s key=%s holder=%s",
                    self.name,
                    task_id,
                    key,
                    existing or grant.holder_owner,
                )
            else:
                return self._duplicate(key, existing, on_duplicate, grant.holder_ttl)
        try:
            return super().apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=producer,
                link=link,
                link_error=link_error,
                shadow=shadow,
                **options,
            )
        except BaseException:
            if grant.granted:
                _release_unsent(self, mgr, task_id, attempt, key)
            raise

    def _duplicate(
        self, key: str, existing: str | None, mode: str, countdown: float | None = None
    ) -> Any:
        if existing is not None and mode == "return":
            log.info("unique.duplicate task=%s key=%s existing=%s", self.name, key, existing)
            return self.AsyncResult(existing)
        raise DuplicateTask(key, existing, self.name, countdown)

    # -- run --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or not request.id:
            return super().__call__(*args, **kwargs)
        hold = _KeyHold(self, request, args, kwargs)
        hooks = None
        if defers(self, self.run):
            # @locked(on_busy="defer"): the key stays with the message's task
            # owner until the body starts (it may park first, and run later
            # in another process, which takes the key over then).
            hooks = defer_hooks(request.id, DeferHooks(hold.take, hold.parked, hold.dropped))
        else:
            hold.take()
        token = _running.set((*_running.get(), (request.id, hold)))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _running.reset(token)
            if hooks is not None:
                reset_defer_hooks(hooks)
                hold.free_unused()
            lease = hold.lease
            if lease is not None and not lease.released:
                try:
                    lease.release()
                except LockError as exc:  # the engine retries a deferred release
                    log.error(
                        "unique.release-error task=%s id=%s error=%r", self.name, request.id, exc
                    )


def _hand_on(task_id: str) -> None:
    """A retry sent from the running body: hand the key on from this
    process to the retry's message (its own task owner)."""
    hold = dict(_running.get()).get(task_id)
    if hold is not None and hold.lease is not None and not hold.lease.released:
        hold.lease.release()
    elif hold is not None:
        hold.free_unused()  # a deferred run's key, still its task owner's


def _release_unsent(task: UniqueTask, mgr: Any, task_id: str, attempt: int, key: str) -> None:
    """The message was not sent: free the key its task owner took for it."""
    try:
        mgr.release_task(task_id, attempt)
    except LockError as exc:
        log.error(
            "unique.release-error task=%s id=%s key=%s error=%r "
            "(the key is freed after unique_ttl)",
            task.name,
            task_id,
            key,
            exc,
        )


def _key_ttl(
    task: UniqueTask,
    locks: RedisLock,
    options: Mapping[str, Any],
    unique_ttl: float | None = None,
) -> float:
    """Seconds the task owner holds ``task``'s key for a message sent with
    ``options``: ``unique_ttl`` (the call's, else the task's, else the
    setting) plus any countdown or eta."""
    if unique_ttl is None:
        unique_ttl = task.unique_ttl
    ttl = unique_ttl if unique_ttl is not None else locks.config.unique_ttl
    delay = 0.0
    countdown = options.get("countdown")
    eta = options.get("eta")
    if countdown:
        delay = float(countdown)
    elif eta is not None:
        if isinstance(eta, str):
            eta = datetime.fromisoformat(eta)
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=timezone.utc)
        delay = (eta - datetime.now(timezone.utc)).total_seconds()
    return min(_v.MAX_OWNER_TTL, float(ttl) + max(0.0, delay))


def release_withdrawn(app: Any, manager: Any, task_id: str, message: Mapping[str, Any]) -> None:
    """Worker: a parked unique task was withdrawn (revoked, expired, its park
    timed out): free its key, which its task owner held while it was parked.

    ``manager``: the caller's (the dispatcher's, on its own connections).
    """
    task = app.tasks.get(str(message.get("name") or ""))
    if task is None or not getattr(task, "_redislock_unique", False):
        return
    attempt = int((message.get("options") or {}).get("retries") or 0)
    try:
        report = manager.release_task(task_id, attempt)
    except Exception as exc:  # its liveness frees it
        log.error("unique.withdrawn-release-error id=%s error=%r", task_id, exc)
        return
    if report.released:
        log.info("unique.withdrawn-released id=%s locks=%d", task_id, report.released)


def on_task_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Worker: a unique task revoked or expired before it ran frees its key.

    Runs in the worker's main process when it discards the message. For a
    task already running (revoked with terminate), the key was adopted: the
    process holding it frees it when it ends or dies. Connected to
    ``task_revoked`` when this module is imported, as it is before any
    ``UniqueTask`` exists.
    """
    if sender is None or request is None or not getattr(sender, "_redislock_unique", False):
        return
    task_id = getattr(request, "id", None)
    if not task_id:
        return
    try:
        locks = RedisLock.for_task(sender)
        report = locks.manager.release_task(task_id, int(getattr(request, "retries", 0) or 0))
    except Exception as exc:  # never break the worker's revoke path
        log.error("unique.revoke-release-error id=%s error=%r", task_id, exc)
        return
    if report.released:
        log.info("unique.revoked-released id=%s locks=%d", task_id, report.released)


# Next to the code it serves: any process that has a UniqueTask imported this
# module first. Other tasks' revokes cost one getattr.
signals.task_revoked.connect(on_task_revoked, weak=False, dispatch_uid="celery_redislock.unique")
