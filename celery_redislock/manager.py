"""Moved to :mod:`celery_redislock.engine.manager`; this path stays importable for one release."""

from .engine.manager import *  # noqa: F403
