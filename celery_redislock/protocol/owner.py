"""One lock owner as a manager knows it, and the rule of its local deadline.

No I/O. The threaded manager (:class:`~celery_redislock.engine.identity.OwnerIdentity`,
which adds the process tag) and the asyncio one share both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .keys import new_owner_id

__all__ = ["Owner", "confirmed_until"]


@dataclass
class Owner:
    """One owner: its id, the pid it belongs to, and whether Redis knows it."""

    owner_id: str = field(default_factory=new_owner_id)
    pid: int = field(default_factory=os.getpid)
    #: True once an acquire registered the liveness key (SET NX).
    registered: bool = False
    #: Monotonic time until which this owner's liveness is known to hold:
    #: start of the last confirmed refresh + the TTL it left, less a margin
    #: (:func:`confirmed_until`); 0.0 until the first confirmation. Past it,
    #: every lease of the owner is lost, whatever Redis says later.
    valid_until: float = 0.0
    #: True once a script added this owner to ``{ns}:owners`` (its first
    #: grant or queued request): later acquires skip the SADD. Nothing takes
    #: a live owner out of the set, only the cleanup that retires it; a
    #: release that finds a grant gone (data lost in a failover, say) resets
    #: it, so the next grant lists the owner again.
    listed: bool = False


def confirmed_until(valid_until: float, started: float, ttl: float, margin: float) -> float:
    """The owner's new deadline after a refresh confirmed ``ttl`` seconds of
    liveness, sent at monotonic time ``started``: the key cannot expire in
    Redis before ``started + ttl``, less ``margin``; a deadline still ahead
    at ``started`` is never moved back. (A refresh that started after the
    deadline had passed must be refused by the caller, not confirmed.)"""
    floor = valid_until if started <= valid_until else 0.0
    return max(floor, started + ttl - margin)
