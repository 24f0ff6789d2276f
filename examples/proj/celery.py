"""The example's Celery app: ``celery -A proj worker`` / ``celery -A proj beat``."""

from __future__ import annotations

from celery import Celery

from celery_redislock import RedisLock

app = Celery("proj", include=["proj.tasks"])
app.config_from_object("proj.celeryconfig")

#: Adds the worker bootsteps, the fork hooks, the reconcile task and its beat entry.
locks = RedisLock(app)
