"""What this process holds and owes: the engine's mutable state, reset after fork.

One :class:`ProcessState` per manager. Every part of the engine reads and
changes it under :attr:`ProcessState.lock`; a forked child starts with an
empty one (the parent's leases are the parent's: never released from the
child).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..protocol.options import REGISTRY_SPILL_AT

if TYPE_CHECKING:
    from ..protocol.request import Request
    from .identity import OwnerIdentity
    from .lease import Lease

__all__ = ["Depth", "ProcessState", "ReleaseRetry"]


class Depth:
    """Leases held by one thread or greenlet (to recognise nested acquires).

    ``count``: leases held (reentrant ones included); ``leases``: the leases
    with a grant of their own, which a nested acquire of the same thread or
    greenlet may re-enter, in the order they were taken; ``names``: how many
    of them name each resource, so that a request naming none of them is
    known not to re-enter anything without a look at every lease (a thread
    holding thousands of locks acquires another at the same cost).
    """

    __slots__ = ("count", "leases", "names")

    def __init__(self) -> None:
        self.count = 0
        self.leases: dict[Lease, None] = {}
        self.names: dict[str, int] = {}

    def add(self, lease: Lease) -> None:
        """Count ``lease`` among the thread's leases."""
        self.leases[lease] = None
        names = self.names
        for name in lease.request.resources:
            names[name] = names.get(name, 0) + 1

    def discard(self, lease: Lease) -> None:
        """Stop counting ``lease`` (if it was counted)."""
        if self.leases.pop(lease, 0) is not None:
            return
        names = self.names
        for name in lease.request.resources:
            left = names.get(name, 0) - 1
            if left > 0:
                names[name] = left
            else:
                names.pop(name, None)

    def may_hold(self, names: tuple[str, ...]) -> bool:
        """Whether some lease of the thread names one of ``names``."""
        held = self.names
        return any(name in held for name in names)


class ReleaseRetry:
    """Backoff of one deferred release: 0.5 s doubling up to a cap."""

    __slots__ = ("failures", "next_at")

    def __init__(self) -> None:
        self.failures = 0
        self.next_at = 0.0

    def failed(self, now: float, cap: float) -> float:
        """Count a failure; return the pause before the next try."""
        self.failures += 1
        pause = min(cap, 0.5 * 2.0 ** min(self.failures - 1, 16))
        self.next_at = now + pause
        return pause


class ProcessState:
    """The leases, deferred releases and retired owners of this process.

    Attributes:
        lock: guards every field below (and the leases' hold counts).
        leases: token -> lease, every lease with a grant of its own.
        deferred: token -> request, releases that failed on an exit path
            and are retried by the heartbeat.
        retries: token -> backoff of each deferred release.
        again: tokens among ``deferred`` released once already, kept for a
            second release because their acquire script was cut short in
            flight (it may reach Redis after the first release).
        waiting: tokens of this process's requests blocked in a wait now.
        doomed: owners retired by their local deadline whose liveness key
            may still exist: the heartbeat force-cleans them.
        spilled: owners whose registry spilled into buckets (their releases
            remove a name from its bucket too).
        spill_at: leases an owner holds before its registry spills.
    """

    def __init__(self) -> None:
        self.spill_at = REGISTRY_SPILL_AT
        self.reset()

    def reset(self) -> None:
        """Start empty (a new manager, or a forked child)."""
        self.lock = threading.Lock()
        self.leases: dict[str, Lease] = {}
        self.deferred: dict[str, Request] = {}
        self.retries: dict[str, ReleaseRetry] = {}
        self.again: set[str] = set()
        self.waiting: set[str] = set()
        self.doomed: set[str] = set()
        self.spilled: set[str] = set()
        self._local = threading.local()

    def after_fork_in_child(self) -> None:
        """The parent's leases are not ours: marked lost, forgotten."""
        for lease in self.leases.values():
            lease.mark_inherited()
        self.reset()

    def depth(self) -> Depth:
        """The calling thread's (or greenlet's) :class:`Depth`."""
        depth: Depth | None = getattr(self._local, "depth", None)
        if depth is None:
            depth = self._local.depth = Depth()
        return depth

    def holds(self, ident: OwnerIdentity) -> bool:
        """Whether ``ident`` holds any lease."""
        with self.lock:
            return any(x.owner_id == ident.owner_id for x in self.leases.values())

    def of_owner(self, owner_id: str) -> list[Lease]:
        """The leases of ``owner_id`` (a snapshot)."""
        with self.lock:
            return [x for x in self.leases.values() if x.owner_id == owner_id]

    def spill(self, owner_id: str) -> bool:
        """Whether the owner holds :attr:`spill_at` leases: its resource
        names then go to its registry's buckets (acquire.lua flag 's')."""
        if len(self.leases) < self.spill_at:
            return False
        # Recorded before the script runs: a release from now on may meet
        # a name in a bucket.
        self.spilled.add(owner_id)
        return True

    def busy(self) -> bool:
        """Whether there is anything a lost-owner watcher is for: a lease,
        a request waiting, a deferred release or a retired owner."""
        return bool(self.leases or self.waiting or self.deferred or self.doomed)
