"""Turn a Redis URL into a :class:`redis.Redis` client (standalone, TLS, Sentinel).

Accepted URLs:

- ``redis://``, ``rediss://`` (TLS) and ``unix://``: passed to
  :meth:`redis.Redis.from_url` unchanged (its query options apply).
- ``sentinel://`` (this module's form)::

      sentinel://[[username]:password@]host[:port][,host[:port]...]/service_name[/db][?options]

  Every ``host:port`` is a Sentinel (port 26379 by default); ``service_name``
  is the monitored master's name (``sentinel monitor <service_name> ...``);
  ``db`` defaults to 0. ``username``/``password`` authenticate to the
  master. Options: ``sentinel_username``, ``sentinel_password`` (auth to
  the Sentinels themselves), ``socket_timeout``, ``socket_connect_timeout``
  (seconds; both also used towards the Sentinels), ``ssl=true`` (TLS to the
  master and the Sentinels), ``ssl_cert_reqs`` (none|optional|required),
  ``ssl_ca_certs`` (a path).
- kombu's Sentinel broker form, ``;``-separated::

      sentinel://[[username]:password@]host[:port][/db];sentinel://host2[:port2];...

  It names no service: give it as ``?master_name=...`` or as the
  ``master_name`` argument (the Celery settings take it from
  ``broker_transport_options['master_name']``). A single URL whose only
  path segment is a number (``sentinel://h:26379/0``) is read in this form.

A malformed URL raises :class:`ConfigurationError` naming the setting; no
message ever carries a password.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlencode, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from .exceptions import ConfigurationError
from .redact import redact_url

#: A client the engine accepts: standalone / Sentinel, or Redis Cluster (every
#: key of a namespace shares one hash tag, so every script is single-slot).
AnyRedis = redis.Redis | RedisCluster

#: Schemes :meth:`redis.Redis.from_url` understands.
DIRECT_SCHEMES = ("redis://", "rediss://", "unix://")
#: Every scheme :func:`client_from_url` accepts.
URL_SCHEMES = (*DIRECT_SCHEMES, "sentinel://")
#: Default TCP port of a Sentinel.
SENTINEL_PORT = 26379
#: Query options of a ``sentinel://`` URL.
SENTINEL_OPTIONS = (
    "sentinel_username",
    "sentinel_password",
    "socket_timeout",
    "socket_connect_timeout",
    "ssl",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "master_name",
)
_SECRET_OPTIONS = ("sentinel_password",)
_CERT_REQS = ("none", "optional", "required")
#: A Sentinel service name, matched with ``fullmatch`` (``$`` would also
#: accept a trailing newline).
_NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
#: Highest database number accepted in a URL (Redis's own limit is INT_MAX).
MAX_DB = 2**31 - 1


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` is a ``sentinel://`` URL (either form)."""
    return url.strip().lower().startswith("sentinel://")


#: Old name of :func:`celery_redislock.redact.redact_url` (every password as ``***``).
redact = redact_url


@dataclass(frozen=True)
class SentinelSpec:
    """A parsed ``sentinel://`` URL: where the Sentinels are and what to ask them."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)

    def to_url(self, *, redacted: bool = False) -> str:
        """This spec in the canonical form (see the module doc)."""
        auth = ""
        if self.password is not None:
            pw = "***" if redacted else quote(self.password, safe="")
            auth = f"{quote(self.username or '', safe='')}:{pw}@"
        elif self.username:
            auth = f"{quote(self.username, safe='')}@"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.sentinels)
        opts = {
            k: ("***" if redacted and k in _SECRET_OPTIONS else v)
            for k, v in sorted(self.options.items())
            if k != "master_name"
        }
        query = f"?{urlencode(opts)}" if opts else ""
        return f"sentinel://{auth}{hosts}/{quote(self.service_name, safe='')}/{self.db}{query}"

    def connection_kwargs(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(kwargs for the master's connections, kwargs for the Sentinels' connections)."""
        master: dict[str, Any] = {"db": self.db}
        if self.username:
            master["username"] = self.username
        if self.password is not None:
            master["password"] = self.password
        common: dict[str, Any] = {}
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name in self.options:
                common[name] = float(self.options[name])
        if _truthy(self.options.get("ssl", "false")):
            common["ssl"] = True
            if "ssl_cert_reqs" in self.options:
                common["ssl_cert_reqs"] = self.options["ssl_cert_reqs"]
            if "ssl_ca_certs" in self.options:
                common["ssl_ca_certs"] = self.options["ssl_ca_certs"]
        sentinel = dict(common)
        if "sentinel_username" in self.options:
            sentinel["username"] = self.options["sentinel_username"]
        if "sentinel_password" in self.options:
            sentinel["password"] = self.options["sentinel_password"]
        master.update(common)
        return master, sentinel


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _host_port(part: str, setting: str, shown: str) -> tuple[str, int]:
    part = part.strip()
    if not part:
        raise ConfigurationError(setting, f"a Sentinel address is empty in {shown}")
    if part.startswith("["):  # [ipv6]:port
        host, sep, rest = part[1:].partition("]")
        if not sep:
            raise ConfigurationError(setting, f"unclosed '[' in a Sentinel address of {shown}")
        port_s = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port_s = part.partition(":")
    if not host:
        raise ConfigurationError(setting, f"a Sentinel address has no host in {shown}")
    if not port_s:
        return host, SENTINEL_PORT
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigurationError(
            setting, f"Sentinel port {port_s!r} is not a port number (1-65535) in {shown}"
        )
    return host, int(port_s)


def _db(text: str, setting: str, shown: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_DB:
        raise ConfigurationError(
            setting,
            f"database {text!r} must be a non-negative integer (at most {MAX_DB}) in {shown}",
        )
    return int(text)


def parse_sentinel_url(
    url: str, *, setting: str = "redis_url", master_name: str | None = None
) -> SentinelSpec:
    """Parse a ``sentinel://`` URL (either form of the module doc).

    Args:
        url: the URL.
        setting: named in errors (e.g. ``redislock_url``).
        master_name: the service name when the URL does not carry one (kombu's form).

    Raises:
        ConfigurationError: naming ``setting`` and the problem (no password shown).
    """
    shown = redact_url(url)
    parts = [p.strip() for p in url.strip().split(";") if p.strip()]
    if not parts:
        raise ConfigurationError(setting, "is empty")
    sentinels: list[tuple[str, int]] = []
    username: str | None = None
    password: str | None = None
    options: dict[str, str] = {}
    service: str | None = None
    db = 0
    kombu_form = len(parts) > 1
    for index, part in enumerate(parts):
        if not part.lower().startswith("sentinel://"):
            raise ConfigurationError(
                setting, f"every ';'-separated part must be a sentinel:// URL in {shown}"
            )
        rest = part[len("sentinel://") :]
        rest, _, query = rest.partition("?")
        if "#" in query:
            query = query.split("#", 1)[0]
        netloc, _, path = rest.partition("/")
        if "@" in netloc:
            userinfo, _, netloc = netloc.rpartition("@")
            user, has_pw, pw = userinfo.partition(":")
            if index == 0:
                username = unquote(user) or None
                password = unquote(pw) if has_pw else None
        if not netloc:
            raise ConfigurationError(setting, f"names no Sentinel host in {shown}")
        sentinels.extend(_host_port(hp, setting, shown) for hp in netloc.split(","))
        if query:
            for item in query.split("&"):
                if not item:
                    continue
                key, eq, value = item.partition("=")
                key = unquote(key)
                if key not in SENTINEL_OPTIONS:
                    raise ConfigurationError(
                        setting,
                        f"unknown option {key!r} in {shown}; "
                        f"accepted: {', '.join(SENTINEL_OPTIONS)}",
                    )
                if not eq:
                    raise ConfigurationError(setting, f"option {key!r} has no value in {shown}")
                if options.get(key, unquote(value)) != unquote(value):
                    raise ConfigurationError(setting, f"option {key!r} given twice in {shown}")
                options[key] = unquote(value)
        if index == 0:
            segments = [s for s in path.split("/") if s]
            if kombu_form or (len(segments) == 1 and segments[0].isdigit()):
                # kombu's form: the path is the database only.
                if len(segments) > 1:
                    raise ConfigurationError(
                        setting, f"kombu's sentinel form takes only /db as path in {shown}"
                    )
                db = _db(segments[0], setting, shown) if segments else 0
            elif segments:
                if len(segments) > 2:
                    raise ConfigurationError(setting, f"path must be /service_name[/db] in {shown}")
                service = unquote(segments[0])
                db = _db(segments[1], setting, shown) if len(segments) == 2 else 0
    from_query = options.get("master_name")
    for candidate in (from_query, master_name):
        if candidate is None:
            continue
        if service is not None and candidate != service:
            raise ConfigurationError(
                setting, f"names two services ({service!r} and {candidate!r}) in {shown}"
            )
        service = candidate
    if not service:
        raise ConfigurationError(
            setting,
            f"names no Sentinel service in {shown}; use "
            "sentinel://host:26379[,host2:26379]/service_name[/db] "
            "(or kombu's form with broker_transport_options={'master_name': ...})",
        )
    if not _NAME_RE.fullmatch(service):
        raise ConfigurationError(setting, f"service name {service!r} is not valid in {shown}")
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in options:
            try:
                ok = float(options[name]) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ConfigurationError(
                    setting, f"{name} must be a positive number of seconds in {shown}"
                )
    if "ssl_cert_reqs" in options and options["ssl_cert_reqs"] not in _CERT_REQS:
        raise ConfigurationError(
            setting, f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)} in {shown}"
        )
    return SentinelSpec(
        sentinels=tuple(sentinels),
        service_name=service,
        db=db,
        username=username,
        password=password,
        options=options,
    )


def validate_url(url: Any, *, setting: str = "redis_url", master_name: str | None = None) -> str:
    """Check ``url`` without connecting; return it (a Sentinel URL in canonical form).

    Raises:
        ConfigurationError: not a string, an unknown scheme or a malformed URL.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(
            setting,
            f"must be a {', '.join(URL_SCHEMES)} URL, not "
            f"{type(url).__name__ if not isinstance(url, str) else 'an empty string'}",
        )
    if _CONTROL_RE.search(url) or url != url.strip():
        raise ConfigurationError(
            setting,
            f"has control characters or surrounding whitespace: {redact_url(url.strip())!r}",
        )
    if is_sentinel_url(url):
        return parse_sentinel_url(url, setting=setting, master_name=master_name).to_url()
    if not url.lower().startswith(DIRECT_SCHEMES):
        raise ConfigurationError(
            setting, f"must be a {', '.join(URL_SCHEMES)} URL, not {redact_url(url)!r}"
        )
    try:
        kwargs = parse_url(url)
    except ValueError as exc:
        raise _url_error(setting, url, exc) from exc
    shown = redact_url(url)
    if not url.lower().startswith("unix://"):
        # redis-py reads a path that is not a number as database 0: refuse it.
        segment = urlsplit(url).path.strip("/")
        if segment:
            _db(segment, setting, shown)
    db = kwargs.get("db", 0)
    if not isinstance(db, int) or not 0 <= db <= MAX_DB:
        raise ConfigurationError(
            setting, f"database must be a non-negative integer (at most {MAX_DB}) in {shown}"
        )
    return url


class _DemotedMasterAware:
    """Treat Redis 6.2's script-wrapped READONLY like redis-py treats READONLY.

    redis-py's Sentinel connection turns a ``READONLY`` reply from the master
    (it was demoted to a replica) into a ConnectionError, drops the
    connection and asks the Sentinels again. Redis 6.2 answers a script that
    writes on a replica with ``ERR Error running script ... -READONLY ...``
    instead, which redis-py would raise as a plain ResponseError on every
    call: the engine would raise it instead of RedisUnavailable.
    """

    connection_pool: Any

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if self.connection_pool.is_master and "-READONLY " in str(exc):
                self.disconnect()  # type: ignore[attr-defined]
                raise redis.ConnectionError("The previous master is now a replica") from exc
            raise


class _MasterConnection(_DemotedMasterAware, SentinelManagedConnection):
    pass


class _MasterSSLConnection(_DemotedMasterAware, SentinelManagedSSLConnection):
    pass


def client_from_url(
    url: str,
    *,
    setting: str = "redis_url",
    master_name: str | None = None,
    decode_responses: bool = True,
) -> redis.Redis:
    """A :class:`redis.Redis` client for ``url`` (see the module doc for the forms).

    Connects lazily: a Sentinel is asked for the master's address when the
    first connection is made, and again after a connection error (failover).

    Raises:
        ConfigurationError: naming ``setting`` for a malformed URL (never the password).
    """
    validate_url(url, setting=setting, master_name=master_name)
    if is_sentinel_url(url):
        spec = parse_sentinel_url(url, setting=setting, master_name=master_name)
        master_kwargs, sentinel_kwargs = spec.connection_kwargs()
        manager = Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs)
        ssl = master_kwargs.pop("ssl", False)
        client: redis.Redis = manager.master_for(
            spec.service_name,
            decode_responses=decode_responses,
            connection_class=_MasterSSLConnection if ssl else _MasterConnection,
            **master_kwargs,
        )
        return client
    try:
        return redis.Redis.from_url(url, decode_responses=decode_responses)
    except ValueError as exc:
        raise _url_error(setting, url, exc) from exc


def _url_error(setting: str, url: str, exc: ValueError) -> ConfigurationError:
    shown = redact_url(url)
    # redis-py and urllib quote pieces of the URL ('...'): keep only those the
    # masked URL shows too (a password with a '/' is read as a port, "'pa'").
    message = re.sub(
        r"'([^']*)'", lambda m: m.group(0) if m.group(1) in shown else "'***'", str(exc)
    )
    return ConfigurationError(setting, f"{message} ({shown})")


def clone_client(client: AnyRedis) -> AnyRedis:
    """A client on a new, private pool with the same settings (Sentinel pools too).

    A :class:`~redis.cluster.RedisCluster` gets a new cluster client (its own
    per-node pools) seeded with the nodes the source knows.
    """
    if isinstance(client, RedisCluster):
        manager = client.nodes_manager
        ckwargs = dict(manager.connection_kwargs)
        # The source client's on-connect hook: the new client installs its own.
        ckwargs.pop("redis_connect_func", None)
        if client.read_from_replicas:  # deprecated in redis-py 5.3: passed only if set
            ckwargs["read_from_replicas"] = True
        return RedisCluster(
            startup_nodes=[ClusterNode(n.host, n.port) for n in client.get_nodes()],
            require_full_coverage=getattr(manager, "_require_full_coverage", True),
            load_balancing_strategy=client.load_balancing_strategy,
            address_remap=manager.address_remap,
            retry=client.retry,
            **ckwargs,
        )
    src = client.connection_pool
    kwargs = dict(src.connection_kwargs)
    if isinstance(src, SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the source pool's proxy
        pool: redis.ConnectionPool = SentinelConnectionPool(
            src.service_name,
            src.sentinel_manager,
            connection_class=src.connection_class,
            is_master=src.is_master,
            check_connection=src.check_connection,
            **kwargs,
        )
    else:
        pool = src.__class__(connection_class=src.connection_class, **kwargs)
    return redis.Redis(connection_pool=pool)


def describe_client(client: AnyRedis) -> str:
    """A URL-like description of where ``client`` connects (no password)."""
    if isinstance(client, RedisCluster):
        nodes = ",".join(f"{n.host}:{n.port}" for n in client.get_primaries())
        return f"cluster://{nodes}"
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        hosts = ",".join(
            "{}:{}".format(
                s.connection_pool.connection_kwargs.get("host", "?"),
                s.connection_pool.connection_kwargs.get("port", "?"),
            )
            for s in pool.sentinel_manager.sentinels
        )
        return f"sentinel://{hosts}/{pool.service_name}/{kw.get('db', 0)}"
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    return f"{scheme}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
