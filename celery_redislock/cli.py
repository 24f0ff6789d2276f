"""Moved to :mod:`celery_redislock.integration.cli`; this path stays importable for one release."""

from .integration.cli import *  # noqa: F403
