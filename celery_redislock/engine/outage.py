"""Riding out a Redis outage while waiting: the bound and the backoff.

A waiter whose Redis call fails (a dropped or refused connection, a socket
timeout of a stalled server) re-runs its acquire, which is idempotent on
its token, until the bound of :class:`Outage`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..exceptions import RedisUnavailable
from ..protocol.outage import Outage

__all__ = ["Outage", "riding_out"]

log = logging.getLogger("celery_redislock.acquire")


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
