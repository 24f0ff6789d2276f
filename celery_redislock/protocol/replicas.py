"""``wait_replicas``: what a grant too few replicas acknowledged turns into.

No I/O. Both front-ends run ``WAIT`` after a grant (in the script's
pipeline, or alone after a hand-off) and ask :func:`replication_short`
what to do when fewer replicas than ``wait_replicas`` acknowledged it.
"""

from __future__ import annotations

import logging
import time

from ..exceptions import ReplicationTimeout
from .options import EngineOptions
from .request import Request

__all__ = ["replication_short"]

log = logging.getLogger("celery_redislock.acquire")


def replication_short(
    options: EngineOptions,
    token: str,
    req: Request,
    timeout: float | None,
    deadline: float | None,
    acked: int,
) -> None:
    """Too few replicas acknowledged the grant of ``token``: it is released.

    Returns when the request asks again (``wait_policy="retry"`` with time
    left before ``deadline``); the caller releases the grant and asks under
    a new request id. Raises :class:`~celery_redislock.ReplicationTimeout`
    otherwise (``"fail"``, or no time left); the acquire's exit path
    releases the grant.
    """
    retry = options.wait_policy == "retry" and (deadline is None or deadline - time.monotonic() > 0)
    log.warning(
        "acquire.replication-short token=%s resources=%s wanted=%d acknowledged=%d "
        "wait_timeout=%.3gs policy=%s: grant released%s",
        token,
        ",".join(req.resources),
        options.wait_replicas,
        acked,
        options.wait_timeout,
        options.wait_policy,
        "; asking again" if retry else "",
    )
    if not retry:
        raise ReplicationTimeout(
            req.resources, timeout, options.wait_replicas, acked, options.wait_timeout
        )
