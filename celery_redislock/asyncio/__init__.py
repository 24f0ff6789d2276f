"""The asyncio front-end: ``from celery_redislock.asyncio import AsyncLockManager``.

:class:`AsyncLockManager` acquires the same locks as
:class:`~celery_redislock.LockManager` from asyncio code, on
``redis.asyncio``: the same scripts, keys and arguments
(:mod:`celery_redislock.protocol`), so coroutines, threads and Celery tasks
wait in one queue and share one fencing counter.
:func:`cancel_on_disconnect` ends a web request's wait when its client
goes away. Importing it does not import Celery.
"""

from .asgi import cancel_on_disconnect
from .lease import AsyncLease
from .manager import AsyncLockManager

__all__ = ["AsyncLease", "AsyncLockManager", "cancel_on_disconnect"]
