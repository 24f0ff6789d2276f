"""The engine's metrics hook: what a lock process reports, and when.

A :class:`LockManager` made with ``metrics=<hook>`` calls the hook in the
process that does the work (a pool child for its acquires and releases, the
worker's main process for the cleanups its node heartbeat makes). Without a
hook (the default) each of these places costs one ``is None`` test; nothing
here imports a metrics library. :mod:`celery_redislock.ops.prometheus` (the
``prometheus`` extra) is the implementation the worker uses when
``redislock_metrics_port`` is set.

Hook methods must be fast, thread-safe and must not raise (a failing hook
would fail an acquire or a heartbeat: the engine calls it unguarded).

A deferred task (``on_busy="defer"``, docs/defer.md) is one acquire told in
parts: its first try finding the resources busy is a park (``parked``), not
a timeout; the grant its run adopts later is ``acquired(wait, "granted")``,
the wait measured from the park; a park that runs out of time (its
``timeout=``) is ``acquired(wait, "timeout")``, told by the worker's main
process.
"""

from __future__ import annotations

from typing import Protocol

from ..protocol import causes

#: ``acquired(outcome=...)`` values.
OUTCOMES = ("granted", "timeout", "error")
#: ``cleaned(path=...)`` values: a dead pool child's owner freed by its worker
#: (``child``), a same-name predecessor's owners freed at worker start-up
#: (``startup``), a dead owner freed by reconcile (``reconcile``), and a dead
#: holder's grant taken back by an acquire that met it (``reclaim``).
CLEANUP_PATHS = ("child", "startup", "reconcile", "reclaim")
#: ``lease_lost(cause=...)`` values: a lost lease's cause
#: (:attr:`Lease.lost_cause <celery_redislock.Lease>`, one of
#: ``exceptions.LOST_CAUSES``) as a label; ``unknown`` when none is known.
LOST_CAUSE_LABELS = causes.LOST_CAUSE_LABELS


class MetricsHook(Protocol):
    """What the engine reports (see the module docstring)."""

    def acquired(self, wait_seconds: float, outcome: str) -> None:
        """An acquire ended: granted, timed out (LockTimeout) or failed (any other error)."""

    def held(self, seconds: float) -> None:
        """A lease was released after being held ``seconds``."""

    def lease_lost(self, cause: str, count: int = 1) -> None:
        """``count`` leases were marked lost (``cause``: a ``LOST_CAUSE_LABELS`` value)."""

    def cleaned(self, path: str, count: int = 1) -> None:
        """``count`` owners (``reclaim``: dead holders' grants) were freed by ``path``."""

    def heartbeat_failed(self) -> None:
        """A heartbeat (the manager's, a pool child's watcher, or the node's) failed."""

    def parked(self, count: int = 1) -> None:
        """``count`` deferred tasks were parked (their resources were busy).

        Optional: the engine skips a hook that has no ``parked`` method (a
        hook written for a release before deferred tasks were counted).
        """


class Telemetry:
    """A manager's metrics hook, shared by its parts and replaceable.

    The worker integration sets :attr:`hook` once its hook exists; every
    part reads it at the event (``None``: nothing is reported).
    """

    __slots__ = ("hook",)

    def __init__(self, hook: MetricsHook | None) -> None:
        self.hook = hook

    def acquired(self, seconds: float, outcome: str) -> None:
        """An acquire made outside ``LockManager.acquire`` ended (a deferred
        task's adopted grant, or its park running out of time)."""
        if self.hook is not None:
            self.hook.acquired(max(0.0, seconds), outcome)

    def parked(self) -> None:
        """A deferred task was parked (a hook without ``parked``, written
        for an earlier release, is skipped)."""
        parked = getattr(self.hook, "parked", None)
        if parked is not None:
            parked()
