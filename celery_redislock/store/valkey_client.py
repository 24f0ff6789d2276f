"""valkey-py clients and ``valkey://`` URLs: connected to with redis-py.

valkey-py (``valkey.Valkey``, ``valkey.cluster.ValkeyCluster``) is a fork
of redis-py with the same API but classes of its own: its connections,
pools and exceptions are not redis-py's, and the engine relies on
redis-py's (its error mapping, the held connection of each thread, the
wire fast path of :mod:`.wire`, the cluster pipeline). So a valkey-py
client is not used as it is: :func:`from_valkey` makes a redis-py client
with the same connection settings (address, database, credentials, TLS,
timeouts, client name, RESP version, pool size), which the engine then
owns. The valkey-py client itself sends no command and stays the caller's.

Not carried over (redis-py's own defaults apply): the client's ``Retry``
policy and ``retry_on_error`` list (valkey-py's exception classes), a custom
parser class, the on-connect hook, and the client-side cache. A connection
class other than valkey-py's own (plain, TLS, Unix socket), a Sentinel
client (use a ``sentinel://`` URL) and the asyncio clients are refused.

``valkey://`` and ``valkeys://`` URLs are valkey-py's names of
``redis://`` and ``rediss://``: :func:`as_redis_url` renames the scheme and
the URL is read as redis-py reads it (valkey-py need not be installed).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from ..exceptions import ConfigurationError

__all__ = ["VALKEY_SCHEMES", "as_redis_url", "from_valkey", "is_valkey_client"]

#: valkey-py's URL schemes -> the redis-py scheme they name.
VALKEY_SCHEMES = {"valkey://": "redis://", "valkeys://": "rediss://"}

#: Connection settings never carried over to the redis-py client (valkey-py's
#: own objects or features; see the module doc).
_DROPPED = (
    "retry",
    "retry_on_error",
    "parser_class",
    "valkey_connect_func",
    "lib_name",
    "lib_version",
    "command_packer",
    "connection_pool",
    "cache_enabled",
    "client_cache",
    "cache_max_size",
    "cache_ttl",
    "cache_policy",
    "cache_deny_list",
    "cache_allow_list",
)


def as_redis_url(url: str) -> str:
    """``url`` with a ``valkey://``/``valkeys://`` scheme renamed to
    ``redis://``/``rediss://`` (any other URL unchanged)."""
    low = url.lower()
    for scheme, same in VALKEY_SCHEMES.items():
        if low.startswith(scheme):
            return same + url[len(scheme) :]
    return url


def is_valkey_client(client: Any) -> bool:
    """Whether ``client`` is an object of valkey-py (without importing it)."""
    return type(client).__module__.split(".", 1)[0] == "valkey"


def from_valkey(client: Any, setting: str = "redis_url") -> redis.Redis | RedisCluster:
    """A redis-py client with the connection settings of valkey-py client ``client``.

    Raises:
        ConfigurationError: naming ``setting``, for a valkey-py object that
            is not a ``Valkey`` or ``ValkeyCluster`` client, a Sentinel
            client, or one on a connection class of its own.
    """
    import valkey
    from valkey.cluster import ValkeyCluster

    if isinstance(client, ValkeyCluster):
        return _cluster(client, setting)
    if not isinstance(client, valkey.Valkey):
        raise ConfigurationError(
            setting,
            "a valkey-py client must be a valkey.Valkey or valkey.cluster.ValkeyCluster, "
            f"not {type(client).__module__}.{type(client).__qualname__}",
        )
    from valkey.sentinel import SentinelConnectionPool

    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        raise ConfigurationError(
            setting,
            "a valkey-py Sentinel client is not supported: give a sentinel:// URL instead",
        )
    kwargs = _kwargs(pool.connection_kwargs)
    kwargs["connection_class"] = _connection_class(pool.connection_class, setting)
    if isinstance(pool, valkey.BlockingConnectionPool):
        new: redis.ConnectionPool = redis.BlockingConnectionPool(
            max_connections=pool.max_connections, timeout=pool.timeout, **kwargs
        )
    else:
        new = redis.ConnectionPool(max_connections=pool.max_connections, **kwargs)
    # from_pool: the new client owns its pool (closed with the manager).
    return redis.Redis.from_pool(new)


def _kwargs(source: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in source.items() if k not in _DROPPED}


def _connection_class(cls: type, setting: str) -> type:
    import valkey

    # Most derived first: SSLConnection is a Connection.
    known = (
        (valkey.SSLConnection, redis.SSLConnection),
        (valkey.UnixDomainSocketConnection, redis.UnixDomainSocketConnection),
        (valkey.Connection, redis.Connection),
    )
    for theirs, ours in known:
        if cls is theirs:
            return ours
    raise ConfigurationError(
        setting,
        f"a valkey-py client on connection class {cls.__module__}.{cls.__qualname__} is not "
        "supported (only valkey-py's Connection, SSLConnection, UnixDomainSocketConnection)",
    )


def _cluster(client: Any, setting: str) -> RedisCluster:
    manager = client.nodes_manager
    kwargs = _kwargs(dict(manager.connection_kwargs))
    for name in ("host", "port", "db"):  # the nodes say where; a cluster has db 0
        kwargs.pop(name, None)
    cls = kwargs.pop("connection_class", None)
    if cls is not None and _connection_class(cls, setting) is redis.SSLConnection:
        kwargs["ssl"] = True
    return RedisCluster(
        startup_nodes=[ClusterNode(n.host, n.port) for n in client.get_nodes()],
        require_full_coverage=getattr(manager, "_require_full_coverage", True),
        **kwargs,
    )
