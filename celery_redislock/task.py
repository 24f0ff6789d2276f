"""Moved to :mod:`celery_redislock.integration.locked`; this path stays importable for one release."""

from .integration.locked import *  # noqa: F403
