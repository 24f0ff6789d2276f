"""Every ``redislock_*`` Celery setting, declared once, validated once.

:data:`SETTINGS` is the single table: name, type, default, unit and a one-line
doc. :func:`load_config` reads ``app.conf`` (any mapping) into a frozen
:class:`Config`; a bad value raises :class:`ConfigurationError` naming the
setting and what it accepts. ``docs/configuration.md`` is generated from the
table by :func:`markdown_table` (a test keeps the two equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import _validate as _v
from ..exceptions import ConfigurationError
from ..protocol.keys import validate_namespace
from ..protocol.options import (
    EVICTION_CHECK_MODES,
    MAX_WAIT_REPLICAS,
    MAX_WAIT_TIMEOUT,
    MIN_WAIT_TIMEOUT,
    WAIT_POLICIES,
)
from ..store.connect import is_sentinel_url, parse_sentinel_url, redact, validate_url

#: Broker URL schemes the lock engine can reuse as its own Redis URL.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
#: Values of ``redislock_eviction_check`` (the engine's ``eviction_check``).
EVICTION_MODES = EVICTION_CHECK_MODES
#: Bounds of ``redislock_reconcile_interval`` when set (seconds; 0 or None: off).
MIN_RECONCILE_INTERVAL = 1.0
MAX_RECONCILE_INTERVAL = 7 * 86400.0
#: Default of ``redislock_unique_ttl`` (seconds): how long a unique task's
#: key may wait in the broker for a worker to start the task.
DEFAULT_UNIQUE_TTL = 3600.0
#: Values of ``locked(on_busy=...)``.
ON_BUSY_MODES = ("wait", "defer", "retry", "raise", "skip")
#: Values of ``redislock_on_lost`` and ``locked(on_lost=...)``.
ON_LOST_MODES = ("fail", "terminate", "ignore")
#: Bounds of ``redislock_defer_ttl`` and ``redislock_defer_grant_ttl`` (seconds).
MIN_DEFER_TTL = 1.0
#: Default of ``redislock_defer_guard_rate`` (guard checks a second, namespace-wide)
#: and its bounds when set (0 or None: no budget).
DEFAULT_DEFER_GUARD_RATE = 20.0
MIN_DEFER_GUARD_RATE = 0.01
MAX_DEFER_GUARD_RATE = 100000.0
MAX_DEFER_TTL = 30 * 86400.0
#: Marks a setting left unset (where None is a value of its own).
_UNSET: Any = object()

#: Exit status of a worker or beat that refuses to start because a
#: ``redislock_*`` setting is refused (EX_CONFIG in sysexits.h).
EX_CONFIG = 78


class _AppDefault:
    """Marks an option left to the app's ``redislock_*`` setting."""

    def __repr__(self) -> str:
        return "<app setting>"


#: Marks "use the app's setting" (redislock_default_timeout, ...) in an
#: option of ``@locked``; its repr keeps ``inspect.signature(locked)`` and
#: ``help(locked)`` readable.
APP_DEFAULT: Any = _AppDefault()


def config_error_line(exc: ConfigurationError) -> str:
    """The one line every process prints for a refused ``redislock_*`` setting."""
    return f"celery_redislock: invalid setting {exc}"


@dataclass(frozen=True)
class Setting:
    """One setting: its name in ``app.conf``, type, default, unit and doc."""

    name: str
    type: str
    default: str
    doc: str


#: The table of every setting (the configuration docs are generated from it).
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "redislock_url",
        "str",
        "the broker URL when it is redis://, rediss://, unix:// or sentinel://",
        "Redis URL of the lock engine (redis://, rediss://, unix://, "
        "sentinel://host:26379[,host2:26379]/service_name[/db] or, for Redis "
        "Cluster, redis+cluster://host:6379[,host2:6379]/ (rediss+cluster:// "
        "for TLS)); required when the broker is not Redis.",
    ),
    Setting(
        "redislock_namespace",
        "str",
        "'redislock'",
        "Key namespace (hash tag); the CLI and any LockManager with the same "
        "namespace see the same locks. 1-64 of [A-Za-z0-9_.-].",
    ),
    Setting(
        "redislock_owner_ttl",
        "float (seconds)",
        "30.0",
        "Liveness TTL of every owner (process). A crashed worker nobody cleans "
        "up blocks its resources at most this long. 0.1..86400.",
    ),
    Setting(
        "redislock_heartbeat_interval",
        "float (seconds)",
        "owner_ttl / 3",
        "Seconds between node heartbeats (one round trip refreshes every owner "
        "of the worker); 0.05 (floor) to owner_ttl / 2; below 0.5 a warning is "
        "logged (each idle owner then sends over 2 commands a second).",
    ),
    Setting(
        "redislock_reconcile_interval",
        "float (seconds) or None",
        "60.0",
        "Period of the celery_redislock.reconcile beat entry (also its expiry); "
        "None or 0 adds no beat entry; otherwise 1..604800.",
    ),
    Setting(
        "redislock_default_timeout",
        "float (seconds) or None",
        "None",
        "How long @locked(on_busy='wait') waits when the decorator gives no "
        "timeout; None waits until granted (bounded by the task's time limits). >= 0.",
    ),
    Setting(
        "redislock_default_on_busy",
        "'wait' | 'defer' | 'retry' | 'raise' | 'skip'",
        "'wait'",
        "on_busy of every @locked that does not name one. 'defer': a busy task keeps "
        "its place in line, frees its pool slot and is dispatched again when the lock "
        "is handed to it (docs/defer.md).",
    ),
    Setting(
        "redislock_defer_ttl",
        "float (seconds)",
        "86400.0",
        "Longest a deferred task stays parked (then it fails with LockTimeout) when "
        "@locked gives no timeout; also how long a finished deferred task's record "
        "keeps stale copies of its message out. 1..2592000.",
    ),
    Setting(
        "redislock_defer_grant_ttl",
        "float (seconds)",
        "300.0",
        "How long a lock handed to a deferred task waits for a worker to take the "
        "re-published task (broker transit and queueing); past it the lock is handed on "
        "and the task parked again. 1..2592000.",
    ),
    Setting(
        "redislock_defer_guard_interval",
        "float (seconds) | None",
        "300.0 when redislock_url is set, else None",
        "How often a parked deferred task's guard message (a copy in the broker) checks "
        "that the lock Redis still holds it, and re-publishes the task if that Redis "
        'lost it (docs/defer.md, "Guards"). Keep it below the broker\'s visibility_timeout. '
        "None or 0: no guards (the default when the lock Redis is the broker's, whose "
        "loss takes the queues with it). 1..2592000.",
    ),
    Setting(
        "redislock_defer_guard_rate",
        "float (checks per second) | None",
        "20.0",
        "The namespace's budget of guard checks: with more parked tasks than "
        "rate x redislock_defer_guard_interval, each guard's next check comes after "
        "(parked tasks) / rate seconds instead, so all guards together make about rate "
        "checks a second however many tasks are parked (a lost task is then re-published "
        'that much later). None or 0: no budget (docs/defer.md, "Guards"). 0.01..100000.',
    ),
    Setting(
        "redislock_fast_restart_cleanup",
        "bool",
        "True",
        "At worker start, free the locks of the same-name predecessor once its "
        "heartbeat has stopped for two intervals (compare-and-set: one successor does "
        "it, and the predecessor can never hold locks again). "
        "False: they are freed when its owners' liveness expires.",
    ),
    Setting(
        "redislock_eviction_check",
        "'warn' | 'raise' | 'ignore'",
        "'warn'",
        "At worker start, what to do when Redis may evict keys "
        "(maxmemory-policy other than noeviction).",
    ),
    Setting(
        "redislock_on_lost",
        "'fail' | 'terminate' | 'ignore'",
        "'fail'",
        "What a @locked task whose lock was lost while its body ran does (the "
        "decorator's on_lost= overrides it): 'fail' raises LockLost (naming the "
        "cause) once the body returns; 'terminate' kills the prefork pool child "
        "at once, like a hard time limit (other pools: as 'fail'); 'ignore' only "
        "logs locked.lost.",
    ),
    Setting(
        "redislock_wait_replicas",
        "int",
        "0",
        "After every grant, WAIT until this many replicas have it before the task "
        "body runs, so a failover cannot forget the grant. 0 (off) to 100.",
    ),
    Setting(
        "redislock_wait_timeout",
        "float (seconds)",
        "1.0",
        "How long that WAIT may block (each acquire attempt may take this long "
        "while replicas lag); 0.001..60 and below the socket timeout.",
    ),
    Setting(
        "redislock_wait_policy",
        "'fail' | 'retry'",
        "'fail'",
        "When fewer replicas acknowledge a grant in time, it is released, then: "
        "'fail' raises ReplicationTimeout (a LockTimeout); 'retry' asks again "
        "until the acquire's timeout.",
    ),
    Setting(
        "redislock_metrics_port",
        "int or None",
        "None",
        "TCP port of the worker's Prometheus endpoint (needs the prometheus extra: "
        "pip install celery-redislock[prometheus]); one endpoint per worker, its "
        "pool children included (docs/metrics.md). None or 0: no metrics. 1..65535.",
    ),
    Setting(
        "redislock_metrics_address",
        "str",
        "'0.0.0.0'",
        "Address the metrics endpoint listens on ('127.0.0.1': this host only).",
    ),
    Setting(
        "redislock_unique_ttl",
        "float (seconds)",
        "3600.0",
        "Default unique_ttl of UniqueTask: how long a unique task's key is held "
        "for a message not yet started (queued, or its producer died); then it "
        "is freed. A running task's key lives with its worker process. 0.1..86400.",
    ),
)

SETTING_NAMES = frozenset(s.name for s in SETTINGS)


class HiddenURL:
    """A URL kept in ``app.conf`` whose text (``repr`` and ``str``) masks its passwords.

    ``celery inspect conf`` and ``celery report`` print every setting with
    ``repr`` and mask only names Celery knows (``broker_url``,
    ``result_backend``, names containing ``PASS``, ``SECRET``...): a plain
    ``redislock_url`` would show its password. :func:`hide_url_password`
    wraps it in this object; :func:`load_config` reads it back with
    :meth:`reveal`. Picklable.
    """

    __slots__ = ("_url",)

    def __init__(self, url: str) -> None:
        self._url = url

    def reveal(self) -> str:
        """The URL with its password (for connecting; never print it)."""
        return self._url

    def __repr__(self) -> str:
        return repr(redact(self._url))

    def __str__(self) -> str:
        return redact(self._url)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HiddenURL) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)

    def __reduce__(self) -> tuple[Any, ...]:
        return (HiddenURL, (self._url,))


def reveal(value: Any) -> Any:
    """``value`` itself, or the URL inside a :class:`HiddenURL`."""
    return value.reveal() if isinstance(value, HiddenURL) else value


def hide_url_password(conf: Any) -> None:
    """Wrap ``conf['redislock_url']`` in :class:`HiddenURL` if it carries a password.

    Idempotent; leaves any other value (no password, not a str) as it is.
    """
    try:
        url = conf.get("redislock_url")
    except Exception:  # a lazy settings object that fails to load
        return
    if isinstance(url, str) and redact(url) != url:
        conf["redislock_url"] = HiddenURL(url)


@dataclass(frozen=True)
class Config:
    """The validated settings (see :data:`SETTINGS` for each field's meaning)."""

    url: str
    namespace: str = "redislock"
    owner_ttl: float = 30.0
    heartbeat_interval: float = 10.0
    reconcile_interval: float | None = 60.0
    default_timeout: float | None = None
    fast_restart_cleanup: bool = True
    eviction_check: str = "warn"
    on_lost: str = "fail"
    wait_replicas: int = 0
    wait_timeout: float = 1.0
    wait_policy: str = "fail"
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    unique_ttl: float = DEFAULT_UNIQUE_TTL
    default_on_busy: str = "wait"
    defer_ttl: float = 86400.0
    defer_grant_ttl: float = 300.0
    #: Seconds between a parked task's guard checks (None for no guards).
    defer_guard_interval: float | None = None
    #: The guard checks a second the whole namespace may make, or None for no budget.
    defer_guard_rate: float | None = DEFAULT_DEFER_GUARD_RATE


def _number(name: str, value: Any, **bounds: Any) -> float | None:
    """A number of seconds (a numeric string is accepted), range-checked
    (``bounds``: those of :func:`celery_redislock._validate.seconds`)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    return _v.seconds(name, value, **bounds)


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(name, f"must be True or False, not {value!r}")


def default_url(broker_url: Any, transport_options: Any = None) -> str | None:
    """The broker URL if the lock engine can use it (a Redis URL), else None.

    A kombu Sentinel broker (``sentinel://h1:26379;sentinel://h2:26379/db``
    with ``broker_transport_options={'master_name': ...}``) becomes the
    canonical ``sentinel://h1:26379,h2:26379/master_name/db``; Sentinel
    credentials from ``transport_options['sentinel_kwargs']`` (``username``,
    ``password``) are carried over. Without ``master_name`` (or with a
    malformed Sentinel URL) it is None.
    """
    if isinstance(broker_url, (list, tuple)):
        items = [u for u in broker_url if isinstance(u, str)]
        if items and all(is_sentinel_url(u) for u in items):
            broker_url = ";".join(items)
        else:
            broker_url = broker_url[0] if broker_url else None
    if not isinstance(broker_url, str):
        return None
    if is_sentinel_url(broker_url):
        return _sentinel_broker_url(broker_url, transport_options)
    first = broker_url.split(";")[0].strip()
    return first if first.startswith(REDIS_SCHEMES) else None


def _sentinel_broker_url(broker_url: str, transport_options: Any) -> str | None:
    opts = transport_options if isinstance(transport_options, Mapping) else {}
    master_name = opts.get("master_name")
    if not isinstance(master_name, str) or not master_name:
        return None
    try:
        spec = parse_sentinel_url(broker_url, setting="broker_url", master_name=master_name)
    except ConfigurationError:
        return None
    extra = dict(spec.options)
    sentinel_kwargs = opts.get("sentinel_kwargs")
    if isinstance(sentinel_kwargs, Mapping):
        for key in ("username", "password"):
            if isinstance(sentinel_kwargs.get(key), str):
                extra.setdefault(f"sentinel_{key}", sentinel_kwargs[key])
    return type(spec)(
        sentinels=spec.sentinels,
        service_name=spec.service_name,
        db=spec.db,
        username=spec.username,
        password=spec.password,
        options=extra,
    ).to_url()


def load_config(conf: Mapping[str, Any]) -> Config:
    """Validate the ``redislock_*`` settings of ``conf`` (e.g. ``app.conf``).

    Raises:
        ConfigurationError: naming the setting and the values it accepts.
    """
    get: Callable[[str, Any], Any] = conf.get
    # In the order the settings table lists them: the first bad one is named.
    url, own_url = _url_setting(get)
    namespace = _namespace_setting(get)
    owner_ttl, interval = _liveness_settings(get)
    reconcile, timeout, fast = _engine_settings(get)
    mode = _choice(get, "redislock_eviction_check", EVICTION_MODES, "warn")
    on_lost = _choice(get, "redislock_on_lost", ON_LOST_MODES, "fail")
    wait_replicas, wait_timeout, wait_policy = _wait_settings(get)
    metrics_port, metrics_address = _metrics_settings(get)
    raw_unique = get("redislock_unique_ttl", None)
    unique_ttl = _number(
        "redislock_unique_ttl",
        DEFAULT_UNIQUE_TTL if raw_unique is None else raw_unique,
        minimum=_v.MIN_OWNER_TTL,
        maximum=_v.MAX_OWNER_TTL,
    )
    assert unique_ttl is not None
    on_busy = _choice(get, "redislock_default_on_busy", ON_BUSY_MODES, "wait")
    defer_ttl, grant_ttl, guard, guard_rate = _defer_settings(get, own_url)
    return Config(
        url=url,
        namespace=namespace,
        owner_ttl=owner_ttl,
        heartbeat_interval=interval,
        reconcile_interval=reconcile,
        default_timeout=timeout,
        fast_restart_cleanup=fast,
        eviction_check=mode,
        on_lost=on_lost,
        wait_replicas=wait_replicas,
        wait_timeout=wait_timeout,
        wait_policy=wait_policy,
        metrics_port=metrics_port,
        metrics_address=metrics_address,
        unique_ttl=unique_ttl,
        default_on_busy=on_busy,
        defer_ttl=defer_ttl,
        defer_grant_ttl=grant_ttl,
        defer_guard_interval=guard,
        defer_guard_rate=guard_rate,
    )


def _url_setting(get: Callable[[str, Any], Any]) -> tuple[str, bool]:
    """``redislock_url`` (default: the broker's Redis), and whether it was set."""
    url = reveal(get("redislock_url", None))
    if url is not None:
        return validate_url(url, setting="redislock_url"), True
    broker = get("broker_url", None)
    url = default_url(broker, get("broker_transport_options", None))
    if url is not None:
        return url, False
    first = broker[0] if isinstance(broker, (list, tuple)) and broker else broker
    if isinstance(first, str) and is_sentinel_url(first):
        raise ConfigurationError(
            "redislock_url",
            "is required: the sentinel:// broker gives no usable master "
            "(set broker_transport_options={'master_name': ...}) or set "
            "redislock_url to sentinel://host:26379[,host2:26379]/service_name[/db]",
        )
    raise ConfigurationError(
        "redislock_url",
        "is required when the broker is not Redis (broker_url="
        f"{redact(broker) if isinstance(broker, str) else broker!r}); "
        "set it to a redis://, rediss://, sentinel:// or redis+cluster:// URL",
    )


def _namespace_setting(get: Callable[[str, Any], Any]) -> str:
    """``redislock_namespace``, validated as the engine validates it."""
    namespace = get("redislock_namespace", None)
    if namespace is None:
        namespace = "redislock"
    try:
        validate_namespace(namespace)
    except ConfigurationError as exc:
        raise ConfigurationError("redislock_namespace", str(exc).split(": ", 1)[-1]) from exc
    return str(namespace)


def _liveness_settings(get: Callable[[str, Any], Any]) -> tuple[float, float]:
    """``redislock_owner_ttl`` and ``redislock_heartbeat_interval``."""
    raw_ttl = get("redislock_owner_ttl", None)
    owner_ttl = (
        30.0
        if raw_ttl is None
        else _number(
            "redislock_owner_ttl", raw_ttl, minimum=_v.MIN_OWNER_TTL, maximum=_v.MAX_OWNER_TTL
        )
    )
    assert owner_ttl is not None
    raw_iv = get("redislock_heartbeat_interval", None)
    interval = _number(
        "redislock_heartbeat_interval",
        max(owner_ttl / 3, _v.MIN_HEARTBEAT_INTERVAL) if raw_iv is None else raw_iv,
        minimum=_v.MIN_HEARTBEAT_INTERVAL,
        maximum=owner_ttl / 2,
    )
    assert interval is not None
    _v.warn_fast_heartbeat("redislock_heartbeat_interval", interval)
    return owner_ttl, interval


def _engine_settings(get: Callable[[str, Any], Any]) -> tuple[float | None, float | None, bool]:
    """``redislock_reconcile_interval``, ``redislock_default_timeout`` and
    ``redislock_fast_restart_cleanup``."""
    raw_rec = get("redislock_reconcile_interval", 60.0)
    reconcile: float | None
    if raw_rec in (0, "0", None):
        reconcile = None
    else:
        reconcile = _number(
            "redislock_reconcile_interval",
            raw_rec,
            minimum=MIN_RECONCILE_INTERVAL,
            maximum=MAX_RECONCILE_INTERVAL,
        )
    timeout = _number(
        "redislock_default_timeout",
        get("redislock_default_timeout", None),
        allow_none=True,
        allow_inf=True,
    )
    if timeout is not None and math.isinf(timeout):
        timeout = None
    fast = get("redislock_fast_restart_cleanup", None)
    return (
        reconcile,
        timeout,
        True if fast is None else _bool("redislock_fast_restart_cleanup", fast),
    )


def _choice(
    get: Callable[[str, Any], Any], name: str, values: tuple[str, ...], default: str
) -> str:
    """A setting that takes one of ``values`` (unset or empty: ``default``)."""
    value = get(name, None) or default
    if not isinstance(value, str) or value not in values:
        raise ConfigurationError(name, f"must be one of {', '.join(values)}, not {value!r}")
    return value


def _defer_settings(
    get: Callable[[str, Any], Any], own_url: bool
) -> tuple[float, float, float | None, float | None]:
    """``redislock_defer_ttl``, ``_defer_grant_ttl``, ``_defer_guard_interval``
    and ``_defer_guard_rate``."""
    ttls = []
    for name, default in (("redislock_defer_ttl", 86400.0), ("redislock_defer_grant_ttl", 300.0)):
        raw = get(name, None)
        value = (
            default
            if raw is None
            else _number(name, raw, minimum=MIN_DEFER_TTL, maximum=MAX_DEFER_TTL)
        )
        assert value is not None
        ttls.append(value)
    # Guards protect parked tasks from a loss of the lock Redis's data; with
    # the broker's own Redis (the default) such a loss takes the broker's
    # queues, guards included, with it: no guards unless asked for.
    raw_guard = get("redislock_defer_guard_interval", _UNSET)
    if raw_guard is _UNSET:
        guard: float | None = 300.0 if own_url else None
    elif raw_guard is None or (raw_guard == 0 and not isinstance(raw_guard, bool)):
        guard = None
    else:
        guard = _number(
            "redislock_defer_guard_interval",
            raw_guard,
            minimum=MIN_DEFER_TTL,
            maximum=MAX_DEFER_TTL,
        )
    raw_rate = get("redislock_defer_guard_rate", DEFAULT_DEFER_GUARD_RATE)
    if raw_rate is None or (raw_rate == 0 and not isinstance(raw_rate, bool)):
        rate: float | None = None
    else:
        rate = _number(
            "redislock_defer_guard_rate",
            raw_rate,
            minimum=MIN_DEFER_GUARD_RATE,
            maximum=MAX_DEFER_GUARD_RATE,
        )
    return ttls[0], ttls[1], guard, rate


def _metrics_settings(get: Callable[[str, Any], Any]) -> tuple[int | None, str]:
    """``redislock_metrics_port`` and ``redislock_metrics_address``, validated."""
    name = "redislock_metrics_port"
    raw = get(name, None)
    port: Any = raw
    if isinstance(port, str) and port.strip().isdigit():
        port = int(port)
    if port is None or (port == 0 and not isinstance(port, bool)):
        port = None
    elif isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigurationError(
            name, f"must be a TCP port 1..65535 (None or 0: no metrics), not {raw!r}"
        )
    name = "redislock_metrics_address"
    address = get(name, None)
    if address is None:
        address = "0.0.0.0"
    if not isinstance(address, str) or not address or any(c.isspace() for c in address):
        raise ConfigurationError(
            name, f"must be a host address such as '0.0.0.0' or '127.0.0.1', not {address!r}"
        )
    return port, address


def _wait_settings(get: Callable[[str, Any], Any]) -> tuple[int, float, str]:
    """``redislock_wait_replicas``, ``_wait_timeout`` and ``_wait_policy``, validated."""
    name = "redislock_wait_replicas"
    raw = get(name, None)
    replicas: Any = 0 if raw is None else raw
    if isinstance(replicas, str) and replicas.strip().isdigit():
        replicas = int(replicas)
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ConfigurationError(name, f"must be a non-negative int (0: off), not {raw!r}")
    if not 0 <= replicas <= MAX_WAIT_REPLICAS:
        raise ConfigurationError(
            name, f"must be within 0..{MAX_WAIT_REPLICAS} (0: off), not {replicas}"
        )
    name = "redislock_wait_timeout"
    raw = get(name, None)
    timeout = (
        1.0
        if raw is None
        else _number(name, raw, minimum=MIN_WAIT_TIMEOUT, maximum=MAX_WAIT_TIMEOUT)
    )
    assert timeout is not None
    if not MIN_WAIT_TIMEOUT <= timeout <= MAX_WAIT_TIMEOUT:
        raise ConfigurationError(
            name, f"must be within {MIN_WAIT_TIMEOUT}..{MAX_WAIT_TIMEOUT} seconds, not {timeout}"
        )
    name = "redislock_wait_policy"
    policy = get(name, None) or "fail"
    if not isinstance(policy, str) or policy not in WAIT_POLICIES:
        raise ConfigurationError(name, f"must be one of {', '.join(WAIT_POLICIES)}, not {policy!r}")
    return replicas, timeout, policy


def markdown_table() -> str:
    """The settings table in Markdown (``docs/configuration.md`` embeds it).

    A ``|`` inside a cell (``'warn' | 'raise'``) is escaped as ``\\|`` so
    that it does not end the cell.
    """

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| Setting | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        lines.append(f"| `{s.name}` | {cell(s.type)} | {cell(s.default)} | {cell(s.doc)} |")
    return "\n".join(lines) + "\n"
