"""Nested acquires of the same thread: which held leases a request re-enters.

No I/O. A request some of whose resources the calling thread or greenlet
already holds (through a lease not yet released) is granted those at once
and counts on the outer lease, like ``threading.RLock``; the rest is a
nested acquire of their own.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ..exceptions import InvalidResource, LockUpgradeError
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
    some and the exclusive, shared and limited resources still to acquire.
    Raises :class:`LockUpgradeError` for an exclusive request of a resource
    held only shared, and :class:`InvalidResource` for a resource held
    limited and asked for exclusive or shared, or the other way round. A
    held slot of a limited resource covers a nested request for a slot of
    it (re-entered, no second slot). A lost outer lease is not re-entered.
    """
    pid = os.getpid()
    with state.lock:
        if not depth.may_hold(req.resources):
            return None  # none of its names is held by this thread: O(request)
        leases = [x for x in depth.leases if not x.grant_released and x.pid == pid]
    # A lost lease holds nothing any more (its identity is retired): the
    # request is a fresh one for those resources, not a reentry.
    leases = [x for x in leases if not x.lost]
    held: dict[str, tuple[Lease, str]] = {}
    for lease in leases:
        for name in lease.request.exclusive:
            held[name] = (lease, "x")
        for name in lease.request.shared:
            held.setdefault(name, (lease, "s"))
        for name in lease.request.limited:
            held.setdefault(name, (lease, "l"))
    upgrade = [n for n in req.exclusive if n in held and held[n][1] == "s"]
    if upgrade:
        raise LockUpgradeError(upgrade)
    mixed = [n for n in req.resources if n in held and (held[n][1] == "l") != (n in req.limited)]
    if mixed:
        raise InvalidResource(
            f"resources held limited by this thread cannot be taken exclusive or shared, "
            f"nor held ones taken limited: {sorted(mixed)}",
            sorted(mixed),
        )
    parents = tuple(dict.fromkeys(held[n][0] for n in req.resources if n in held))
    if not parents:
        return None
    rest_ex = tuple(n for n in req.exclusive if n not in held)
    rest_sh = tuple(n for n in req.shared if n not in held)
    rest_lim = {n: c for n, c in req.limit_map.items() if n not in held}
    return Reentry(parents, rest_ex, rest_sh, rest_lim)
