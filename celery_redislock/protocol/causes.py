"""Why a lease was lost: the engine's loss codes, the causes users see, the log text.

An engine *code* says what found or caused a loss (``"deadline"``,
``"declared-dead"``, ``"redis-lost"``, a cleanup's reason ...). A *cause* is
one of :data:`~celery_redislock.exceptions.LOST_CAUSES`, what
``Lease.lost_cause`` and ``LockLost.cause`` report. The log line
``heartbeat.lost`` explains either to the operator.
"""

from __future__ import annotations

from ..exceptions import (
    CAUSE_DECLARED_DEAD,
    CAUSE_EXPIRED,
    CAUSE_OPERATOR,
    CAUSE_REDIS_LOST,
    LOST_CAUSES,
)

__all__ = ["CLEANUP_REASONS", "cause_text", "explain", "loss_code", "metric_label"]

#: The ``cause`` label of the lost-lease metric for each cause (and
#: ``unknown`` when none is known).
LOST_CAUSE_LABELS = {
    CAUSE_OPERATOR: "operator",
    CAUSE_DECLARED_DEAD: "declared_dead",
    CAUSE_EXPIRED: "expired",
    CAUSE_REDIS_LOST: "redis_lost",
}

#: What each place that finds an owner lost tells the operator (logged once).
_GONE = (
    "liveness key gone: paused or partitioned longer than owner_ttl, force-released, "
    "evicted by Redis (maxmemory-policy), or Redis lost its data (restart without "
    "persistence, FLUSHALL, failover to a replica that missed it)"
)
_LOSS_CAUSES = {
    "heartbeat": _GONE,
    "acquire": _GONE,
    "watch": _GONE,
    "declared-dead": "a cleanup declared this owner dead (its worker, reconcile or an operator)",
    "deadline": "local liveness deadline passed: no confirmed refresh for owner_ttl less the "
    "margin (this process was paused or starved, or Redis was unreachable)",
    "node-heartbeat": "the worker's node heartbeat found the liveness key gone",
    "node-state-lost": "Redis lost the worker's node record or group (restart without "
    "persistence, FLUSHALL, failover, eviction)",
}
#: What each cause means for the operator reading the heartbeat.lost line.
_LOSS_DETAIL = {
    CAUSE_OPERATOR: "an operator freed this owner's locks (`redislock release --force`); "
    "its liveness key was deleted",
    CAUSE_DECLARED_DEAD: "a cleanup declared this owner dead (its worker, reconcile or a "
    "successor node's eviction) and freed its locks",
    CAUSE_EXPIRED: "no confirmed refresh for owner_ttl: this process was paused, starved "
    "or partitioned from Redis longer than that (or Redis evicted the liveness key)",
    CAUSE_REDIS_LOST: "Redis lost its data (restart without persistence, FLUSHALL, "
    "failover to a replica that missed it) or evicted the lock",
}

#: Reason codes a cleanup leaves in the owner's tombstone ``{ns}:dead:<owner>``
#: and pushes to its lost list (``cleanup_owner(reason=...)``), and what
#: each means. Any other value (node_evict.lua writes '1') reads as declared dead.
CLEANUP_REASONS = {
    "operator": CAUSE_OPERATOR,
    "dead": CAUSE_DECLARED_DEAD,
}
#: The cause (``Lease.lost_cause``) of each engine loss code.
_CAUSES = {
    "operator": CAUSE_OPERATOR,
    "declared-dead": CAUSE_DECLARED_DEAD,
    "dead": CAUSE_DECLARED_DEAD,
    "deadline": CAUSE_EXPIRED,
    "expired": CAUSE_EXPIRED,
    "redis-lost": CAUSE_REDIS_LOST,
    "node-state-lost": CAUSE_REDIS_LOST,
    "grant-gone": CAUSE_REDIS_LOST,
}
#: The places whose finding is a missing liveness key (its cause is read).
KEY_GONE = ("heartbeat", "acquire", "watch", "node-heartbeat")


def cause_text(code: str | None) -> str | None:
    """The operator-facing cause of an engine loss code (or a cause itself)."""
    if code is None or code in LOST_CAUSES:
        return code
    return _CAUSES.get(code, CAUSE_DECLARED_DEAD if code in ("1", "lost") else CAUSE_EXPIRED)


def explain(cause: str | None, where: str) -> str:
    """The ``heartbeat.lost`` line's explanation of a cause found at ``where``."""
    return _LOSS_DETAIL.get(cause or "", _LOSS_CAUSES.get(where, _GONE))


#: The ``heartbeat.lost`` log line of an owner found lost (both front-ends).
LOST_LINE = (
    'heartbeat.lost owner=%s leases=%d where=%s cause="%s": %s; continuing under a new identity'
)


def lost_line(owner_id: str, leases: int, where: str, cause: str | None) -> tuple[object, ...]:
    """The arguments of the :data:`LOST_LINE` log call for an owner whose
    ``leases`` were lost at ``where`` for ``cause`` (a loss code or cause)."""
    reason = cause_text(cause)
    return (LOST_LINE, owner_id, leases, where, reason, explain(reason, where))


def metric_label(cause: str | None) -> str:
    """The ``cause`` label of ``redislock_leases_lost_total`` for a cause."""
    return LOST_CAUSE_LABELS.get(cause or "", "unknown")


def loss_code(tomb: str | None, counter: int, born: int | None, fence: int | None) -> str:
    """Why an owner's liveness key is gone, from what Redis still holds.

    ``tomb``: the owner's tombstone ``{ns}:dead:<owner>`` (None: none);
    ``counter``: whether the fencing counter ``{ns}:fence`` exists (EXISTS);
    ``born``: ``{ns}:born``, when the data set began (None: not recorded);
    ``fence``: the owner's latest grant (None: it holds none). The tombstone
    names the cleanup that declared the owner dead; without one, Redis lost
    its data when the counter (never deleted once written) is missing, or
    when the data set began after the owner's latest grant; otherwise the
    liveness expired.
    """
    if tomb is not None:
        return "operator" if tomb == "operator" else "declared-dead"
    if not counter:
        return "redis-lost"
    if fence is not None and born is not None and born > fence:
        return "redis-lost"
    return "expired"
