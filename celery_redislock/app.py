"""Moved to :mod:`celery_redislock.integration.app`; this path stays importable for one release."""

from .integration.app import *  # noqa: F403
