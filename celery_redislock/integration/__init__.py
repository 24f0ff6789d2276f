"""The Celery integration: the app extension, the bootstep, ``@locked``, ``UniqueTask``, the CLI.

Holds: :mod:`.app` (:class:`~celery_redislock.RedisLock`, the app's
extension and its signals), :mod:`.settings` (every ``redislock_*``
setting), :mod:`.bootsteps` (the worker's node step), :mod:`.locked` (the
decorator) with :mod:`.templates`, :mod:`.body` and :mod:`.deferred`,
:mod:`.unique` (:class:`~celery_redislock.UniqueTask`), :mod:`.guard` (the
deferred tasks' guards) and :mod:`.cli` (the ``celery redislock``
sub-command).

The top layer: may import every layer below, and Celery.
"""
