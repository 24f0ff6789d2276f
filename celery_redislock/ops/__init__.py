"""Operator tools: read-only views of a namespace and its metrics export.

Holds: :mod:`.inspector` (:class:`~celery_redislock.Inspector`: status,
locks, owners, waiters, release plans; what the CLI shows), the views it
hands its reads to (``owners``, ``locks``, ``waiters``, ``summary``) over
one ``reader`` (batched round trips, the error rule, the format check),
:mod:`.records` (what they return) and :mod:`.prometheus` (the Prometheus
hook and the namespace collector).

May import: :mod:`celery_redislock.worker`, :mod:`celery_redislock.engine`
and the layers below. No Celery.
"""
