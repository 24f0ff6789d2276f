"""Moved to :mod:`celery_redislock.integration.unique`; this path stays importable for one release."""

from .integration.unique import *  # noqa: F403
