"""A lease: the locks one acquisition holds, until released.

A :class:`Lease` talks to the engine only through :class:`LeaseHost`, the
small protocol defined here (the engine's release part implements it). Its
hold counting (reentrant leases counting on an outer one) is its own state,
changed by the engine through the methods marked *engine side*, always
under the engine's state lock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from ..exceptions import LockLost
from ..protocol.causes import cause_text

if TYPE_CHECKING:
    from ..protocol.request import Request
    from .identity import OwnerIdentity
    from .state import Depth

log = logging.getLogger("celery_redislock.heartbeat")


class LeaseHost(Protocol):
    """What a lease asks of the engine that granted it."""

    def release(self, lease: Lease) -> bool:
        """Release the lease's handle (see :meth:`Lease.release`)."""

    def contenders(self, lease: Lease) -> int:
        """How many other requests wait for the lease's resources."""

    def wait_for_contender(self, lease: Lease, timeout: float) -> bool:
        """Block until a request waits for the lease's resources."""

    def deadline_passed(self, ident: OwnerIdentity) -> None:
        """A lease of ``ident`` found its local deadline passed."""

    def lease_lost(self, cause: str | None) -> None:
        """A lease was marked lost (metrics)."""


class Lease:
    """Locks granted to one request, released together.

    Attributes:
        fencing_token: number from one monotonic counter, larger than that of
            every earlier acquisition in the namespace; pass it to the store
            the lock protects so it can refuse a stale holder's writes.
        owner_id: the owner (process) the locks are registered to.
        token: the holder token stored in every lock (``owner|request id``).
        exclusive, shared: the resource names held in each mode.

    A lease returned by a nested acquire of resources the same thread,
    greenlet or task already holds is *reentrant*: it is granted at once
    without a round trip and counts on the outer lease(s) (like
    ``threading.RLock``). Its fencing token is the outer one, its
    :attr:`lost` and :meth:`check` reflect the outer lease(s), and the locks
    are released in Redis only when the last of the leases sharing them is
    released (normally the outermost). A request that holds some of its
    resources and not others takes the rest (a grant of its own) and counts
    on the outer lease(s) for the held ones.
    """

    def __init__(
        self,
        host: LeaseHost,
        request: Request,
        ident: OwnerIdentity,
        token: str,
        fencing_token: int,
        depth: Depth,
        *,
        own: bool = True,
        clean: bool = False,
    ) -> None:
        self._host = host
        # Engine side (read by the engine that granted the lease, never
        # written from outside it): the validated request and the identity
        # the grant is registered to.
        self.request = request
        self.ident = ident
        self.owner_id = ident.owner_id
        self.token = token
        self.fencing_token = fencing_token
        self.exclusive = request.exclusive
        self.shared = request.shared
        #: The limited resources held (one slot each) and their limits.
        self.limited: dict[str, int] = request.limit_map
        self.acquired_at = time.time()
        self.pid = os.getpid()
        self._depth = depth
        self._lost = False
        #: Why the lease was lost (one of ``exceptions.LOST_CAUSES``), once known.
        self._lost_cause: str | None = None
        #: Called once, with the lease and the cause, when it is marked lost
        #: (from whichever thread found out: heartbeat, watcher, node tick).
        self._lost_hooks: list[Callable[[Lease, str | None], None]] = []
        #: The grant of ``request`` is released in Redis (or was never ours:
        #: a purely reentrant lease has no grant of its own).
        self._released = not own
        #: :meth:`release` was called on this lease.
        self._handle_released = False
        #: Whether this lease has a grant of its own (not when purely reentrant).
        self.own = own
        #: Leases counting on this lease's grant, itself included; the grant
        #: is released in Redis when it drops to 0.
        self._holds = 1
        #: Outer leases this one counts on (reentrant resources).
        self.parents: tuple[Lease, ...] = ()
        #: The grant left no request state, wake list or holder record in
        #: Redis (acquire.lua granted it in the call that replied, without
        #: holder info): release.lua need not delete them.
        self.clean = clean

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource held, the exclusive ones first, then shared, then limited."""
        return self.exclusive + self.shared + tuple(self.limited)

    @property
    def lost(self) -> bool:
        """Whether the owner's liveness lapsed (the locks may belong to another).

        Also True, without asking Redis, once the owner's local liveness
        deadline passed (:attr:`deadline`): a holder resumed from a pause
        longer than ``owner_ttl`` sees it at once.
        """
        if self.parents and any(p.lost for p in self.parents):
            return True
        if not self.own:
            return self._lost
        if not self._lost and not self._released and time.monotonic() > self.ident.valid_until:
            self._host.deadline_passed(self.ident)
            self.mark_lost("deadline")
        return self._lost

    @property
    def lost_cause(self) -> str | None:
        """Why the lease (or an outer lease it counts on) was lost, or None.

        One of ``"released by operator via CLI"``, ``"owner declared dead"``,
        ``"liveness expired"``, ``"Redis lost the lock"`` (see
        ``celery_redislock.exceptions.LOST_CAUSES``); None while not lost.
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
        """Monotonic time (:func:`time.monotonic`) after which the lease is lost.

        The start of the last confirmed refresh of the owner's liveness plus
        ``owner_ttl``, less a safety margin (docs/design.md, "Loss model");
        moved forward by every heartbeat that extends the liveness key.
        """
        return self.ident.valid_until

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran on this lease.

        A lease whose locks an inner reentrant lease still counts on keeps
        them in Redis until that one is released too.
        """
        return self._handle_released

    def check(self) -> None:
        """Raise :class:`LockLost` if the lease is lost; no Redis round trip.

        Lost means: the owner was found dead (heartbeat, lost-owner watcher,
        node heartbeat, a partial release), or the local deadline passed.
        """
        if self.lost:
            raise LockLost(self.resources, self.owner_id, self.fencing_token, self.lost_cause)

    def release(self) -> bool:
        """Release every lock of the lease (owner-checked, one round trip).

        Idempotent: returns True for the call that released the lease, False
        for any later call (python-redis-lock raises ``NotAcquired`` there;
        here a second release is harmless and only answers False). Only this
        lease's own token is deleted, so another lease of the same owner on a
        shared resource is untouched. Called in a forked child on a lease
        inherited from the parent, it does nothing and returns False.
        A reentrant lease (or an outer lease a reentrant one still counts on)
        only drops its count: no round trip until the last one is released.
        A lease that was lost meanwhile is still released (True): ``lost``
        says whether it still held its locks.
        """
        return self._host.release(self)

    def contenders(self) -> int:
        """How many other requests wait for any of this lease's resources.

        One round trip. Use it to yield a long-held lock cooperatively.
        """
        return self._host.contenders(self)

    def wait_for_contender(self, timeout: float) -> bool:
        """Block until some request waits for this lease's resources.

        Woken by push (the waiter's acquire script signals the holder), not
        by polling. Returns True at once if a contender is already waiting,
        False if none came within ``timeout`` seconds.
        """
        return self._host.wait_for_contender(self, timeout)

    def add_lost_hook(self, hook: Callable[[Lease, str | None], None]) -> None:
        """Call ``hook(lease, cause)`` once this lease (or an outer one) is marked lost.

        Called at once if it already is. For a reentrant lease the hook is
        attached to the outer lease(s) too, whose loss is this one's. Hooks
        run in whichever thread found the loss (heartbeat, watcher, node
        tick): they must be quick and must not block.
        """
        self._lost_hooks.append(hook)
        for p in self.parents:
            p.add_lost_hook(lambda _lease, cause: hook(self, cause))
        if self._lost:
            hook(self, self._lost_cause)

    # -- engine side: called by the engine that granted the lease ----------

    @property
    def active(self) -> bool:
        """Neither marked lost nor released in Redis (no deadline check, no I/O)."""
        return not self._lost and not self._released

    @property
    def grant_released(self) -> bool:
        """The grant is released in Redis (or was never this lease's)."""
        return self._released

    def mark_lost(self, cause: str | None = None) -> None:
        """Mark the lease lost (once; ``cause``: an engine loss code or a cause)."""
        if self._lost:
            if self._lost_cause is None and cause is not None:
                self._lost_cause = cause_text(cause)
            return
        self._lost_cause = cause_text(cause) if cause is not None else None
        self._lost = True
        self._host.lease_lost(self._lost_cause)
        for hook in list(self._lost_hooks):
            try:
                hook(self, self._lost_cause)
            except Exception:  # a hook must never break the thread that found the loss
                log.exception("heartbeat.lost-hook-error token=%s", self.token)

    def mark_inherited(self) -> None:
        """In a forked child: the parent's lease, never released from here."""
        self._lost = True

    def share(self, parents: tuple[Lease, ...]) -> None:
        """Count on ``parents`` for some resources (a reentrant acquire)."""
        for p in parents:
            p.hold()
        self.parents = parents

    def hold(self) -> None:
        """One more lease counts on this lease's grant."""
        self._holds += 1

    def count_in(self, depth: Depth) -> None:
        """Count the lease as held by the thread whose ``depth`` this is."""
        self._depth = depth
        depth.add(self)
        depth.count += 1

    def close_handle(self, *, uncount: bool = True) -> bool:
        """Mark :meth:`release` called; False if it was already.

        ``uncount``: the holding thread holds one lease fewer."""
        if self._handle_released:
            return False
        self._handle_released = True
        if uncount:
            self._depth.count = max(0, self._depth.count - 1)
        return True

    def forget(self) -> None:
        """Released without a round trip: inherited across a fork."""
        self._handle_released = True
        self._released = True

    def drop_hold(self, *, force: bool = False) -> bool:
        """One fewer lease counts on the grant (``force``: none does).

        True when the count reached 0 now: the grant must be released in
        Redis (the lease no longer counts in its thread's depth)."""
        self._holds = 0 if force else self._holds - 1
        if self._holds > 0 or self._released:
            return False
        self._released = True
        self.uncount()
        return True

    def uncount(self) -> None:
        """Stop counting the lease as one its thread may re-enter."""
        self._depth.discard(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "lost" if self._lost else "released" if self._handle_released else "held"
        if self.parents:
            state += " reentrant"
        limited = f" limited={self.limited}" if self.limited else ""
        return (
            f"<Lease {state} exclusive={list(self.exclusive)} shared={list(self.shared)}"
            f"{limited} fence={self.fencing_token} owner={self.owner_id}>"
        )
