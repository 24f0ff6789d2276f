"""The reentrancy rule: which held leases a nested request re-enters.

No I/O, no state of its own. A request some of whose resources the caller
(a thread or greenlet of a :class:`~celery_redislock.LockManager`, a task of
an :class:`~celery_redislock.asyncio.AsyncLockManager`) already holds is
granted those at once and counts on the outer lease, like
``threading.RLock``; the rest is a nested acquire of its own. Both
front-ends ask :func:`plan` with the caller's live leases.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..exceptions import InvalidResource, LockUpgradeError
from .request import Request

__all__ = ["Held", "Reentry", "check_nested", "plan"]


class Held(Protocol):
    """What :func:`plan` reads of a held lease."""

    @property
    def request(self) -> Request:
        """The validated request the lease was granted for."""

    @property
    def lost(self) -> bool:
        """Whether the lease is lost (it then holds nothing)."""


_L = TypeVar("_L", bound=Held)


@dataclass(frozen=True)
class Reentry(Generic[_L]):
    """What a nested request re-enters, and what it still has to acquire."""

    parents: tuple[_L, ...]
    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    limited: dict[str, int]


def plan(leases: Iterable[_L], req: Request) -> Reentry[_L] | None:
    """Which of ``req``'s resources the caller already holds through ``leases``.

    ``leases``: the caller's leases whose grant is not released yet.
    Returns None when they hold none of the resources, else the outer
    leases that hold some and the exclusive, shared and limited resources
    still to acquire. Raises :class:`LockUpgradeError` for an exclusive
    request of a resource held only shared, and :class:`InvalidResource`
    for a resource held limited and asked for exclusive or shared, or the
    other way round. A held slot of a limited resource covers a nested
    request for a slot of it (re-entered, no second slot). A lost outer
    lease is not re-entered.
    """
    # A lost lease holds nothing any more (its owner is retired): the
    # request is a fresh one for those resources, not a reentry.
    live = [x for x in leases if not x.lost]
    held: dict[str, tuple[_L, str]] = {}
    for lease in live:
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
            f"resources held limited by this thread or task cannot be taken exclusive or "
            f"shared, nor held ones taken limited: {sorted(mixed)}",
            sorted(mixed),
        )
    parents = tuple(dict.fromkeys(held[n][0] for n in req.resources if n in held))
    if not parents:
        return None
    rest_ex = tuple(n for n in req.exclusive if n not in held)
    rest_sh = tuple(n for n in req.shared if n not in held)
    rest_lim = {n: c for n, c in req.limit_map.items() if n not in held}
    return Reentry(parents, rest_ex, rest_sh, rest_lim)


def check_nested(nested: bool, timeout: float | None) -> None:
    """Refuse a nested request without a finite timeout (ValueError).

    A nested request (made while the caller holds a lock) skips the wait
    queue and waits only for holders; without a timeout it could wait for
    ever.
    """
    if nested and timeout is None:
        raise ValueError(
            "a nested acquire (made while this thread or task holds a lock) needs a finite "
            "timeout: it skips the wait queue and could otherwise wait for ever"
        )
