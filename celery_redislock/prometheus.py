"""Moved to :mod:`celery_redislock.ops.prometheus`; this path stays importable for one release."""

from .ops.prometheus import *  # noqa: F403
