"""An asyncio lease: the locks one ``await manager.acquire(...)`` holds."""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from ..exceptions import LockLost
from ..protocol.causes import cause_text

if TYPE_CHECKING:
    from ..protocol.owner import Owner
    from ..protocol.request import Request
    from .state import TaskDepth

__all__ = ["AsyncLease"]


class LeaseHost(Protocol):
    """What an :class:`AsyncLease` asks of the manager that granted it."""

    async def release_lease(self, lease: AsyncLease) -> bool:
        """Release the lease's grant (see :meth:`AsyncLease.release`)."""

    async def lease_contenders(self, lease: AsyncLease) -> int:
        """How many other requests wait for the lease's resources."""

    async def wait_for_contender(self, lease: AsyncLease, timeout: float) -> bool:
        """Wait until a request waits for the lease's resources."""

    def deadline_passed(self, owner: Owner) -> None:
        """A lease of ``owner`` found its local deadline passed (no I/O)."""


class AsyncLease:
    """Locks granted to one request of an
    :class:`~celery_redislock.asyncio.AsyncLockManager`, released together.

    Attributes:
        fencing_token: from the namespace's one monotonic counter, shared
            with every :class:`~celery_redislock.LockManager`: larger than
            that of every earlier grant, whichever front-end made it.
        owner_id: the owner the locks are registered to (one per manager).
        token: the holder token stored in every lock (``owner|request id``).
        exclusive, shared, limited: the resources held in each mode
            (``limited``: name -> limit).

    A lease returned by a nested acquire of resources the same asyncio task
    already holds is *reentrant* (:attr:`reentrant`): granted at once
    without a round trip, it counts on the outer lease, whose fencing token
    it carries, and the locks are released in Redis only when the last of
    the leases sharing them is released, as for the threaded
    :class:`~celery_redislock.Lease`.

    ``async with lease:`` releases it on exit. :meth:`check` and
    :attr:`lost` make no round trip: a lease is lost once the manager's
    heartbeat found the owner's liveness gone (a Redis restart, FLUSHALL, a
    forced release), or once its local deadline passed (no confirmed
    refresh for ``owner_ttl`` less a margin: the event loop was blocked, or
    Redis out of reach), as for the threaded manager's :class:`~celery_redislock.Lease`.
    """

    def __init__(
        self,
        host: LeaseHost,
        request: Request,
        owner: Owner,
        token: str,
        fencing_token: int,
        depth: TaskDepth,
        *,
        own: bool = True,
        clean: bool = False,
    ) -> None:
        self._host = host
        #: Manager side: the validated request and the owner of the grant.
        self.request = request
        self.owner = owner
        self.owner_id = owner.owner_id
        self.token = token
        self.fencing_token = fencing_token
        self.exclusive = request.exclusive
        self.shared = request.shared
        self.limited: dict[str, int] = request.limit_map
        self.acquired_at = time.time()
        self.pid = os.getpid()
        #: The grant left no request state or wake list (granted by the
        #: script call that replied): release.lua skips their DEL.
        self.clean = clean
        self._lost = False
        self._lost_cause: str | None = None
        #: The grant is released in Redis (or was never this lease's: a
        #: purely reentrant lease has no grant of its own).
        self._released = not own
        #: :meth:`release` was called on this lease.
        self._handle_released = False
        #: Whether this lease has a grant of its own.
        self.own = own
        #: Leases counting on this lease's grant, itself included; the
        #: grant is released in Redis when it drops to 0.
        self._holds = 1
        #: Outer leases this one counts on (re-entered resources).
        self.parents: tuple[AsyncLease, ...] = ()
        #: The task's depth the lease counts in.
        self.depth = depth

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource held, the exclusive ones first, then shared, then limited."""
        return self.exclusive + self.shared + tuple(self.limited)

    @property
    def lost(self) -> bool:
        """Whether the owner's liveness lapsed (the locks may belong to another).

        True without a round trip once the local deadline (:attr:`deadline`)
        passed.
        """
        if self.parents and any(p.lost for p in self.parents):
            return True
        if not self.own:
            return self._lost
        if not self._lost and not self._released and time.monotonic() > self.owner.valid_until:
            self._host.deadline_passed(self.owner)
            self.mark_lost("deadline")
        return self._lost

    @property
    def lost_cause(self) -> str | None:
        """Why the lease (or an outer lease it counts on) was lost, or None.

        One of ``celery_redislock.exceptions.LOST_CAUSES``; None while not lost.
        """
        if not self.lost:
            return None
        if self._lost_cause is not None:
            return self._lost_cause
        for p in self.parents:
            if p.lost:
                return p.lost_cause
        return None

    @property
    def reentrant(self) -> bool:
        """True when some resources are held through an outer lease (nested)."""
        return bool(self.parents)

    @property
    def deadline(self) -> float:
        """Monotonic time after which the lease is lost (see the Loss model)."""
        return self.owner.valid_until

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran on this lease.

        A lease whose locks an inner reentrant lease still counts on keeps
        them in Redis until that one is released too.
        """
        return self._handle_released

    def check(self) -> None:
        """Raise :class:`~celery_redislock.LockLost` if the lease is lost; no Redis round trip."""
        if self.lost:
            raise LockLost(self.resources, self.owner_id, self.fencing_token, self.lost_cause)

    async def release(self) -> bool:
        """Release every lock of the lease (owner-checked, one round trip).

        True for the call that released it, False for any later one (and in
        a forked child, for a lease of the parent). A reentrant lease (or an
        outer lease a reentrant one still counts on) only drops its count:
        no round trip until the last one is released. The round trip is
        shielded from cancellation: a release that was sent completes, and
        one that fails (Redis out of reach) is retried by the heartbeat.
        """
        return await self._host.release_lease(self)

    async def contenders(self) -> int:
        """How many other requests wait for any of this lease's resources (one round trip)."""
        return await self._host.lease_contenders(self)

    async def wait_for_contender(self, timeout: float) -> bool:
        """Wait until some request waits for this lease's resources.

        Woken by push (the waiter's acquire script signals the holder), not
        by polling, without blocking the event loop. True at once if a
        contender is already waiting, False if none came within ``timeout``
        seconds. As for :meth:`Lease.wait_for_contender
        <celery_redislock.Lease.wait_for_contender>`.
        """
        return await self._host.wait_for_contender(self, timeout)

    # -- manager side -----------------------------------------------------

    def mark_lost(self, cause: str | None = None) -> None:
        """Mark the lease lost (once; ``cause``: an engine loss code or a cause)."""
        if self._lost:
            if self._lost_cause is None and cause is not None:
                self._lost_cause = cause_text(cause)
            return
        self._lost_cause = cause_text(cause) if cause is not None else None
        self._lost = True

    @property
    def active(self) -> bool:
        """Neither marked lost nor released in Redis (no deadline check, no I/O)."""
        return not self._lost and not self._released

    @property
    def grant_released(self) -> bool:
        """The grant is released in Redis (or was never this lease's)."""
        return self._released

    def share(self, parents: tuple[AsyncLease, ...]) -> None:
        """Count on ``parents`` for some resources (a reentrant acquire)."""
        for p in parents:
            p.hold()
        self.parents = parents

    def hold(self) -> None:
        """One more lease counts on this lease's grant."""
        self._holds += 1

    def count_in(self) -> None:
        """Count the lease as held by its task (which may re-enter it)."""
        self.depth.leases[self] = None
        self.depth.count += 1

    def mark_released(self) -> bool:
        """Mark :meth:`release` called (the task holds one lease fewer);
        False if it was already."""
        if self._handle_released:
            return False
        self._handle_released = True
        self.depth.count = max(0, self.depth.count - 1)
        return True

    def drop_hold(self, *, force: bool = False) -> bool:
        """One fewer lease counts on the grant (``force``: none does).

        True when the count reached 0 now: the grant must be released in
        Redis (its task can no longer re-enter it)."""
        self._holds = 0 if force else self._holds - 1
        if self._holds > 0 or self._released:
            return False
        self._released = True
        self.uncount()
        return True

    def forget(self) -> None:
        """Nothing of it is ours to release (inherited across a fork)."""
        self._handle_released = True
        self._released = True
        self.uncount()

    def uncount(self) -> None:
        """Stop counting the lease as one its task may re-enter."""
        self.depth.leases.pop(self, None)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    def __repr__(self) -> str:
        state = "lost" if self._lost else "released" if self._handle_released else "held"
        if self.parents:
            state += " reentrant"
        limited = f" limited={self.limited}" if self.limited else ""
        return (
            f"<AsyncLease {state} exclusive={list(self.exclusive)} shared={list(self.shared)}"
            f"{limited} fence={self.fencing_token} owner={self.owner_id}>"
        )
