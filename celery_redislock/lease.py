"""Moved to :mod:`celery_redislock.engine.lease`; this path stays importable for one release."""

from .engine.lease import *  # noqa: F403
