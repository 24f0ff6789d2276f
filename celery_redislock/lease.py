"""A lease: the locks one acquisition holds, until released."""

from __future__ import annotations

import os
import time
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
    """

    def __init__(
        self,
        manager: LockManager,
        request: _Request,
        ident: OwnerIdentity,
        token: str,
        fencing_token: int,
        depth: _Depth,
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
        self._released = False

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
        if not self._lost and not self._released and time.monotonic() > self._ident.valid_until:
            self._manager._deadline_passed(self._ident)
            self._lost = True
        return self._lost

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
        """True once :meth:`release` ran."""
        return self._released

    def check(self) -> None:
        """Raise :class:`LockLost` if the lease is lost; no Redis round trip.

        Lost means: the owner was found dead (heartbeat, lost-owner watcher,
        node heartbeat, a partial release), or the local deadline passed.
        """
        if self.lost:
            raise LockLost(self.resources, self.owner_id, self.fencing_token)

    def release(self) -> None:
        """Release every lock of the lease (owner-checked, one round trip).

        Idempotent. Only this lease's own token is deleted, so another lease
        of the same owner on a shared resource is untouched. Called in a
        forked child on a lease inherited from the parent, it does nothing.
        """
        self._manager._release(self)

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

    def _mark_lost(self) -> None:
        self._lost = True

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
        state = "lost" if self._lost else "released" if self._released else "held"
        return (
            f"<Lease {state} exclusive={list(self.exclusive)} shared={list(self.shared)} "
            f"fence={self.fencing_token} owner={self.owner_id}>"
        )
