"""Who is acquiring on this thread: what an integration hands the engine.

``@locked`` and ``UniqueTask`` call :meth:`LockManager.acquire` on behalf
of a Celery task. The engine needs a few facts about that task that are no
part of the public ``acquire`` signature: the holder record to store beside
the grant, whether a worker shutdown may cut the wait short, the task's own
request id, and the hook that lets a task's wait become a park. They travel
in an :class:`AcquireContext`, set for a block of code with
:meth:`ContextStack.using` and read by the acquire loop of the same thread
(or greenlet: ``threading.local`` is per greenlet under gevent and eventlet
monkey-patching).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["AcquireContext", "ContextStack"]


@dataclass(frozen=True)
class AcquireContext:
    """What the current thread's acquires are made for.

    Attributes:
        holder: the holder record stored beside each grant (task name, task
            id and node, one per line), or None for a plain lock.
        haltable: the wait gives way to a worker's warm shutdown
            (:class:`~celery_redislock.exceptions.ShuttingDown`); only a
            task's own wait before its body sets it, never a nested acquire.
        request_id: the request id to use (``task:<id>`` for a task that
            must be recognised by its id), or None for a new one.
        take_over: called as ``take_over(token, request)`` when the wait is
            blocked behind a grant in transit to a parked task; True means
            it took the queued request over (the acquire then raises
            :class:`~celery_redislock.engine.manager.RequestMoved`).
        parking: the acquire is a deferred task's first try: busy is not a
            timeout for the metrics (the park that follows reports it).
    """

    holder: str | None = None
    haltable: bool = False
    request_id: str | None = None
    take_over: Callable[[str, Any], bool] | None = None
    parking: bool = False


_NONE = AcquireContext()


class ContextStack:
    """The :class:`AcquireContext` of each thread, for one manager."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> AcquireContext:
        """This thread's context (the empty one outside any :meth:`using`)."""
        ctx: AcquireContext = getattr(self._local, "ctx", _NONE)
        return ctx

    @contextmanager
    def using(self, **changes: Any) -> Iterator[AcquireContext]:
        """Change fields of this thread's context for the ``with`` block.

        Fields not named keep their value (an outer block's); the previous
        context comes back on exit, however the block ends.
        """
        before = self.current()
        ctx = self._local.ctx = replace(before, **changes)
        try:
            yield ctx
        finally:
            self._local.ctx = before

    def reset(self) -> None:
        """Forget every thread's context (a forked child starts empty)."""
        self._local = threading.local()
