"""Turn a Redis URL into a client (standalone, TLS, Sentinel, Redis Cluster).

Accepted URLs:

- ``redis://``, ``rediss://`` (TLS) and ``unix://``: passed to
  :meth:`redis.Redis.from_url` unchanged (its query options apply).
  ``valkey://`` and ``valkeys://`` (valkey-py's names) are the same as
  ``redis://`` and ``rediss://``.
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

- ``redis+cluster://`` and ``rediss+cluster://`` (TLS), this module's
  Redis Cluster form (a :class:`~redis.cluster.RedisCluster` client)::

      redis+cluster://[[username]:password@]host[:port][,host[:port]...][/0][?options]

  Every ``host:port`` is a seed node (port 6379 by default); the client
  learns the rest of the cluster from them (``CLUSTER SLOTS``) and follows
  it as it changes (MOVED replies, failovers). A cluster has only database
  0: a path other than ``/`` or ``/0`` is refused. Options (see
  :data:`CLUSTER_OPTIONS`): ``socket_timeout``, ``socket_connect_timeout``
  (seconds), ``max_connections`` (per node),
  ``client_name``, ``require_full_coverage`` (``true`` by default), and on
  ``rediss+cluster://`` only ``ssl_cert_reqs``, ``ssl_ca_certs``,
  ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``.

A malformed URL raises :class:`ConfigurationError` naming the setting; no
message ever carries a password.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlencode, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException
from redis.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from ..exceptions import ConfigurationError, RedisUnavailable
from ..redact import redact_url
from .valkey_client import VALKEY_SCHEMES, as_redis_url

#: A client the engine accepts: standalone / Sentinel, or Redis Cluster (every
#: key of a namespace shares one hash tag, so every script is single-slot).
AnyRedis = redis.Redis | RedisCluster

#: Schemes :meth:`redis.Redis.from_url` understands.
DIRECT_SCHEMES = ("redis://", "rediss://", "unix://")
#: Schemes of the Redis Cluster form (the second one is TLS).
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
#: Every scheme :func:`client_from_url` accepts (``valkey://`` and
#: ``valkeys://`` are ``redis://`` and ``rediss://``: :mod:`.valkey_client`).
URL_SCHEMES = (*DIRECT_SCHEMES, "sentinel://", *CLUSTER_SCHEMES, *VALKEY_SCHEMES)
#: Default TCP port of a cluster node.
CLUSTER_PORT = 6379
#: Query options of a ``redis+cluster://`` URL (the ``ssl_*`` ones only on
#: ``rediss+cluster://``). ``db`` is accepted only as 0.
CLUSTER_OPTIONS = (
    "socket_timeout",
    "socket_connect_timeout",
    "max_connections",
    "client_name",
    "require_full_coverage",
    "db",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)
_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")
#: A ``client_name`` (CLIENT SETNAME refuses spaces and control characters).
_CLIENT_NAME_RE = re.compile(r"[!-~]{1,128}")
#: Most connections per node a URL may ask for.
MAX_CONNECTIONS = 100_000
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


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` is a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    return url.strip().lower().startswith(CLUSTER_SCHEMES)


#: Old name of :func:`celery_redislock.redact.redact_url` (every password as ``***``).
redact = redact_url


def _authority(
    username: str | None,
    password: str | None,
    hosts: tuple[tuple[str, int], ...],
    redacted: bool,
) -> str:
    """``user:password@host:port,host2:port`` of a canonical URL (IPv6 hosts
    in brackets; the password ``***`` when ``redacted``)."""
    auth = ""
    if password is not None:
        pw = "***" if redacted else quote(password, safe="")
        auth = f"{quote(username or '', safe='')}:{pw}@"
    elif username:
        auth = f"{quote(username, safe='')}@"
    return auth + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in hosts)


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
        where = _authority(self.username, self.password, self.sentinels, redacted)
        opts = {
            k: ("***" if redacted and k in _SECRET_OPTIONS else v)
            for k, v in sorted(self.options.items())
            if k != "master_name"
        }
        query = f"?{urlencode(opts)}" if opts else ""
        return f"sentinel://{where}/{quote(self.service_name, safe='')}/{self.db}{query}"

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


def _host_port(
    part: str, setting: str, shown: str, *, what: str = "Sentinel", default: int = SENTINEL_PORT
) -> tuple[str, int]:
    part = part.strip()
    if not part:
        raise ConfigurationError(setting, f"a {what} address is empty in {shown}")
    if part.startswith("["):  # [ipv6]:port
        host, sep, rest = part[1:].partition("]")
        if not sep:
            raise ConfigurationError(setting, f"unclosed '[' in a {what} address of {shown}")
        port_s = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port_s = part.partition(":")
    if not host:
        raise ConfigurationError(setting, f"a {what} address has no host in {shown}")
    if not port_s:
        return host, default
    if not (port_s.isascii() and port_s.isdigit()) or not 0 < int(port_s) < 65536:
        raise ConfigurationError(
            setting, f"{what} port {port_s!r} is not a port number (1-65535) in {shown}"
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
        _sentinel_options(query, options, setting, shown)
        if index == 0:
            service, db = _sentinel_path(path, kombu_form, setting, shown)
    service = _sentinel_service(service, options.get("master_name"), master_name, setting, shown)
    _check_sentinel_options(options, setting, shown)
    return SentinelSpec(
        sentinels=tuple(sentinels),
        service_name=service,
        db=db,
        username=username,
        password=password,
        options=options,
    )


def _sentinel_options(query: str, options: dict[str, str], setting: str, shown: str) -> None:
    """Add the options of one part's query string to ``options``."""
    for item in query.split("&") if query else ():
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = unquote(key)
        if key not in SENTINEL_OPTIONS:
            raise ConfigurationError(
                setting,
                f"unknown option {key!r} in {shown}; accepted: {', '.join(SENTINEL_OPTIONS)}",
            )
        if not eq:
            raise ConfigurationError(setting, f"option {key!r} has no value in {shown}")
        if options.get(key, unquote(value)) != unquote(value):
            raise ConfigurationError(setting, f"option {key!r} given twice in {shown}")
        options[key] = unquote(value)


def _sentinel_path(path: str, kombu_form: bool, setting: str, shown: str) -> tuple[str | None, int]:
    """The service name (None: not in the path) and the database of the first part's path."""
    segments = [s for s in path.split("/") if s]
    if kombu_form or (len(segments) == 1 and segments[0].isdigit()):
        # kombu's form: the path is the database only.
        if len(segments) > 1:
            raise ConfigurationError(
                setting, f"kombu's sentinel form takes only /db as path in {shown}"
            )
        return None, _db(segments[0], setting, shown) if segments else 0
    if not segments:
        return None, 0
    if len(segments) > 2:
        raise ConfigurationError(setting, f"path must be /service_name[/db] in {shown}")
    return unquote(segments[0]), _db(segments[1], setting, shown) if len(segments) == 2 else 0


def _sentinel_service(
    service: str | None,
    from_query: str | None,
    master_name: str | None,
    setting: str,
    shown: str,
) -> str:
    """The one service name the path, the query and ``master_name`` agree on."""
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
    return service


def _check_sentinel_options(options: dict[str, str], setting: str, shown: str) -> None:
    """Refuse option values the client would refuse later, less clearly."""
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


@dataclass(frozen=True)
class ClusterSpec:
    """A parsed ``redis+cluster://`` URL: the seed nodes and the connection options."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    options: Mapping[str, str] = field(default_factory=dict)

    def to_url(self, *, redacted: bool = False) -> str:
        """This spec in the canonical form (see the module doc)."""
        where = _authority(self.username, self.password, self.nodes, redacted)
        opts = {k: v for k, v in sorted(self.options.items()) if k != "db"}
        query = f"?{urlencode(opts)}" if opts else ""
        return f"{CLUSTER_SCHEMES[1] if self.tls else CLUSTER_SCHEMES[0]}{where}/{query}"

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~redis.cluster.RedisCluster` (startup nodes aside)."""
        kwargs: dict[str, Any] = {}
        if self.username:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        opts = self.options
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name in opts:
                kwargs[name] = float(opts[name])
        if "max_connections" in opts:
            kwargs["max_connections"] = int(opts["max_connections"])
        if "client_name" in opts:
            kwargs["client_name"] = opts["client_name"]
        if "require_full_coverage" in opts:
            kwargs["require_full_coverage"] = _truthy(opts["require_full_coverage"])
        if self.tls:
            kwargs["ssl"] = True
            for name in ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if name in opts:
                    kwargs[name] = opts[name]
            if "ssl_check_hostname" in opts:
                kwargs["ssl_check_hostname"] = _truthy(opts["ssl_check_hostname"])
        return kwargs


def parse_cluster_url(url: str, *, setting: str = "redis_url") -> ClusterSpec:
    """Parse a ``redis+cluster://`` or ``rediss+cluster://`` URL (see the module doc).

    Raises:
        ConfigurationError: naming ``setting`` and the problem (no password shown).
    """
    shown = redact_url(url)
    text = url.strip()
    scheme = next((s for s in CLUSTER_SCHEMES if text.lower().startswith(s)), None)
    if scheme is None:
        raise ConfigurationError(
            setting, f"must start with {' or '.join(CLUSTER_SCHEMES)}, not {shown!r}"
        )
    tls = scheme == CLUSTER_SCHEMES[1]
    rest = text[len(scheme) :]
    if ";" in rest:
        raise ConfigurationError(
            setting, f"a cluster URL lists its nodes with ',' (one URL), not ';', in {shown}"
        )
    rest, _, query = rest.partition("?")
    rest = rest.split("#", 1)[0]
    query = query.split("#", 1)[0]
    # The userinfo runs to the last '@' before the path (a password may hold
    # '@' or ':' unencoded); the hosts follow it.
    slash = rest.find("/", rest.rfind("@") + 1)
    netloc, path = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
    username: str | None = None
    password: str | None = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, has_pw, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw else None
    if not netloc.strip():
        raise ConfigurationError(
            setting,
            f"names no cluster node in {shown}; use "
            "redis+cluster://host:6379[,host2:6379]/ (rediss+cluster:// for TLS)",
        )
    nodes = tuple(
        _host_port(hp, setting, shown, what="cluster node", default=CLUSTER_PORT)
        for hp in netloc.split(",")
    )
    segment = path.strip("/")
    if segment:
        if "/" in segment:
            raise ConfigurationError(setting, f"path must be empty or /0 in {shown}")
        if _db(segment, setting, shown) != 0:
            raise ConfigurationError(
                setting,
                f"a Redis Cluster has only database 0, not {segment!r}, in {shown}; "
                "use a separate namespace instead of a database",
            )
    options: dict[str, str] = {}
    for item in query.split("&") if query else ():
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = unquote(key), unquote(value)
        if key not in CLUSTER_OPTIONS:
            raise ConfigurationError(
                setting,
                f"unknown or unsupported cluster option {key!r} in {shown}; "
                f"accepted: {', '.join(CLUSTER_OPTIONS)}",
            )
        if not eq:
            raise ConfigurationError(setting, f"option {key!r} has no value in {shown}")
        if options.get(key, value) != value:
            raise ConfigurationError(setting, f"option {key!r} given twice in {shown}")
        options[key] = value
    _check_cluster_options(options, tls, setting, shown)
    return ClusterSpec(nodes=nodes, tls=tls, username=username, password=password, options=options)


def _check_cluster_options(options: Mapping[str, str], tls: bool, setting: str, shown: str) -> None:
    if "db" in options and (
        not (options["db"].isascii() and options["db"].isdigit()) or int(options["db"]) != 0
    ):
        raise ConfigurationError(
            setting, f"a Redis Cluster has only database 0, not db={options['db']!r}, in {shown}"
        )
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name not in options:
            continue
        try:
            value = float(options[name])
        except ValueError:
            value = float("nan")
        if not 0 < value < 86400:
            raise ConfigurationError(
                setting,
                f"{name} must be a positive number of seconds below 86400, "
                f"not {options[name]!r}, in {shown}",
            )
    if "max_connections" in options:
        raw = options["max_connections"]
        if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= MAX_CONNECTIONS:
            raise ConfigurationError(
                setting,
                f"max_connections must be an integer from 1 to {MAX_CONNECTIONS}, "
                f"not {raw!r}, in {shown}",
            )
    if "client_name" in options and not _CLIENT_NAME_RE.fullmatch(options["client_name"]):
        raise ConfigurationError(
            setting,
            "client_name must be 1-128 printable characters without spaces in " + shown,
        )
    for name in ("require_full_coverage", "ssl_check_hostname"):
        if name in options and options[name].strip().lower() not in _BOOL_WORDS:
            raise ConfigurationError(
                setting, f"{name} must be true or false, not {options[name]!r}, in {shown}"
            )
    ssl_given = [k for k in options if k.startswith("ssl_")]
    if ssl_given and not tls:
        raise ConfigurationError(
            setting,
            f"{', '.join(sorted(ssl_given))} need TLS: use rediss+cluster:// in {shown}",
        )
    if "ssl_cert_reqs" in options and options["ssl_cert_reqs"] not in _CERT_REQS:
        raise ConfigurationError(
            setting, f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)} in {shown}"
        )


def validate_url(url: Any, *, setting: str = "redis_url", master_name: str | None = None) -> str:
    """Check ``url`` without connecting; return it (Sentinel and cluster URLs in canonical form).

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
    if is_cluster_url(url):
        return parse_cluster_url(url, setting=setting).to_url()
    if url.lower().startswith(tuple(VALKEY_SCHEMES)):
        validate_url(as_redis_url(url), setting=setting)
        return url
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
            if demoted_master(self.connection_pool, exc):
                self.disconnect()  # type: ignore[attr-defined]
                raise redis.ConnectionError("The previous master is now a replica") from exc
            raise


def demoted_master(pool: Any, exc: redis.ResponseError) -> bool:
    """Whether ``exc``, read on a Sentinel-managed ``pool``'s connection, is
    Redis 6.2's script-wrapped READONLY from a master demoted to a replica
    (the sync and the asyncio Sentinel connections then reconnect)."""
    return bool(pool.is_master) and "-READONLY " in str(exc)


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
) -> AnyRedis:
    """A client for ``url`` (see the module doc for the forms).

    A :class:`redis.Redis` connects lazily: a Sentinel is asked for the
    master's address when the first connection is made, and again after a
    connection error (failover). A cluster URL gives a
    :class:`~redis.cluster.RedisCluster`, which reads the cluster's slot map
    from the first seed node that answers while it is made, and reads it
    again on a MOVED reply or a connection error (failover, resharding).

    Raises:
        ConfigurationError: naming ``setting`` for a malformed URL (never the password).
        RedisUnavailable: a cluster URL none of whose seed nodes answered
            (or whose nodes do not cover every slot).
    """
    validate_url(url, setting=setting, master_name=master_name)
    if is_cluster_url(url):
        return _cluster_client(parse_cluster_url(url, setting=setting), decode_responses)
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
        return redis.Redis.from_url(as_redis_url(url), decode_responses=decode_responses)
    except ValueError as exc:
        raise _url_error(setting, url, exc) from exc


def _cluster_client(spec: ClusterSpec, decode_responses: bool) -> RedisCluster:
    kwargs = spec.client_kwargs()
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in spec.nodes],
            decode_responses=decode_responses,
            **kwargs,
        )
    except (RedisClusterException, redis.ConnectionError, redis.TimeoutError) as exc:
        # The reason without the seed list redis-py may append (no secret in
        # it, but the URL says it already).
        raise RedisUnavailable(spec.to_url(redacted=True), exc) from exc


def _url_error(setting: str, url: str, exc: ValueError) -> ConfigurationError:
    shown = redact_url(url)
    # redis-py and urllib quote pieces of the URL ('...'): keep only those the
    # masked URL shows too (a password with a '/' is read as a port, "'pa'").
    message = re.sub(
        r"'([^']*)'", lambda m: m.group(0) if m.group(1) in shown else "'***'", str(exc)
    )
    return ConfigurationError(setting, f"{message} ({shown})")


def reset_locks_after_fork(client: AnyRedis) -> None:
    """In a forked child, give a :class:`~redis.cluster.RedisCluster` new locks.

    redis-py's cluster client guards its slot map with thread locks and does
    not renew them after :func:`os.fork`. A child forked while a parent
    thread held one (a topology refresh, or any command looking up a slot
    on the same client object) would block on its first command for ever,
    since the thread that would release it does not exist in the child. Right
    after a fork no other thread runs in the child, so new locks are safe.
    Standalone and Sentinel clients need nothing: their pools reset by pid.
    """
    if not isinstance(client, RedisCluster):
        return
    manager = getattr(client, "nodes_manager", None)
    shared = manager is not None and getattr(manager, "_lock", None) is getattr(
        client, "_lock", None
    )
    if hasattr(client, "_lock"):
        client._lock = threading.RLock()  # noqa: SLF001  (redis-py has no public reset)
    if manager is not None:
        if hasattr(manager, "_lock"):
            manager._lock = client._lock if shared else threading.RLock()  # noqa: SLF001
        if hasattr(manager, "_initialization_lock"):
            manager._initialization_lock = threading.RLock()  # noqa: SLF001


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
    # from_pool: the client owns the pool, so close() closes its connections.
    return redis.Redis.from_pool(pool)


def describe_client(client: AnyRedis) -> str:
    """A URL-like description of where ``client`` connects (no password)."""
    if isinstance(client, RedisCluster):
        # The cluster URL form (usable as --url); the primaries it knows now.
        ckw = client.nodes_manager.connection_kwargs
        tls = bool(ckw.get("ssl")) or issubclass(
            ckw.get("connection_class", redis.Connection), redis.SSLConnection
        )
        nodes = ",".join(
            f"[{n.host}]:{n.port}" if ":" in n.host else f"{n.host}:{n.port}"
            for n in client.get_primaries()
        )
        return f"{CLUSTER_SCHEMES[1] if tls else CLUSTER_SCHEMES[0]}{nodes}/"
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
