"""Moved to :mod:`celery_redislock.engine.metrics`; this path stays importable for one release."""

from .engine.metrics import *  # noqa: F403
