"""Riding out a Redis outage while waiting: the bound and the backoff.

A waiter whose Redis call fails (a dropped or refused connection, a socket
timeout of a stalled server) re-runs its acquire, which is idempotent on
its token, until the bound of :class:`Outage`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

from ..exceptions import RedisUnavailable

__all__ = ["Outage", "riding_out"]

log = logging.getLogger("celery_redislock.acquire")


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


def riding_out(outage: Outage, token: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None after a Redis failure the waiter rides out.

    Within the outage bound a failure is logged once, slept off with backoff
    and answered with None: the caller re-runs its acquire script, which is
    idempotent on the token (a grant handed over meanwhile is found in the
    lock hash, a queue entry is kept). Past the bound the RedisUnavailable
    propagates.
    """
    try:
        value = call(*args)
    except RedisUnavailable as exc:
        pause = outage.failed()
        if pause is None:
            raise
        if outage.failures == 1:
            log.warning(
                "acquire.redis-retry token=%s error=%s: re-running the acquire for up to %.3gs",
                token,
                exc,
                outage.left(),
            )
        time.sleep(pause)
        return None
    if outage.failures:
        log.info("acquire.redis-resumed token=%s failures=%d", token, outage.failures)
        outage.failures = 0
    return value
