"""Moved to :mod:`celery_redislock.ops.inspector`; this path stays importable for one release."""

from .ops.inspector import *  # noqa: F403
