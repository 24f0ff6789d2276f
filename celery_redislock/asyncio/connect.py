"""The ``redis.asyncio`` client of an :class:`~celery_redislock.asyncio.AsyncLockManager`.

URLs are validated and parsed by :mod:`celery_redislock.store.connect`, the
threaded manager's rules (the same forms, options and errors); this module
builds the asyncio client of each: standalone and TLS, Sentinel (the master
a Sentinel names, asked again after a failover), Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import redis
import redis.asyncio
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.cluster import RedisCluster

from ..exceptions import ConfigurationError
from ..redact import redact_url
from ..store.connect import (
    demoted_master,
    is_cluster_url,
    is_sentinel_url,
    parse_cluster_url,
    parse_sentinel_url,
    validate_url,
)
from ..store.valkey_client import as_redis_url

__all__ = ["Made", "client_of", "describe"]

#: A client an asyncio manager talks to.
AsyncRedis = redis.asyncio.Redis | redis.asyncio.RedisCluster


class Made(NamedTuple):
    """The client of a manager and what it was made from."""

    client: AsyncRedis
    #: Where it connects, for display (no password).
    url: str
    #: Made here from a URL (closed by the manager's close).
    own: bool
    #: The client's socket timeout (seconds), None for none.
    socket_timeout: float | None
    #: Makes a new client with the same settings (a forked child).
    remake: Callable[[], AsyncRedis]


def client_of(redis_url: Any) -> Made:
    """The client of ``redis_url`` (a URL or a ready ``redis.asyncio.Redis``)."""
    if isinstance(redis_url, str):
        validate_url(redis_url, setting="redis_url")
        shown = redact_url(redis_url)
        if is_cluster_url(redis_url):
            spec = parse_cluster_url(redis_url)
            kwargs = spec.client_kwargs()

            def cluster() -> AsyncRedis:
                return redis.asyncio.RedisCluster(
                    startup_nodes=[ClusterNode(host, port) for host, port in spec.nodes],
                    decode_responses=True,
                    **kwargs,
                )

            return Made(cluster(), shown, True, kwargs.get("socket_timeout"), cluster)
        if is_sentinel_url(redis_url):
            sentinel_spec = parse_sentinel_url(redis_url)
            master_kwargs, sentinel_kwargs = sentinel_spec.connection_kwargs()
            ssl = master_kwargs.pop("ssl", False)

            def master() -> AsyncRedis:
                manager = Sentinel(list(sentinel_spec.sentinels), sentinel_kwargs=sentinel_kwargs)
                client: redis.asyncio.Redis = manager.master_for(
                    sentinel_spec.service_name,
                    decode_responses=True,
                    connection_class=_MasterSSLConnection if ssl else _MasterConnection,
                    **master_kwargs,
                )
                return client

            # displayed in canonical form, as LockManager shows it
            shown = sentinel_spec.to_url(redacted=True)
            return Made(master(), shown, True, master_kwargs.get("socket_timeout"), master)
        url = as_redis_url(redis_url)
        try:
            client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        except ValueError as exc:
            raise ConfigurationError("redis_url", f"{exc} ({shown})") from exc
        return Made(
            client,
            shown,
            True,
            _timeout(client),
            lambda: redis.asyncio.Redis.from_url(url, decode_responses=True),
        )
    if isinstance(redis_url, redis.asyncio.Redis):
        return Made(redis_url, describe(redis_url), False, _timeout(redis_url), _copier(redis_url))
    if isinstance(redis_url, redis.asyncio.RedisCluster):
        raise ConfigurationError(
            "redis_url",
            "a ready redis.asyncio.RedisCluster is not supported by AsyncLockManager: "
            "pass its redis+cluster:// URL",
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


def _timeout(client: redis.asyncio.Redis) -> float | None:
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    return float(timeout) if timeout else None


def _copier(client: redis.asyncio.Redis) -> Callable[[], AsyncRedis]:
    """A maker of clients on a new pool with ``client``'s settings."""
    pool = client.connection_pool

    def copy() -> AsyncRedis:
        new: Any
        if isinstance(pool, SentinelConnectionPool):
            new = SentinelConnectionPool(
                pool.service_name,
                pool.sentinel_manager,
                connection_class=pool.connection_class,
                **pool.connection_kwargs,
            )
        else:
            new = type(pool)(connection_class=pool.connection_class, **pool.connection_kwargs)
        return redis.asyncio.Redis(connection_pool=new)

    return copy


def describe(client: redis.asyncio.Redis) -> str:
    """A URL-like description of where ``client`` connects (no password)."""
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        return f"sentinel://?/{pool.service_name}/{kw.get('db', 0)}"
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    ssl = issubclass(pool.connection_class, redis.asyncio.SSLConnection)
    return f"{'rediss' if ssl else 'redis'}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


class _DemotedMasterAware:
    """Redis 6.2's script-wrapped READONLY read as the failover it is (see
    :func:`celery_redislock.store.connect.demoted_master`): the connection is
    dropped, the Sentinels asked again, and the caller rides it out."""

    connection_pool: Any

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if demoted_master(self.connection_pool, exc):
                await self.disconnect()  # type: ignore[attr-defined]
                raise redis.ConnectionError("The previous master is now a replica") from exc
            raise


class _MasterConnection(_DemotedMasterAware, SentinelManagedConnection):
    pass


class _MasterSSLConnection(_DemotedMasterAware, SentinelManagedSSLConnection):
    pass
