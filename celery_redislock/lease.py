"""A lease: the locks one acquisition holds, until released."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from .exceptions import LockLost

if TYPE_CHECKING:
    from .identity import OwnerIdentity
    from .manager import LockManager, _Depth, _Request


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
        manager: LockManager,
        request: _Request,
        ident: OwnerIdentity,
        token: str,
        fencing_token: int,
        depth: _Depth,
        *,
        own: bool = True,
    ) -> None:
        self._manager = manager
        self._request = request
        self._ident = ident
        self.owner_id = ident.owner_id
        self.token = token
        self.fencing_token = fencing_token
        self.exclusive = request.exclusive
        self.shared = request.shared
        self.acquired_at = time.time()
        self.pid = os.getpid()
        self._depth = depth
        self._lost = False
        #: Why the lease was lost (one of ``exceptions.LOST_CAUSES``), once known.
        self._lost_cause: str | None = None
        #: Called once, with the lease and the cause, when it is marked lost
        #: (from whichever thread found out: heartbeat, watcher, node tick).
        self._lost_hooks: list[Callable[[Lease, str | None], None]] = []
        #: The grant of ``request`` is released in Redis (or was never ours).
        self._released = False
        #: :meth:`release` was called on this lease.
        self._handle_released = False
        #: Whether this lease has a grant of its own (False: purely reentrant).
        self._own = own
        #: Leases counting on this lease's grant, itself included; the grant
        #: is released in Redis when it drops to 0.
        self._holds = 1
        #: Outer leases this one counts on (reentrant resources).
        self._parents: tuple[Lease, ...] = ()
        #: The grant left no request state, wake list or holder record in
        #: Redis (acquire.lua granted it in the call that replied, without
        #: holder info): release.lua need not delete them.
        self._clean = False

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource held, exclusive first."""
        return self.exclusive + self.shared

    @property
    def lost(self) -> bool:
        """Whether the owner's liveness lapsed (the locks may belong to another).

        Also True, without asking Redis, once the owner's local liveness
        deadline passed (:attr:`deadline`): a holder resumed from a pause
        longer than ``owner_ttl`` sees it at once.
        """
        if self._parents and any(p.lost for p in self._parents):
            return True
        if not self._own:
            return self._lost
        if not self._lost and not self._released and time.monotonic() > self._ident.valid_until:
            self._manager._deadline_passed(self._ident)
            self._mark_lost("deadline")
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
        for p in self._parents:
            if p.lost:
                return p.lost_cause
        return None

    @property
    def reentrant(self) -> bool:
        """True when some resources are held through an outer lease (nested)."""
        return bool(self._parents)

    @property
    def deadline(self) -> float:
        """Monotonic time (:func:`time.monotonic`) after which the lease is lost.

        The start of the last confirmed refresh of the owner's liveness plus
        ``owner_ttl``, less a safety margin (docs/design.md, "Loss model");
        moved forward by every heartbeat that extends the liveness key.
        """
        return self._ident.valid_until

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
        return self._manager._release(self)

    def contenders(self) -> int:
        """How many other requests wait for any of this lease's resources.

        One round trip. Use it to yield a long-held lock cooperatively.
        """
        return self._manager._contenders(self)

    def wait_for_contender(self, timeout: float) -> bool:
        """Block until some request waits for this lease's resources.

        Woken by push (the waiter's acquire script signals the holder), not
        by polling. Returns True at once if a contender is already waiting,
        False if none came within ``timeout`` seconds.
        """
        return self._manager._wait_for_contender(self, timeout)

    def _add_lost_hook(self, hook: Callable[[Lease, str | None], None]) -> None:
        """Call ``hook(lease, cause)`` once this lease (or an outer one) is marked lost.

        Called at once if it already is. For a reentrant lease the hook is
        attached to the outer lease(s) too, whose loss is this one's.
        """
        self._lost_hooks.append(hook)
        for p in self._parents:
            p._add_lost_hook(lambda _lease, cause: hook(self, cause))
        if self._lost:
            hook(self, self._lost_cause)

    def _mark_lost(self, cause: str | None = None) -> None:
        """Mark the lease lost (once; ``cause`` is an engine cause, see manager)."""
        if self._lost:
            if self._lost_cause is None and cause is not None:
                self._lost_cause = self._manager._cause_text(cause)
            return
        self._lost_cause = self._manager._cause_text(cause) if cause is not None else None
        self._lost = True
        metrics = self._manager._metrics
        if metrics is not None:
            from .metrics import LOST_CAUSE_LABELS

            metrics.lease_lost(LOST_CAUSE_LABELS.get(self._lost_cause or "", "unknown"))
        for hook in list(self._lost_hooks):
            try:
                hook(self, self._lost_cause)
            except Exception:  # a hook must never break the thread that found the loss
                import logging

                logging.getLogger("celery_redislock.heartbeat").exception(
                    "heartbeat.lost-hook-error token=%s", self.token
                )

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
        if self._parents:
            state += " reentrant"
        return (
            f"<Lease {state} exclusive={list(self.exclusive)} shared={list(self.shared)} "
            f"fence={self.fencing_token} owner={self.owner_id}>"
        )
