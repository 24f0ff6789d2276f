"""The deferred tasks' scripts as calls, without I/O (``lua/defer_*.lua``).

The companion of :mod:`.calls` for ``on_busy="defer"``: the park record's
scripts (``defer_park``, ``defer_granted``, ``defer_claim``, ``defer_done``,
``defer_withdraw``, ``defer_nudge``), the dispatcher's ``defer_tick`` and the
guards' ``defer_guard``. Each builds its KEYS and ARGV (see the script's
header); the caller, :mod:`celery_redislock.worker.defer` or the guards,
sends it and reads the reply. Times are in milliseconds as the scripts take
them, from seconds by :func:`ms`.
"""

from __future__ import annotations

from .calls import ScriptCall
from .keys import Keyspace
from .options import EngineOptions
from .request import Request

__all__ = [
    "defer_claim",
    "defer_done",
    "defer_granted",
    "defer_guard",
    "defer_nudge",
    "defer_park",
    "defer_tick",
    "defer_withdraw",
    "ms",
    "park_record_args",
]


def ms(seconds: float) -> str:
    """Seconds as the scripts' milliseconds: at least 1."""
    return str(max(1, int(seconds * 1000)))


def park_record_args(
    keys: Keyspace,
    options: EngineOptions,
    task_id: str,
    min_life: int,
    req: Request,
    message_json: str,
    *,
    park_ttl: float,
    grant_ttl: float,
    retries: int,
) -> list[str]:
    """ARGV 1-11 of ``defer_park.lua``: the record of a parked task.

    ``message_json``: the task's message as the record keeps it;
    ``retries``: the message's retry number (a retry is a new life)."""
    owner_ttl = options.owner_ttl
    return [
        task_id,
        str(min_life),
        req.spec,  # the modes with the limits of limited resources (xl:5)
        "\n".join(req.resources),
        message_json,
        ms(grant_ttl),
        keys.prefix,
        ms(min(park_ttl, owner_ttl)),
        ms(park_ttl + 3 * grant_ttl + owner_ttl),
        ms(park_ttl),
        str(retries),
    ]


def defer_park(
    keys: Keyspace, task_id: str, record: list[str], take_over: list[str] | None = None
) -> ScriptCall:
    """``defer_park.lua``: write the park record ``record`` (ARGV 1-11);
    ``take_over``: ARGV 12-14 when a waiting request is taken over (its
    token, the owner's description, the holder record)."""
    return ScriptCall(
        "defer_park",
        [keys.defer_record(task_id), keys.deferred],
        [*record, *(take_over or ())],
    )


def defer_granted(keys: Keyspace, task_id: str, fence: str) -> ScriptCall:
    """``defer_granted.lua``: the park's request was granted with ``fence``."""
    return ScriptCall("defer_granted", [keys.defer_record(task_id)], [task_id, keys.prefix, fence])


def defer_claim(keys: Keyspace, task_id: str) -> ScriptCall:
    """``defer_claim.lua``: claim a granted task for dispatch."""
    return ScriptCall("defer_claim", [keys.defer_record(task_id)], [task_id, keys.prefix])


def defer_done(keys: Keyspace, task_id: str, owner: str, done_ttl: float) -> ScriptCall:
    """``defer_done.lua``: the adopted body of ``owner`` ended; keep a record."""
    return ScriptCall("defer_done", [keys.defer_record(task_id)], [owner, ms(done_ttl)])


def defer_withdraw(
    keys: Keyspace, options: EngineOptions, task_id: str, *, only_dead: bool
) -> ScriptCall:
    """``defer_withdraw.lua``: take a parked or granted task out of line."""
    return ScriptCall(
        "defer_withdraw",
        [keys.defer_record(task_id), keys.deferred, keys.owners],
        [
            task_id,
            keys.prefix,
            str(options.req_ttl_ms),
            str(options.queue_scan_limit),
            "dead" if only_dead else "any",
        ],
    )


def defer_nudge(keys: Keyspace, options: EngineOptions, task_id: str, fence: int) -> ScriptCall:
    """``defer_nudge.lua``: tell the requests waiting for the grant ``fence``
    of ``task_id``, in transit, that it needs a pool slot."""
    return ScriptCall(
        "defer_nudge",
        [keys.defer_record(task_id)],
        [keys.prefix, str(fence), str(options.req_ttl_ms), str(options.queue_scan_limit)],
    )


def defer_tick(
    keys: Keyspace,
    options: EngineOptions,
    incarnation: str,
    *,
    due_batch: int,
    deadline_batch: int,
) -> ScriptCall:
    """``defer_tick.lua``: one pass of the dispatcher of ``incarnation``."""
    return ScriptCall(
        "defer_tick",
        [
            keys.dispatchers,
            keys.dispatcher(incarnation),
            keys.dispatch,
            keys.deferred,
            keys.deadlines,
        ],
        [
            incarnation,
            keys.prefix,
            ms(options.owner_ttl),
            str(due_batch),
            ms(options.owner_ttl),
            str(deadline_batch),
            str(options.req_ttl_ms),
            str(options.queue_scan_limit),
        ],
    )


def defer_guard(
    keys: Keyspace,
    task_id: str,
    guard_id: str,
    seq: int,
    attempt: int,
    interval_ms: int,
    rate: float | None,
) -> ScriptCall:
    """``defer_guard.lua``: a guard's look at the park record of ``task_id``."""
    return ScriptCall(
        "defer_guard",
        [keys.defer_record(task_id), keys.deferred, keys.guardslot],
        [
            guard_id,
            str(seq),
            str(3 * interval_ms),
            str(attempt),
            str(interval_ms),
            str(rate) if rate else "",
        ],
    )
