"""What one :class:`~celery_redislock.asyncio.AsyncLockManager` holds and owes.

Its mutable state, read and changed by the manager's parts (liveness,
acquire, release), all on the manager's one event loop: no lock is needed.
A forked child starts with an empty one (the parent's leases are the
parent's: never released from the child).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import TYPE_CHECKING, Any

from ..protocol.options import REGISTRY_SPILL_AT

if TYPE_CHECKING:
    from ..protocol.owner import Owner
    from ..protocol.request import Request
    from .lease import AsyncLease

__all__ = ["AsyncState", "TaskDepth"]


class TaskDepth:
    """Leases held by one asyncio task (to recognise its nested acquires).

    ``count``: leases the task holds (reentrant ones included); ``leases``:
    those with a grant of their own, which a nested acquire of the same
    task may re-enter.
    """

    __slots__ = ("__weakref__", "count", "leases")

    def __init__(self) -> None:
        self.count = 0
        #: In the order taken (a dict: no list removal on release).
        self.leases: dict[AsyncLease, None] = {}


class AsyncState:
    """The owner, leases, deferred releases and retired owners of one manager.

    Attributes:
        pid: the process the state belongs to (another one: forked).
        closed: :meth:`AsyncLockManager.close` ran (kept across a reset).
        owner: the current owner, None before the first acquire or once
            retired.
        leases: token -> lease, every lease with a grant of its own.
        deferred: token -> request, releases that failed on an exit path,
            retried by every heartbeat.
        spilled: owners whose registry spilled into buckets.
        doomed: owners retired by their local deadline whose liveness key
            may still live: the heartbeat force-cleans them.
        loop: the event loop the manager is bound to (None before its first use).
        beat_task: the heartbeat task.
        pending: shielded releases still running (kept referenced until done).
    """

    def __init__(self) -> None:
        self.closed = False
        self.reset()

    def reset(self) -> None:
        """Hold nothing (a new manager, or a forked child)."""
        self.pid = os.getpid()
        self.owner: Owner | None = None
        self.leases: dict[str, AsyncLease] = {}
        self.deferred: dict[str, Request] = {}
        self.spilled: set[str] = set()
        self.doomed: set[str] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.beat_task: asyncio.Task[None] | None = None
        self.pending: set[asyncio.Future[Any]] = set()
        self._depths: weakref.WeakKeyDictionary[asyncio.Task[Any], TaskDepth] = (
            weakref.WeakKeyDictionary()
        )
        #: Depth of code running outside any task (a loop callback).
        self._untasked = TaskDepth()

    def depth(self) -> TaskDepth:
        """The current asyncio task's :class:`TaskDepth` (made on first use)."""
        task = asyncio.current_task()
        if task is None:
            return self._untasked
        depth = self._depths.get(task)
        if depth is None:
            depth = self._depths[task] = TaskDepth()
        return depth

    def spill(self, owner: Owner) -> bool:
        """Whether the owner's registry spills into buckets (acquire.lua 's')."""
        if len(self.leases) < REGISTRY_SPILL_AT:
            return False
        self.spilled.add(owner.owner_id)
        return True

    def keep(self, future: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """Keep ``future`` referenced until it is done (a shielded release)."""
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)
        return future
