"""Guards of parked deferred tasks: survive the loss of the lock Redis's data.

A parked task's message was acked when it parked (Celery's ``Ignore``): its
park record in the lock Redis is then its only copy. A Redis restart without
persistence, or a failover that lost writes, would make it vanish. So when a
task parks, a *guard* is published to the broker: a small task
(:data:`GUARD_TASK`) carrying the task's message, sent with a countdown of
``redislock_defer_guard_interval`` on the parked task's own routing. When it
comes due, a worker looks at the park record (``defer_guard.lua``):

* parked or granted: the guard claims the record (one guard message per
  record goes on: a sequence number and the guard's id, compare-and-set in
  the record) and is sent again for the next interval;
* adopted or done, watched by another live guard, or holding a later
  attempt of the task (a retry parked again, with a guard of its own): the
  guard ends. A guard watches one attempt: its message's retry number;
* no record: the result backend says why. A ready state (SUCCESS, FAILURE,
  REVOKED: the task ran, or was withdrawn) or an adoption marker of a later
  attempt, or of this attempt in this life or a later one (the body
  started), ends the guard. ``DEFERRED``
  (written at the park, before the guard was sent): the guard looks once
  more one interval later (a record is briefly absent while the dispatcher
  parks a task again) and then *recovers* the task: it parks it again
  itself, from its message, in a life above its own (:func:`defer.park_again`:
  the park record decides, so any number of guards of one task park it
  once and nothing travels through the broker), and goes on guarding.
  ``PENDING`` at both looks: the result
  backend lost the task too, nothing tells whether it ran; it fails with
  ``LockLost`` (cause "Redis lost the lock") instead of running twice.

The adoption marker is a result-backend entry of its own
(:func:`marker_id`), written by the child that adopts a deferred task's
grant: the body is running or ran, and its own message is in charge. A
copy of a task's message that finds no park record reads it too
(:func:`copy_is_stale`): after a loss, a copy of a task that ran or
started is dropped instead of running again.
docs/defer.md (D12) gives the races.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from typing import Any

from ..protocol import defer_calls as dc

log = logging.getLogger("celery_redislock.defer")

#: The registered name of the guard task.
GUARD_TASK = "celery_redislock.defer_guard"
#: Value of the ``redislock_defer`` header of a recovery copy, which an
#: earlier release's guards published: no grant to adopt, the park step
#: decides (duplicate if any record holds the task).
RECOVER = "recover"
#: State of the adoption marker's result-backend entry (:func:`marker_id`).
ADOPTED = "ADOPTED"
#: Result states after which a task is never recovered.
_FINAL = frozenset({"SUCCESS", "FAILURE", "REVOKED"})


def marker_id(task_id: str) -> str:
    """The result-backend id of the adoption marker of deferred task ``task_id``."""
    return f"redislock-adopted:{task_id}"


def enabled(app: Any, interval: float | None) -> bool:
    """Whether guards are sent: an interval, and a result backend that stores
    results (the guard reads it to tell a lost task from a finished one)."""
    if not interval:
        return False
    from celery.backends.base import DisabledBackend
    from celery.backends.rpc import RPCBackend

    try:
        backend = app.backend
    except Exception:
        return False
    # rpc:// sends results to the caller: a worker cannot read them back.
    if not isinstance(backend, (DisabledBackend, RPCBackend)):
        return True
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "defer.unguarded backend=%s: guards need a result backend a worker can read; "
            "parked tasks are lost if the lock Redis loses its data (docs/defer.md, D12)",
            type(backend).__name__,
        )
    return False


_warned = False


def _routing(message: dict[str, Any]) -> dict[str, Any]:
    opts = message.get("options") or {}
    return {k: opts[k] for k in ("exchange", "routing_key", "queue") if opts.get(k)}


def send_guard(
    app: Any,
    task_id: str,
    message: dict[str, Any],
    interval: float,
    *,
    life: int,
    gid: str | None = None,
    seq: int = 0,
    suspect: bool = False,
    every: float | None = None,
) -> str:
    """Publish a guard for ``task_id`` due in ``every`` seconds (default: the
    guard ``interval``; longer when the namespace's guard budget stretches
    it, see :func:`check`); its id."""
    gid = gid or uuid.uuid4().hex
    every = interval if every is None else max(every, interval)
    app.send_task(
        GUARD_TASK,
        args=[task_id, message, gid, seq, life, suspect, interval, every],
        countdown=every,
        add_to_parent=False,
        ignore_result=True,  # no result, and no result subscription here
        **_routing(message),
    )
    return gid


def attempt_of(message: dict[str, Any]) -> int:
    """The attempt a parked task's message is: its retry number (Celery's
    ``request.retries``, kept in the message's options when not 0)."""
    try:
        return int((message.get("options") or {}).get("retries") or 0)
    except (TypeError, ValueError):
        return 0


def mark_adopted(
    app: Any, task_id: str, life: int, attempt: int = 0, via: int | None = None
) -> None:
    """Record in the result backend that life ``life`` of attempt ``attempt``
    (its retry number) of ``task_id`` was adopted (its body runs) by a
    message carrying the grant of life ``via`` (None: no grant header, a
    message parked and granted at once): a guard that finds no record
    then ends, and :func:`copy_is_stale` tells another message from this one."""
    try:
        # A state of its own: a backend never overwrites a SUCCESS result, and
        # a later life's adoption must overwrite the marker.
        marker = {"life": life, "retries": attempt, "via": via, "at": time.time()}
        app.backend.store_result(marker_id(task_id), marker, ADOPTED)
    except Exception as exc:  # only a guard's decision after a data loss needs it
        log.warning("defer.marker-error id=%s error=%r", task_id, exc)


def _marker(app: Any, task_id: str) -> dict[str, Any] | None:
    """The task's latest adoption marker (``life``, ``retries``, ``via``), or None."""
    meta = app.backend.get_task_meta(marker_id(task_id), cache=False)
    result = meta.get("result") if meta.get("status") == ADOPTED else None
    if isinstance(result, dict) and isinstance(result.get("life"), int):
        return result
    return None


def _adopted(app: Any, task_id: str) -> tuple[int, int] | None:
    """``(retry number, life)`` of the task's latest adoption marker, or None."""
    result = _marker(app, task_id)
    if result is None:
        return None
    retries = result.get("retries")  # a marker of an earlier release has none
    return (int(retries) if isinstance(retries, int) else 0), int(result["life"])


def _started(app: Any, task_id: str, attempt: int, life: int | None) -> bool:
    """Whether the adoption marker says that a body of a later attempt, or
    of ``attempt`` in life ``life`` or a later one (any life: None), started."""
    marker = _adopted(app, task_id)
    if marker is None:
        return False
    m_attempt, m_life = marker
    return m_attempt > attempt or (m_attempt == attempt and (life is None or m_life >= life))


def copy_is_stale(
    locks: Any, task_id: str, attempt: int, life: int | None, redelivered: bool
) -> str | None:
    """Why a copy of a deferred task's message that is about to be parked
    record-first (a grant not adopted, a redelivery, a recovery copy) must
    be dropped although no park record holds the task, or None.

    With no park record, the lock Redis may have lost the record of a task
    that ran or started, and the copy would run it again. It is stale when
    the result is ready (the task ended), or the adoption marker names a
    later attempt, or this attempt adopted by another message: for a copy
    of the grant of life ``life``, an adoption of that life or a later one
    by a message of another grant (or, the copy not redelivered, by any:
    a first delivery never adopted); for a copy without a grant (None: a
    redelivered original message, an earlier release's recovery copy), an
    adoption by a dispatched grant. A redelivered copy whose own earlier
    delivery adopted (its body cut short by a kill) runs again, as any
    ``acks_late`` task does. One read of the record; the result backend is
    read only when there is none (docs/defer.md, D12)."""
    from ..worker.defer import record_key

    mgr = locks.manager
    if mgr.channel.command("exists", record_key(mgr, task_id)):
        return None  # the record decides (duplicate, or a dead adopter's task runs again)
    state = locks.app.backend.get_task_meta(task_id, cache=False).get("status")
    if state in _FINAL:
        return str(state)
    marker = _marker(locks.app, task_id)
    if marker is None:
        return None
    raw = marker.get("retries")
    m_attempt = int(raw) if isinstance(raw, int) else 0
    if m_attempt != attempt:
        return "adopted" if m_attempt > attempt else None
    if "via" not in marker:  # an earlier release's marker: no telling who adopted
        return None
    via = marker["via"]
    if life is None:
        return "adopted" if via is not None else None
    if int(marker["life"]) >= life and (via != life or not redelivered):
        return "adopted"
    return None


def _int(raw: Any) -> int:
    return int(raw.decode() if isinstance(raw, bytes) else raw)


def _look(
    locks: Any, task_id: str, gid: str, seq: int, life: int, interval: float, attempt: int
) -> tuple[str, int, str | None, float]:
    """``(what, record's life, result state, next check's delay)``:
    ``rearm`` (claimed; the delay is the interval, stretched by the
    namespace's guard budget), an ending (``adopted``, ``done``, ``other``,
    ``stale``, ``superseded``, a ready state), or ``none`` (no record, and
    the task neither ended nor started)."""
    mgr = locks.manager
    interval_ms = max(1, int(interval * 1000))
    rate = locks.config.defer_guard_rate
    call = dc.defer_guard(mgr.keys, task_id, gid, seq, attempt, interval_ms, rate or None)
    reply = mgr.channel.run(call)
    what = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    if what == "rearm":
        delay = _int(reply[2]) / 1000 if len(reply) > 2 else interval
        return what, _int(reply[1]), None, max(delay, interval)
    if what != "none":
        return what, life, None, interval
    state = locks.app.backend.get_task_meta(task_id).get("status")
    if state in _FINAL:
        return str(state), life, state, interval
    if _started(locks.app, task_id, attempt, life):
        return "adopted", life, state, interval
    return "none", life, state, interval


def check(
    locks: Any,
    task_id: str,
    message: dict[str, Any],
    gid: str,
    seq: int,
    life: int,
    suspect: bool,
    interval: float,
    every: float | None = None,
) -> str:
    """One guard check (the body of :data:`GUARD_TASK`); returns what it did:
    ``rearm``, ``ended:<why>``, ``wait:<state>``, ``suspect``, ``recovered``
    (parked again), ``recovered:<outcome>`` (``granted``: parked and handed
    its locks at once; ``duplicate``: a record held it already) or
    ``retry`` (the
    lock Redis or the result backend did not answer: the same guard message
    is sent again for the next interval, so the guard is never lost to an
    outage, such as the restart it is there for).

    The next check of a claimed record comes after ``interval``, stretched
    by the namespace's guard budget (``redislock_defer_guard_rate``): to
    (parked tasks) / rate seconds when that is longer, so that the guards of
    all parked tasks together make at most about ``rate`` checks a second.
    ``every`` is the delay this guard message was sent with; a look again
    after an outage or an unexpected state waits as long (the budget holds
    during an outage too). Only the second look at a missing record comes
    after ``interval``: once per task and loss."""
    app = locks.app
    attempt = attempt_of(message)
    every = interval if every is None else max(float(every), interval)
    # This guard message again (its life, seq, suspect and every as given).
    again = functools.partial(send_guard, app, task_id, message, interval, gid=gid, seq=seq)
    try:
        what, record_life, state, delay = _look(locks, task_id, gid, seq, life, interval, attempt)
    except Exception as exc:
        return _retry_later(again, task_id, exc, "looking again", life, suspect, every)
    if what == "rearm":
        again(life=record_life, seq=seq + 1, every=delay)
        return "rearm"
    if what != "none":
        return f"ended:{what}"
    if state not in ("DEFERRED", "PENDING"):
        # STARTED (task_track_started: a copy arrived and is about to park
        # or adopt), or a state of the task's own: look again later.
        again(life=life, every=every)
        return f"wait:{state}"
    if not suspect:
        # A record is briefly absent while a dispatcher parks a task again,
        # and a marker is written just after the adoption: look once more.
        again(life=life, suspect=True)
        return "suspect"
    if state == "PENDING":
        return _lost(app, task_id, message, life)
    return _recover(locks, task_id, message, life, state, again, every)


def _retry_later(
    again: functools.partial[str],
    task_id: str,
    exc: Exception,
    doing: str,
    life: int,
    suspect: bool,
    every: float,
) -> str:
    """The lock Redis or the result backend did not answer (``exc``) while
    ``doing``: send the same guard message again (``again``: :func:`send_guard`
    of this guard), due after ``every``, and say ``retry``."""
    log.warning("defer.guard-retry id=%s error=%r: %s later", task_id, exc, doing)
    again(life=life, suspect=suspect, every=every)
    return "retry"


def _lost(app: Any, task_id: str, message: dict[str, Any], life: int) -> str:
    """The park wrote DEFERRED before it sent this guard: the result
    backend lost it too (one Redis for both?), and nothing tells whether the
    task ran. Never run it twice: end it, saying why (``LockLost``)."""
    from ..exceptions import CAUSE_REDIS_LOST, LockLost
    from ..worker.defer import task_owner

    log.error(
        "defer.lost id=%s task=%s: neither the lock Redis nor the result backend holds "
        "this parked task any more (both lost their data); it may have run, so it is "
        "not published again: failing it with LockLost",
        task_id,
        message.get("name", "?"),
    )
    owner = task_owner(task_id, life)  # the park record's task owner
    lost = LockLost(list(message.get("resources") or ()), owner, 0, CAUSE_REDIS_LOST)
    app.backend.mark_as_failure(task_id, lost)
    return "ended:lost"


def _recover(
    locks: Any,
    task_id: str,
    message: dict[str, Any],
    life: int,
    state: str,
    again: functools.partial[str],
    every: float,
) -> str:
    """The lock Redis lost a parked task that neither ran nor started: park
    it again here, and keep guarding it (``recovered``), or look again later
    when the lock Redis does not answer (``retry``). ``again``: this guard's
    :func:`send_guard`."""
    from ..worker.defer import park_again

    try:
        # Parked here, record-first, in a life above any this guard saw: every
        # guard of the task may do this, the record keeps one; a copy of an
        # older life still in the broker finds nothing of its own to adopt.
        result = park_again(locks.manager, task_id, message, life + 1)
    except Exception as exc:
        return _retry_later(again, task_id, exc, "parking it again", life, True, every)
    log.error(
        "defer.recovered id=%s task=%s state=%s outcome=%s life=%d: the lock Redis held no "
        "record of this parked task (it lost its data: a restart without persistence, or "
        "a failover that lost writes); parked it again as a new arrival (its place in "
        "line is lost)",
        task_id,
        message.get("name", "?"),
        state,
        result.outcome,
        result.life,
    )
    new_life = result.life if result.life >= 0 else life
    again(life=new_life)
    return "recovered" if result.outcome == "parked" else f"recovered:{result.outcome}"


def register(app: Any, locks: Any) -> None:
    """Register :data:`GUARD_TASK` on ``app`` (done by ``RedisLock(app)``)."""

    @app.task(name=GUARD_TASK, shared=False, ignore_result=True)
    def defer_guard(
        task_id: str,
        message: dict[str, Any],
        gid: str,
        seq: int,
        life: int,
        suspect: bool = False,
        interval: float = 300.0,
        every: float | None = None,
    ) -> str:
        """Check that a parked deferred task is still held (docs/defer.md, D12)."""
        try:
            return check(
                locks, task_id, message, gid, int(seq), int(life), bool(suspect), interval, every
            )
        except Exception as exc:  # the broker refused the next message
            log.error(
                "defer.guard-error id=%s error=%r: the guard could not be sent again; "
                "this parked task is lost if the lock Redis loses its data",
                task_id,
                exc,
            )
            raise


__all__ = [
    "GUARD_TASK",
    "RECOVER",
    "attempt_of",
    "check",
    "copy_is_stale",
    "mark_adopted",
    "marker_id",
    "send_guard",
]
