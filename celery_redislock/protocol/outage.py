"""The outage bound of a waiter: how long it rides out Redis failures, and its backoff.

No I/O (the clock and a jitter only): every front-end's acquire loop (the
threaded engine's :mod:`celery_redislock.engine.outage`, the asyncio
front-end) keeps the same bound.
"""

from __future__ import annotations

import math
import random
import time

__all__ = ["Outage"]


class Outage:
    """How long one waiter rides out Redis failures, and its backoff.

    A waiter re-runs its acquire until the *bound*: its own deadline, and at
    most ``owner_ttl`` after the first failure of the current outage (by
    then the owner's liveness, so its place in the queue, is gone: the error
    is reported instead of queueing again at the back). ``timeout=0`` has a
    bound of now: no retry.
    """

    #: First pause after a failure, doubled per failure up to BACKOFF_MAX (s).
    BACKOFF_MIN = 0.05
    BACKOFF_MAX = 1.0

    __slots__ = ("deadline", "failures", "limit", "owner_ttl")

    def __init__(self, deadline: float | None, owner_ttl: float) -> None:
        self.deadline = deadline
        self.owner_ttl = owner_ttl
        self.failures = 0
        self.limit = math.inf

    def left(self) -> float:
        """Seconds until the bound of the current outage."""
        return max(0.0, self.limit - time.monotonic())

    def failed(self) -> float | None:
        """Count one failure: the pause before retrying, or None to give up."""
        now = time.monotonic()
        if self.failures == 0:
            self.limit = now + self.owner_ttl
            if self.deadline is not None:
                self.limit = min(self.limit, self.deadline)
        self.failures += 1
        left = self.limit - now
        if left <= 0:
            return None
        pause = min(self.BACKOFF_MAX, self.BACKOFF_MIN * 2.0 ** min(self.failures - 1, 16))
        return min(left, pause * random.uniform(0.5, 1.0))
