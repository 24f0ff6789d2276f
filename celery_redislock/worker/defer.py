"""Deferred tasks (``@locked(on_busy="defer")``): park, dispatch, adopt.

A task whose resources are busy keeps its place in their FIFO queues as a
request of the *task owner* ``defer:<task id>`` and frees its pool slot; its
message is stored in Redis beside the request (the park record). When a
release hands the request its locks, the task id is pushed onto
``{ns}:dispatch``; a worker's main process (:class:`Dispatcher`) publishes
the task again with the same id and the grant's fence in a header, and the
pool child that receives it adopts the grant (:func:`adopt`) before the
body runs. docs/defer.md gives the algorithm and its races (D1-D11).

Engine side (:func:`park`, :func:`adopt`, :func:`mark_done`,
:func:`withdraw`) needs no Celery; the :class:`Dispatcher` publishes with
the Celery app.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kombu.utils import json as kjson

from .._threads import ThreadHandle, green, real_sleep, start_os_thread
from ..engine.lease import Lease
from ..engine.manager import REDIS_DOWN_ERRORS, LockManager
from ..exceptions import InvalidResource, LockError, RedisUnavailable, ReplicationTimeout
from ..protocol import defer_calls as dc
from ..protocol.calls import mode_refusal
from ..protocol.keys import defer_owner_id, holder_record, task_token, text
from ..protocol.request import Request
from ..store.connect import clone_client
from .node import free_dead_member

log = logging.getLogger("celery_redislock.defer")

#: Message header carrying the fence of the grant a re-dispatched task adopts.
HEADER = "redislock_defer"
#: Message header carrying when the task parked (``time.time()`` of the
#: parking process): the adopted grant's wait is measured from it (metrics).
PARKED_AT_HEADER = "redislock_parked_at"
#: State stored in the result backend while a task is parked.
DEFERRED = "DEFERRED"
#: Errors that mean Redis is out of reach (the dispatcher retries).
_DOWN: tuple[type[BaseException], ...] = (RedisUnavailable, *REDIS_DOWN_ERRORS)
#: Seconds the dispatcher waits after a failed pass before the next.
RETRY_PAUSE = 1.0
#: Slices of that pause: a stop is seen within one.
_PAUSE_SLICE = 0.05
#: Most due re-attempts one upkeep pass returns.
DUE_BATCH = 64
#: Most due deadlines (park and grant TTLs) one upkeep pass looks at; the
#: dead ones are withdrawn in the pass's script. A pass that reached either
#: limit is followed by another at once, not one interval later.
DEADLINE_BATCH = 64


def task_owner(task_id: str, life: int = 0) -> str:
    """The task owner of a park record's ``life``: ``defer:<task id>`` (life 0),
    ``defer+<life>:<task id>`` (:func:`keys.defer_owner_id`); ValueError if unusable."""
    return defer_owner_id(task_id, life)


def record_key(mgr: LockManager, task_id: str) -> str:
    """``{ns}:defer:<task id>``: the park record."""
    return mgr.keys.defer_record(task_id)


def deferred_key(mgr: LockManager) -> str:
    """``{ns}:deferred``: task id -> next re-attempt (ms, Redis TIME)."""
    return mgr.keys.deferred


def deadlines_key(mgr: LockManager) -> str:
    """``{ns}:deadlines``: task id -> its park or grant deadline (ms, Redis TIME)."""
    return mgr.keys.deadlines


def dispatch_key(mgr: LockManager) -> str:
    """``{ns}:dispatch``: task ids to dispatch."""
    return mgr.keys.dispatch


_ms = dc.ms


@dataclass
class ParkResult:
    """What :func:`park` did: ``parked``, ``granted`` (with the adopted
    leases, unless a dispatcher parked it) or ``duplicate``."""

    outcome: str
    leases: list[Lease] = field(default_factory=list)
    state: str = ""
    #: The record's life (``parked``/``granted``; -1 for a duplicate).
    life: int = -1


def _attempt_as_task(
    mgr: LockManager,
    token: str,
    req: Request,
    *,
    liveness_ms: str,
    register: str,
    holder: str = "",
) -> Any:
    """acquire.lua as the task owner of ``token`` (queue when blocked); its raw reply:
    ``{1, fence, ...}``, ``{0, wait_ms, why, reclaimed, transit}`` or ``{-1}``.

    ``holder``: who the task is (task name, id, node), kept with the queued
    request and, once granted, as its holder record in the registry."""
    call = mgr.protocol.acquire(
        token,
        req,
        queue=True,
        liveness_ms=liveness_ms,
        register=register,
        req_ttl=liveness_ms,  # the queued request's state lives as long as the park
        holder=holder,
    )
    reply = mgr.channel.run(call)
    mgr.acquirer.note_reclaimed(reply)  # dead holders' grants it freed (metrics only)
    return reply


def _park_fields(message: dict[str, Any], holder: str) -> dict[str, Any]:
    """``message`` with the task's holder record (when given) and ``parked_at``
    (when it first parked, unless it has it already)."""
    if holder:
        message = {**message, "holder": holder}
    if message.get("parked_at") is None:
        message = {**message, "parked_at": time.time()}
    return message


def _record_args(
    mgr: LockManager,
    task_id: str,
    min_life: int,
    req: Request,
    message: dict[str, Any],
    *,
    park_ttl: float,
    grant_ttl: float,
) -> list[str]:
    """ARGV 1-11 of ``defer_park.lua``; TypeError when the message does not
    encode as JSON (before anything is written)."""
    return dc.park_record_args(
        mgr.keys,
        mgr.options,
        task_id,
        min_life,
        req,
        kjson.dumps(message),
        park_ttl=park_ttl,
        grant_ttl=grant_ttl,
        # A retry the adopted run sent is a new life, not a duplicate.
        retries=int((message.get("options") or {}).get("retries") or 0),
    )


def _queue_parked(
    mgr: LockManager,
    task_id: str,
    reply: Any,
    req: Request,
    message: dict[str, Any],
    *,
    park_ttl: float,
    label: str,
    holder: str,
    adopt_now: bool,
) -> ParkResult:
    """The second round trip of a park, after ``defer_park.lua`` replied
    ``reply``: none when a record holds the task already (``duplicate``,
    its ``state`` in the result) or the request to take over is no longer
    queued (``not-queued``). Else ``acquire.lua`` as the task owner of the
    record just written (its token and life: ``reply[2:4]``). Granted at
    once: adopted here, or (``adopt_now`` False: a dispatcher parking a
    task again) dispatched. On any error the task is withdrawn again and
    the error raised."""
    if int(reply[0]) == 0:
        state = text(reply[1])
        return ParkResult("not-queued" if state == "not-queued" else "duplicate", state=state)
    token, life = text(reply[2]), int(reply[3])
    try:
        got = _attempt_as_task(
            mgr, token, req, liveness_ms=_ms(park_ttl), register=f"task {label}", holder=holder
        )
        code = int(got[0])
        if code == 1 and not adopt_now:  # a dispatcher re-parking: dispatch it
            mgr.channel.run(dc.defer_granted(mgr.keys, task_id, text(got[1])))
            return ParkResult("granted", life=life)
        if code == 1:
            outcome, leases = adopt(
                mgr, task_id, life, holder=holder or None, parked_at=message["parked_at"]
            )
            if not leases:
                raise LockError(f"deferred task {task_id}: immediate grant not adopted ({outcome})")
            return ParkResult("granted", leases=leases, life=life)
        if code == -1:
            raise LockError(f"deferred task {task_id}: its task owner is tombstoned")
        if code == -2:  # a resource taken in another kind (limited, or not): withdrawn
            raise mode_refusal(got)
    except BaseException:
        try:
            withdraw(mgr, task_id)
        except Exception as exc:  # its park TTL ends it
            log.warning("defer.withdraw-error id=%s error=%r", task_id, exc)
        raise
    if adopt_now:
        mgr.telemetry.parked()
    return ParkResult("parked", life=life)


def park(
    mgr: LockManager,
    task_id: str,
    req: Request,
    message: dict[str, Any],
    *,
    park_ttl: float,
    grant_ttl: float,
    label: str = "",
    adopt_now: bool = True,
    min_life: int = 0,
    holder: str | None = None,
    waiting: str | None = None,
) -> ParkResult:
    """Queue ``req`` for a task owner of ``task_id`` and store its message.

    Two round trips: the park record (``defer_park.lua``, which picks the
    record's life and so its task owner), then the request (``acquire.lua``
    as that task owner). If the locks were freed meanwhile the request is
    granted at once and adopted here (:func:`adopt`), or, with
    ``adopt_now=False`` (a dispatcher parking a task again), dispatched.
    Raises ValueError for a task id that cannot name an owner, TypeError
    when the message does not encode as JSON, and the engine's errors; on
    any error after the record was written, the task is withdrawn again.
    ``holder``: the task's holder record (default: the message's
    ``holder``); it is kept in the message, so a dispatcher re-attempting
    or parking the task again records it too. So is ``parked_at`` (when
    it first parked, unless the message has it already), from which the
    adopted grant's wait is measured (metrics). A task parked by a pool
    child (``adopt_now``) counts as one park for the metrics hook.
    ``waiting``: the token of a queued request of ``req`` that the task
    owner takes over, parking a waiting task in its place (docs/defer.md,
    "Waiting tasks behind a grant in transit", T3): ``defer_park.lua``
    moves the request (same arrival number in every queue) with the
    record, and the result is ``not-queued`` (nothing changed, the caller
    goes on waiting) when that request is no longer queued.
    """
    owner = task_owner(task_id)  # validates the id before anything is written
    if holder is None:
        holder = str(message.get("holder") or "")
    message = _park_fields(message, holder)
    record = _record_args(
        mgr, task_id, min_life, req, message, park_ttl=park_ttl, grant_ttl=grant_ttl
    )
    moves = None
    if waiting is not None:
        # ARGV 12-14; the holder record names the request id, the same in
        # every life (the script names the life it picked).
        moves = [
            waiting,
            f"task {label}",
            holder_record(task_token(owner, task_id), holder) if holder else "",
        ]
    reply = mgr.channel.run(dc.defer_park(mgr.keys, task_id, record, moves))
    return _queue_parked(
        mgr,
        task_id,
        reply,
        req,
        message,
        park_ttl=park_ttl,
        label=label,
        holder=holder,
        adopt_now=adopt_now,
    )


def park_again(
    mgr: LockManager, task_id: str, message: dict[str, Any], min_life: int
) -> ParkResult:
    """Park a task again from its park record's message (its resources,
    modes, park and grant TTLs), as a new request at the back of the line,
    in a life of at least ``min_life``: a dispatcher parking a grant nobody
    adopted, or a guard parking a task the lock Redis lost (docs/defer.md,
    D6, D12). Granted at once, it is dispatched (never adopted here); a
    record that holds the task already makes it a ``duplicate``."""
    names = list(message.get("resources") or ())
    # The modes with the limits of limited resources (``xl:5``).
    req = mgr.requests.from_spec(names, str(message.get("modes") or "x" * len(names)))
    message = dict(message)
    park_ttl = park_limit(message, float(message.get("park_ttl") or 86400.0))
    return park(
        mgr,
        task_id,
        req,
        message,
        park_ttl=park_ttl,
        grant_ttl=float(message.get("grant_ttl") or 300.0),
        label=f"{message.get('name', '?')} {task_id}",
        adopt_now=False,
        min_life=min_life,
    )


def adopt(
    mgr: LockManager,
    task_id: str,
    life: int,
    *,
    holder: str | None = None,
    parked_at: float | None = None,
) -> tuple[str, list[Lease]]:
    """Take over the grant of life ``life`` of the deferred task ``task_id``.

    One atomic step (the engine's :meth:`LockManager.adopt` with the park
    record): only while the park record is ``parked`` or ``granted`` and
    names that life's task owner do its grants move to this process's owner
    (same fence), and the record becomes ``adopted`` by it in the same
    script. No upkeep can come in between and park the task again
    (docs/defer.md, D8).

    Returns ``("adopted", leases)``, or ``(why, [])`` when nothing was
    adopted (``expired``: its grant TTL ran out, or it was withdrawn;
    ``tombstoned``; ``adopted-elsewhere``; ``superseded``: the record is
    another life's, or not waiting for this grant): the caller parks the
    message, and the park record decides whether it is a duplicate.
    Raises :class:`ReplicationTimeout` (the grants released again) when
    ``wait_replicas`` replicas did not acknowledge the adoption.

    An adoption is the deferred task's grant for the metrics hook:
    ``acquired(wait, "granted")``, the wait measured from ``parked_at``
    (``time.time()`` when the task parked; 0 when unknown); one that too
    few replicas acknowledge is ``acquired(wait, "error")``.
    """
    # A park record's task owner: defer:<id> (defer+<life>:<id>), apart from
    # UniqueTask's task:<id> owners.
    owner = task_owner(task_id, life)
    try:
        adoption = mgr.adopt(
            task_id, life, holder=holder, park_record_ttl=_done_ttl(mgr), owner=owner
        )
        if adoption.status == "expired":
            # A record an earlier release parked names its task owner the old
            # way ('task:<id>', 'task+<life>:<id>'): adopt the owner its token names.
            legacy = _legacy_owner(mgr, task_id, owner)
            if legacy is not None:
                adoption = mgr.adopt(
                    task_id, life, holder=holder, park_record_ttl=_done_ttl(mgr), owner=legacy
                )
    except ReplicationTimeout:
        mgr.telemetry.acquired(_waited(parked_at), "error")
        raise
    if not adoption.adopted:
        if adoption.status == "adopted-elsewhere" and adoption.by:
            # A copy redelivered after its adopter died (a pool child killed
            # mid-body or before its result was stored) may come before the
            # node has freed that child: if it was a process of this worker,
            # free it now, so that the park record sees a dead adopter and
            # the copy runs again (docs/defer.md, D8).
            free_dead_member(mgr, adoption.by)
        return adoption.status, []
    mgr.telemetry.acquired(_waited(parked_at), "granted")
    log.info(
        "defer.adopted id=%s life=%d owner=%s grants=%d",
        task_id,
        life,
        adoption.by,
        len(adoption.leases),
    )
    return "adopted", list(adoption.leases)


def _waited(parked_at: float | None) -> float:
    """Seconds since ``parked_at`` (``time.time()``), 0 when unknown."""
    return 0.0 if parked_at is None else time.time() - parked_at


def _legacy_owner(mgr: LockManager, task_id: str, owner: str) -> str | None:
    """The task owner the park record's token names, when it is not ``owner``
    and is one an earlier release named (``task:``/``task+<n>:``); else None.
    One round trip, only when the adopt found no live task owner."""
    token = text(mgr.channel.command("hget", record_key(mgr, task_id), "token") or "")
    named, sep, rid = token.partition("|")
    if not sep or rid != f"task:{task_id}" or named == owner:
        return None
    if named == f"task:{task_id}" or (named.startswith("task+") and named.endswith(f":{task_id}")):
        return named
    return None


#: Seconds a 'done' or 'adopted' record is kept (set by the app; default 1 day).
DONE_TTL = 86400.0
#: The 'done' record TTL of each manager that was given one (:func:`set_done_ttl`).
_done_ttls: weakref.WeakKeyDictionary[LockManager, float] = weakref.WeakKeyDictionary()


def set_done_ttl(mgr: LockManager, ttl: float) -> None:
    """Keep ``mgr``'s 'done' and 'adopted' records ``ttl`` seconds (default
    :data:`DONE_TTL`): the worker integration sets ``redislock_defer_ttl``."""
    _done_ttls[mgr] = float(ttl)


def _done_ttl(mgr: LockManager) -> float:
    return _done_ttls.get(mgr, DONE_TTL)


def mark_done(mgr: LockManager, task_id: str, owner: str) -> None:
    """The adopted task's body ended: keep a ``done`` record (one round trip)."""
    mgr.channel.run(dc.defer_done(mgr.keys, task_id, owner, _done_ttl(mgr)))


def withdraw(
    mgr: LockManager, task_id: str, *, only_dead: bool = False, client: Any = None
) -> list[str]:
    """Take a parked or granted task out of line (``defer_withdraw.lua``).

    Returns the reply as text: ``[state, msg, life]`` when withdrawn,
    ``["alive", state, pttl]`` (``only_dead``), or ``[state]``/``["none"]``.
    """
    call = dc.defer_withdraw(mgr.keys, mgr.options, task_id, only_dead=only_dead)
    reply = mgr.channel.run(call, client)
    return [text(x) for x in reply]


def capture_message(task: Any) -> dict[str, Any]:
    """What re-publishing ``task``'s current request needs (JSON-encodable)."""
    req = task.request
    info = dict(getattr(req, "delivery_info", None) or {})
    opts: dict[str, Any] = {}
    exchange, routing_key = info.get("exchange"), info.get("routing_key")
    if exchange:
        opts["exchange"] = exchange
        if routing_key:
            opts["routing_key"] = routing_key
    elif routing_key:
        opts["queue"] = routing_key
    if info.get("priority") is not None:
        opts["priority"] = info["priority"]
    for attr, opt in (
        ("expires", "expires"),
        ("retries", "retries"),
        ("root_id", "root_id"),
        ("parent_id", "parent_id"),
        ("group", "group_id"),
        ("callbacks", "link"),
        ("errbacks", "link_error"),
        ("chain", "chain"),
    ):
        value = getattr(req, attr, None)
        if value:
            opts[opt] = value
    limits = getattr(req, "timelimit", None) or (None, None)
    if limits[0]:
        opts["time_limit"] = limits[0]
    if limits[1]:
        opts["soft_time_limit"] = limits[1]
    return {
        "name": task.name,
        "args": list(req.args or ()),
        "kwargs": dict(req.kwargs or {}),
        "options": opts,
    }


def park_limit(message: dict[str, Any], timeout: float) -> float:
    """How long the task of ``message`` may stay parked: ``timeout``, or less
    when its ``expires`` comes first. Notes in ``message`` which one ends the
    park (``message["ends"] = "expires"``), so that the dispatcher withdrawing
    it at that deadline reports what a worker reports for an expired
    message (``REVOKED``, reason ``expired``) rather than a park time-out."""
    left = expires_in(message.get("options", {}).get("expires"))
    if left is not None and left < timeout:
        message["ends"] = "expires"
        return max(left, 0.001)
    message.pop("ends", None)
    return timeout


def _park_end(message: dict[str, Any]) -> str:
    """Why a parked task whose park deadline passed is withdrawn:
    ``expired-message`` (its ``expires``), else ``expired`` (its park TTL)."""
    return "expired-message" if message.get("ends") == "expires" else "expired"


def expires_in(expires: Any) -> float | None:
    """Seconds until a message's ``expires`` (ISO text or datetime), None if none."""
    if not expires:
        return None
    if isinstance(expires, str):
        try:
            expires = datetime.datetime.fromisoformat(expires)
        except ValueError:
            return None
    if not isinstance(expires, datetime.datetime):
        return None
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=datetime.timezone.utc)
    return float((expires - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


class Dispatcher:
    """Re-publishes deferred tasks whose request was handed its locks.

    Runs in a worker's main process, in a real OS thread of its own (any
    pool: prefork, threads, solo, gevent), on connections of its own (Redis
    and broker). It blocks in ``BLMOVE {ns}:dispatch -> {ns}:dispatching:<inc>``
    (pushed by the scripts, never polled) and, every ``interval``, runs the
    upkeep (``defer_tick.lua``, one round trip per pass): its liveness, the
    recovery of dead dispatchers' lists, the deadlines due (park and grant
    TTLs, ``{ns}:deadlines``: the dead are withdrawn in the script) and the
    re-attempts due (at a blocker's liveness deadline, ``{ns}:deferred``);
    a pass that reaches a limit is followed by another at once. See
    docs/defer.md.

    Args:
        manager: the main process's manager (namespace, TTLs).
        incarnation: this worker start's id.
        publish: ``publish(task_id, message, header or None)`` sends the
            task; the header (``"<life>:<fence>"``) names the grant to adopt.
        on_withdrawn: ``on_withdrawn(task_id, why, message)``, why in
            ``expired`` (park TTL: fail it), ``expired-message``,
            ``revoked``, ``refused`` (a re-attempt met a resource taken in
            another kind: fail it with :class:`InvalidResource`, the text
            in ``message["refused"]``).
        revoked: returns whether a task id was revoked (Celery's revoked set).
        revoked_ids: returns the ids revoked so far (scanned every upkeep).
    """

    def __init__(
        self,
        manager: LockManager,
        incarnation: str,
        *,
        publish: Callable[[str, dict[str, Any], str | None], None],
        on_withdrawn: Callable[[str, str, dict[str, Any]], None],
        revoked: Callable[[str], bool] = lambda _id: False,
        revoked_ids: Callable[[], list[str]] = list,
    ) -> None:
        # A manager of its own, on a private connection pool: this thread
        # never shares a socket with the worker's (a gevent-patched socket
        # must not be used from two OS threads). It never registers an owner.
        self.manager = LockManager(
            clone_client(manager.client),
            manager.namespace,
            owner_ttl=manager.owner_ttl,
            heartbeat_interval=manager.heartbeat_interval,
            queue_scan_limit=manager.queue_scan_limit,
            heartbeat=False,
            eviction_check="ignore",
            # The worker's hook (metrics): the reclaims of its attempts, and
            # the parked tasks whose time ran out (timeouts).
            metrics=manager.metrics,
        )
        set_done_ttl(self.manager, _done_ttl(manager))
        self.incarnation = incarnation
        self._publish = publish
        self._on_withdrawn = on_withdrawn
        self._revoked = revoked
        self._revoked_ids = revoked_ids
        self._seen_revoked: set[str] = set()
        prefix = manager.keys.prefix
        self.dispatching_key = f"{prefix}dispatching:{incarnation}"
        self._alive_key = self.manager.keys.dispatcher(incarnation)
        self._set_key = self.manager.keys.dispatchers
        self.interval = manager.heartbeat_interval
        self._stop = threading.Event()
        self._thread_started = False
        self._thread: ThreadHandle | None = None
        #: True while the thread waits in BLMOVE (see :meth:`stop`).
        self._blocking = False
        self._offset_ms = 0.0
        self._next_upkeep = 0.0
        self.dispatched = 0
        self.pid = os.getpid()

    # -- thread -----------------------------------------------------------

    def start(self) -> None:
        """Start the dispatcher thread (idempotent)."""
        if self._thread_started:
            return
        self._thread_started = True
        self._thread = start_os_thread(self._run, "redislock-dispatch")

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread and wait until it ended (its connections closed).

        Waits at most ``timeout`` seconds (default: the longest BLMOVE wait
        plus one second). A wait in BLMOVE is cut short at once where the
        thread's sockets are plain ones (not monkey-patched by gevent or
        eventlet): its connections are disconnected under it; a round trip in
        progress ends by itself (the socket timeout bounds it). Returns True
        once the thread has ended (or never ran here); False, with a warning,
        when it is still running after ``timeout``: it is a daemon thread
        and does nothing more once it sees the stop.
        """
        self._stop.set()
        handle = self._thread
        if handle is None or os.getpid() != self.pid:
            return True
        if timeout is None:
            timeout = self.manager.options.block_cap + 1.0
        if self._blocking and not green():
            pool = getattr(self.manager.client, "connection_pool", None)
            if pool is not None:  # a Redis Cluster client: its BLMOVE ends by itself
                try:
                    pool.disconnect(inuse_connections=True)
                except Exception as exc:  # never break a shutdown
                    log.debug("defer.dispatch-stop-error error=%r", exc)
        if handle.join(timeout):
            return True
        log.warning(
            "defer.dispatch-stop-timeout seconds=%.3g: the dispatcher thread is still in a "
            "round trip; going on without it",
            timeout,
        )
        return False

    def _redis(self) -> Any:
        return self.manager.client

    def _pause(self) -> None:
        """Wait :data:`RETRY_PAUSE` after a failed pass, or until stopped."""
        until = time.monotonic() + RETRY_PAUSE
        while not self._stop.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            real_sleep(min(_PAUSE_SLICE, left))

    def _run(self) -> None:
        outage = False
        while not self._stop.is_set() and os.getpid() == self.pid:
            try:
                self.step()
                if outage:
                    outage = False
                    log.info("defer.dispatch-resumed")
            except _DOWN as exc:
                if self._stop.is_set():
                    break  # stop() cut the wait short
                if not outage:
                    outage = True
                    log.warning("defer.dispatch-unavailable error=%s: retrying", exc)
                self._pause()
            except Exception:
                if self._stop.is_set():
                    break
                log.exception("defer.dispatch-error")
                self._pause()
        if os.getpid() == self.pid:
            self.manager.client.close()

    def step(self) -> None:
        """One pass: the upkeep when due, then one pop (and its dispatch).

        The pop blocks until the next upkeep is due, except while the last
        upkeep pass left due entries behind (a limit of the pass was
        reached): then it waits 10 ms at most, and the next step runs the
        upkeep again at once, so a backlog is worked off pass after pass
        (with dispatches in between) rather than one pass per interval.
        """
        now = time.monotonic()
        if now >= self._next_upkeep:
            self._next_upkeep = now + self.interval
            if self.upkeep():
                self._next_upkeep = now  # more is due: the next step goes on at once
        if self._next_upkeep <= now:
            # BLMOVE's least wait that every server keeps: 0 waits for ever,
            # and Redis 6.2 reads 0.001 as 0 too (LMOVE would need another ACL).
            block = 0.01
        else:
            block = max(
                0.05, min(self.manager.options.block_cap, self._next_upkeep - time.monotonic())
            )
        self._blocking = True
        try:
            if self._stop.is_set():
                return
            got = self._redis().blmove(
                dispatch_key(self.manager), self.dispatching_key, block, "RIGHT", "LEFT"
            )
        finally:
            self._blocking = False
        if got is None:
            return
        task_id = text(got)
        try:
            self.handle(task_id)
        finally:
            self._redis().lrem(self.dispatching_key, 1, task_id)

    # -- work -------------------------------------------------------------

    def upkeep(self) -> bool:
        """One upkeep pass: ``defer_tick.lua``, then what it found and new revokes.

        The script withdraws, in Redis, every task whose deadline (park or
        grant TTL) is due and whose task owner is dead, up to
        :data:`DEADLINE_BATCH`, and returns up to :data:`DUE_BATCH` due
        re-attempts; this reports the withdrawn ones (a parked task fails, or
        is revoked if its ``expires`` ended the park; a grant nobody adopted is
        parked again) and looks at the re-attempts. Returns True when a limit
        was reached: more may be due, and the caller runs another pass at once.
        """
        mgr = self.manager
        local_ms = time.time() * 1000
        call = dc.defer_tick(
            mgr.keys,
            mgr.options,
            self.incarnation,
            due_batch=DUE_BATCH,
            deadline_batch=DEADLINE_BATCH,
        )
        reply = mgr.channel.run(call, self._redis())
        self._offset_ms = float(text(reply[0])) - local_ms
        moved = int(reply[1])
        if moved:
            log.warning(
                "defer.recovered ids=%d: ids left in a dispatching list (a dead worker's, "
                "or this one's after an error) went back to the dispatch list",
                moved,
            )
        withdrawn = [text(x) for x in reply[3]]
        for i in range(0, len(withdrawn), 4):
            task_id, state, raw, life = withdrawn[i : i + 4]
            # Already out of line in Redis: each one is reported (or parked
            # again) even if another one's report fails.
            try:
                self._dead(task_id, state, raw, int(life or 0))
            except Exception:
                log.exception("defer.withdrawn-error id=%s state=%s", task_id, state)
        for raw in reply[2]:
            self.due(text(raw))
        for task_id in self._new_revokes():
            self._withdraw(task_id, "revoked")
        return bool(int(reply[4]))

    def _new_revokes(self) -> list[str]:
        try:
            ids = [str(x) for x in self._revoked_ids()]
        except Exception:
            return []
        new = [x for x in ids if x not in self._seen_revoked]
        self._seen_revoked.update(new)
        if len(self._seen_revoked) > 100000:
            self._seen_revoked = set(ids)
        return new

    def due(self, task_id: str) -> None:
        """A task's re-attempt came due: withdraw it if dead, else look at it."""
        got = withdraw(self.manager, task_id, only_dead=True, client=self._redis())
        state = got[0]
        if state == "alive":
            self.handle(task_id)
        elif state in ("parked", "granted"):
            self._dead(task_id, state, got[1], int(got[2] or 0))

    def _dead(self, task_id: str, state: str, raw: str, life: int) -> None:
        """A task withdrawn because its task owner's liveness ran out: a parked
        one's park TTL ended (it fails, or is revoked as expired when its
        ``expires`` capped the park); a granted one was never adopted (parked
        again as a new request, at the back of the line)."""
        if state == "parked":
            self._withdrawn(task_id, _park_end(_loads(raw) or {}), raw)
            return
        log.warning(
            "defer.regrant id=%s: the grant was not adopted within the grant TTL; "
            "locks handed on, task parked again at the back of the line",
            task_id,
        )
        reparked = _loads(raw)
        if reparked is not None:
            self._repark(task_id, reparked, life + 1)

    def _repark(self, task_id: str, message: dict[str, Any], life: int) -> None:
        """Park a task whose grant was never adopted again, as a new request.

        A new record (so a late copy of the lost message finds a record that
        is not its own and is dropped); if the locks are free it is granted
        and dispatched at once.
        """
        left = expires_in(message.get("options", {}).get("expires"))
        if left is not None and left <= 0:
            self._withdrawn(task_id, "expired-message", kjson.dumps(message))
            return
        try:
            result = park_again(self.manager, task_id, message, life)
        except InvalidResource as exc:  # withdrawn again by the park
            self._withdrawn(task_id, "refused", kjson.dumps({**message, "refused": str(exc)}))
            return
        log.info("defer.reparked id=%s outcome=%s", task_id, result.outcome)

    def handle(self, task_id: str) -> None:
        """Dispatch one task id popped from the dispatch list."""
        mgr = self.manager
        reply = mgr.channel.run(dc.defer_claim(mgr.keys, task_id), self._redis())
        kind = text(reply[0])
        if kind == "publish":
            fence, message, life = int(reply[1]), _loads(text(reply[2])), text(reply[3])
            if message is None:
                return
            if self._withdrawn_if_gone(task_id, message):
                return
            # Logged before the message goes out: the child that receives it
            # may adopt (or die) before this thread runs again, and a crash
            # of the worker right after the publish must still show it.
            log.info("defer.dispatch id=%s fence=%d", task_id, fence)
            try:
                self._publish(task_id, message, f"{life}:{fence}")
            except Exception:
                # Not sent (the broker refused or is down): un-claim it and
                # put the id back, so that a later pass publishes it.
                pipe = self._redis().pipeline(transaction=False)
                pipe.hdel(record_key(mgr, task_id), "sent")
                pipe.lpush(dispatch_key(mgr), task_id)
                pipe.execute()
                raise
            self.dispatched += 1
            try:
                self.nudge(task_id, fence)
            except Exception as exc:  # the waiters see the grant at their next look
                log.warning("defer.nudge-error id=%s error=%r", task_id, exc)
        elif kind == "parked":
            token, modes, res = (text(x) for x in reply[1:4])
            pttl, message = int(reply[4]), _loads(text(reply[5]))
            if message is not None and self._withdrawn_if_gone(task_id, message):
                return
            if pttl == -2:
                self.due(task_id)
                return
            holder = str((message or {}).get("holder") or "")
            self._attempt(task_id, token, modes, res, pttl, holder)

    def nudge(self, task_id: str, fence: int) -> int:
        """Tell the waiting requests that wait for the grant ``fence`` of
        ``task_id``, now in transit, that it needs a pool slot
        (``defer_nudge.lua``, one round trip): a waiting task among them
        gives its slot up and is parked in its place (docs/defer.md, T2).
        Returns how many were told."""
        mgr = self.manager
        call = dc.defer_nudge(mgr.keys, mgr.options, task_id, fence)
        told = int(mgr.channel.run(call, self._redis()))
        if told:
            log.info("defer.nudged id=%s waiters=%d", task_id, told)
        return told

    def _attempt(
        self, task_id: str, token: str, modes: str, res: str, pttl: int, holder: str = ""
    ) -> None:
        mgr = self.manager
        # ``modes`` as the park record stores them: with the limits of its
        # limited resources (``xl:5``), so each keeps its own N.
        req = mgr.requests.from_spec(res.split("\n"), modes)
        ttl = str(pttl if pttl > 0 else 1)
        got = _attempt_as_task(mgr, token, req, liveness_ms=ttl, register="", holder=holder)
        code = int(got[0])
        if code == -2:
            self._refused(task_id, mode_refusal(got))
        elif code == 1:
            mgr.channel.run(dc.defer_granted(mgr.keys, task_id, text(got[1])))
        elif code == 0:
            wait_ms = int(got[1])
            delay = mgr.owner_ttl * 1000 if wait_ms < 0 else min(wait_ms + 10, mgr.owner_ttl * 1000)
            # Not past the park deadline either: {ns}:deadlines withdraws it
            # then, but a record parked by an earlier release has no entry there.
            delay = min(delay, max(pttl, 1))
            score = int(time.time() * 1000 + self._offset_ms + delay)
            self._redis().zadd(deferred_key(mgr), {task_id: score}, xx=True)
        else:
            self.due(task_id)

    def _withdrawn_if_gone(self, task_id: str, message: dict[str, Any]) -> bool:
        if self._revoked(task_id):
            self._withdraw(task_id, "revoked")
            return True
        left = expires_in(message.get("options", {}).get("expires"))
        if left is not None and left <= 0:
            self._withdraw(task_id, "expired-message")
            return True
        return False

    def _refused(self, task_id: str, exc: InvalidResource) -> None:
        """A re-attempt was refused (``{-2, name, mode}``): a resource of the
        task is held or waited for in another kind (limited, or exclusive
        and shared; a process of a release without limited resources, or a
        queue read past ``queue_scan_limit``). Trying again would meet the
        same refusal at every interval: the task is taken out of line and
        fails with :class:`InvalidResource` (``why`` ``refused``), as it
        would have had its first try met it."""
        got = withdraw(self.manager, task_id, client=self._redis())
        if got[0] not in ("parked", "granted"):
            return  # withdrawn, granted or adopted meanwhile: its owner reports it
        message = _loads(got[1]) or {}
        message["refused"] = str(exc)
        log.error("defer.mode-refused id=%s error=%s", task_id, exc)
        self._withdrawn(task_id, "refused", kjson.dumps(message))

    def _withdraw(self, task_id: str, why: str) -> None:
        got = withdraw(self.manager, task_id, client=self._redis())
        if got[0] in ("parked", "granted"):
            self._withdrawn(task_id, why, got[1])

    def _withdrawn(self, task_id: str, why: str, raw: str) -> None:
        message = _loads(raw) or {}
        log.warning("defer.%s id=%s task=%s", why, task_id, message.get("name", "?"))
        if why == "expired":  # its park TTL (timeout=) ran out: it fails with LockTimeout
            parked_at = parse_parked_at(message.get("parked_at"))
            waited = message.get("park_ttl") if parked_at is None else time.time() - parked_at
            self.manager.telemetry.acquired(float(waited or 0.0), "timeout")
        try:
            self._on_withdrawn(task_id, why, message)
        except Exception:
            log.exception("defer.withdrawn-hook-error id=%s", task_id)


def parse_header(value: Any) -> tuple[int, int] | None:
    """``(life, fence)`` of a :data:`HEADER` value ``"<life>:<fence>"``, else None."""
    if not isinstance(value, (str, bytes)):
        return None
    text = value.decode() if isinstance(value, bytes) else value
    life, sep, fence = text.partition(":")
    if not sep or not life.isdigit() or not fence.isdigit():
        return None
    return int(life), int(fence)


def parse_parked_at(value: Any) -> float | None:
    """The park time (``time.time()``) a :data:`PARKED_AT_HEADER` value or a
    message's ``parked_at`` gives, else None."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    try:
        got = float(value)
    except ValueError:
        return None
    return got if math.isfinite(got) else None


def _loads(raw: str) -> dict[str, Any] | None:
    try:
        value = kjson.loads(raw)
    except Exception:
        log.error("defer.bad-message %r", raw[:200])
        return None
    return value if isinstance(value, dict) else None


__all__ = [
    "DEFERRED",
    "HEADER",
    "PARKED_AT_HEADER",
    "parse_header",
    "parse_parked_at",
    "Dispatcher",
    "ParkResult",
    "adopt",
    "capture_message",
    "mark_done",
    "park",
    "park_again",
    "task_owner",
    "withdraw",
]
