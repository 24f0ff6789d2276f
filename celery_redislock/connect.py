"""Moved to :mod:`celery_redislock.store.connect`; this path stays importable for one release."""

from .store.connect import *  # noqa: F403
