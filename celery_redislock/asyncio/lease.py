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

__all__ = ["AsyncLease"]


class LeaseHost(Protocol):
    """What an :class:`AsyncLease` asks of the manager that granted it."""

    async def release_lease(self, lease: AsyncLease) -> bool:
        """Release the lease's grant (see :meth:`AsyncLease.release`)."""

    async def lease_contenders(self, lease: AsyncLease) -> int:
        """How many other requests wait for the lease's resources."""

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
        *,
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
        self._released = False

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
        if not self._lost and not self._released and time.monotonic() > self.owner.valid_until:
            self._host.deadline_passed(self.owner)
            self.mark_lost("deadline")
        return self._lost

    @property
    def lost_cause(self) -> str | None:
        """Why the lease was lost (one of ``exceptions.LOST_CAUSES``), or None."""
        return self._lost_cause if self.lost else None

    @property
    def deadline(self) -> float:
        """Monotonic time after which the lease is lost (see the Loss model)."""
        return self.owner.valid_until

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._released

    @property
    def active(self) -> bool:
        """Neither lost nor released (no deadline check, no I/O)."""
        return not self._lost and not self._released

    def check(self) -> None:
        """Raise :class:`~celery_redislock.LockLost` if the lease is lost; no Redis round trip."""
        if self.lost:
            raise LockLost(self.resources, self.owner_id, self.fencing_token, self.lost_cause)

    async def release(self) -> bool:
        """Release every lock of the lease (owner-checked, one round trip).

        True for the call that released it, False for any later one (and in
        a forked child, for a lease of the parent). The round trip is
        shielded from cancellation: a release that was sent completes, and
        one that fails (Redis out of reach) is retried by the heartbeat.
        """
        return await self._host.release_lease(self)

    async def contenders(self) -> int:
        """How many other requests wait for any of this lease's resources (one round trip)."""
        return await self._host.lease_contenders(self)

    # -- manager side -----------------------------------------------------

    def mark_lost(self, cause: str | None = None) -> None:
        """Mark the lease lost (once; ``cause``: an engine loss code or a cause)."""
        if self._lost:
            if self._lost_cause is None and cause is not None:
                self._lost_cause = cause_text(cause)
            return
        self._lost_cause = cause_text(cause) if cause is not None else None
        self._lost = True

    def mark_released(self) -> bool:
        """Mark :meth:`release` called; False if it was already."""
        if self._released:
            return False
        self._released = True
        return True

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
        state = "lost" if self._lost else "released" if self._released else "held"
        limited = f" limited={self.limited}" if self.limited else ""
        return (
            f"<AsyncLease {state} exclusive={list(self.exclusive)} shared={list(self.shared)}"
            f"{limited} fence={self.fencing_token} owner={self.owner_id}>"
        )
