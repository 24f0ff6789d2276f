"""The ``redis.asyncio`` client of an :class:`~celery_redislock.asyncio.AsyncLockManager`.

URLs are validated by :mod:`celery_redislock.store.connect`, the threaded
manager's rules; this module builds the asyncio client of one.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from redis.cluster import RedisCluster

from ..exceptions import ConfigurationError
from ..redact import redact_url
from ..store.connect import is_cluster_url, is_sentinel_url, validate_url
from ..store.valkey_client import as_redis_url

__all__ = ["client_of", "describe"]


def client_of(redis_url: Any) -> tuple[redis.asyncio.Redis, str, bool]:
    """The client of ``redis_url``, its URL for display, and whether it was made here."""
    if isinstance(redis_url, str):
        validate_url(redis_url, setting="redis_url")
        if is_cluster_url(redis_url) or is_sentinel_url(redis_url):
            kind = "Redis Cluster" if is_cluster_url(redis_url) else "Sentinel"
            raise ConfigurationError(
                "redis_url",
                f"{kind} URLs are not supported by AsyncLockManager yet "
                f"({redact_url(redis_url)}): use a redis://, rediss:// or unix:// URL, "
                "pass a ready redis.asyncio.Redis client, or use LockManager",
            )
        try:
            client = redis.asyncio.Redis.from_url(as_redis_url(redis_url), decode_responses=True)
        except ValueError as exc:
            raise ConfigurationError("redis_url", f"{exc} ({redact_url(redis_url)})") from exc
        return client, redact_url(redis_url), True
    if isinstance(redis_url, redis.asyncio.Redis):
        return redis_url, describe(redis_url), False
    if isinstance(redis_url, redis.asyncio.RedisCluster):
        raise ConfigurationError(
            "redis_url", "redis.asyncio.RedisCluster is not supported by AsyncLockManager yet"
        )
    if isinstance(redis_url, (redis.Redis, RedisCluster)):
        raise ConfigurationError(
            "redis_url",
            "is a synchronous redis-py client: AsyncLockManager needs a URL or a "
            "redis.asyncio.Redis (LockManager takes this one)",
        )
    raise ConfigurationError(
        "redis_url",
        f"must be a URL or a redis.asyncio.Redis client, not {type(redis_url).__name__}",
    )


def describe(client: redis.asyncio.Redis) -> str:
    """A URL-like description of where ``client`` connects (no password)."""
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    ssl = issubclass(pool.connection_class, redis.asyncio.SSLConnection)
    return f"{'rediss' if ssl else 'redis'}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
