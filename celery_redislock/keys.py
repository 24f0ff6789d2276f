"""Moved to :mod:`celery_redislock.protocol.keys`; this path stays importable for one release."""

from .protocol.keys import *  # noqa: F403
