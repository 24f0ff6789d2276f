"""Nested acquires of the same thread: which held leases a request re-enters.

No I/O. A request some of whose resources the calling thread or greenlet
already holds (through a lease not yet released) is granted those at once
and counts on the outer lease, like ``threading.RLock``; the rest is a
nested acquire of their own. The rule is
:func:`celery_redislock.protocol.reentry.plan`, shared with the asyncio
front-end; this module picks the thread's leases it applies to.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ..protocol import reentry
from ..protocol.request import Request
from .lease import Lease
from .state import Depth, ProcessState

__all__ = ["Reentry", "plan"]


class Reentry(NamedTuple):
    """What a nested request re-enters, and what it still has to acquire."""

    parents: tuple[Lease, ...]
    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    limited: dict[str, int]


def plan(state: ProcessState, depth: Depth, req: Request) -> Reentry | None:
    """Which of ``req``'s resources this thread/greenlet already holds.

    Returns None when it holds none of them, else the outer leases that hold
    some and the resources still to acquire; raises as
    :func:`celery_redislock.protocol.reentry.plan` does.
    """
    pid = os.getpid()
    with state.lock:
        if not depth.may_hold(req.resources):
            return None  # none of its names is held by this thread: O(request)
        leases = [x for x in depth.leases if not x.grant_released and x.pid == pid]
    found = reentry.plan(leases, req)
    if found is None:
        return None
    return Reentry(found.parents, found.exclusive, found.shared, found.limited)
