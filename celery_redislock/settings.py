"""Moved to :mod:`celery_redislock.integration.settings`; this path stays importable for one release."""

from .integration.settings import *  # noqa: F403
