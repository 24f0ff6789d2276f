"""Example project for celery-redislock: ``celery -A proj worker`` from ``examples/``."""

from .celery import app

__all__ = ["app"]
