"""The lock engine: :class:`LockManager` acquires, releases and cleans up.

It works without Celery. One manager per process and Redis namespace is
the normal use; it is thread-safe, fork-safe (a child gets a new owner id,
a new heartbeat and new connections) and cancellation-safe (every exit of
an acquisition releases or dequeues by its own token).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import random
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.sentinel import SentinelConnectionPool

from . import _validate as _v
from . import wire
from ._threads import real_sleep, start_os_thread
from .checks import EvictionCheck, check_eviction
from .connect import (
    AnyRedis,
    client_from_url,
    clone_client,
    describe_client,
    is_sentinel_url,
    parse_sentinel_url,
    redact,
    reset_locks_after_fork,
)
from .context import ContextStack
from .exceptions import (
    CAUSE_DECLARED_DEAD,
    CAUSE_EXPIRED,
    CAUSE_OPERATOR,
    CAUSE_REDIS_LOST,
    LOST_CAUSES,
    ConfigurationError,
    FormatMismatch,
    InvalidResource,
    LockError,
    LockTimeout,
    LockUpgradeError,
    PermissionDenied,
    RedisUnavailable,
    ReplicationTimeout,
    ShuttingDown,
    permission_denied,
)
from .heartbeat import Heartbeat
from .identity import IdentitySource, OwnerIdentity, new_request_id
from .keys import (
    FORMAT_VERSION,
    MAX_RESOURCES,
    UNVERSIONED_FORMAT,
    Keyspace,
    holder_record,
    task_id_of_token,
    task_owner_id,
    task_token,
    validate_owner_id,
    validate_resource,
)
from .lease import Lease
from .metrics import MetricsHook
from .reports import CleanupReport, LockHolder, ReconcileReport
from .scripts import Scripts

log_acquire = logging.getLogger("celery_redislock.acquire")
log_release = logging.getLogger("celery_redislock.release")
log_cleanup = logging.getLogger("celery_redislock.cleanup")
log_reconcile = logging.getLogger("celery_redislock.reconcile")
log_heartbeat = logging.getLogger("celery_redislock.heartbeat")

#: Default liveness TTL of an owner, seconds. A crashed owner's locks block
#: others at most this long when nothing else cleans them up (in a Celery
#: worker, the main process frees a dead child's locks within one tick).
DEFAULT_OWNER_TTL = 30.0
#: Default queue scan limit: live entries one script looks at per wait queue
#: (dead entries it removes have a budget of their own, 4 x this limit).
DEFAULT_SCAN_LIMIT = 256
#: Values of ``LockManager(wait_policy=...)``: what an acquire does when
#: fewer than ``wait_replicas`` replicas acknowledge its grant in time.
WAIT_POLICIES = ("fail", "retry")
#: Default ``wait_timeout`` (seconds) and the bounds of ``wait_replicas`` /
#: ``wait_timeout`` (the timeout is also kept below the socket timeout).
DEFAULT_WAIT_TIMEOUT = 1.0
MAX_WAIT_REPLICAS = 100
MIN_WAIT_TIMEOUT = 0.001
MAX_WAIT_TIMEOUT = 60.0
#: Safety margin of the local liveness deadline (docs/design.md, "Loss
#: model"): a lease counts as lost this long before its owner's liveness key
#: can expire in Redis, to absorb clock drift between this host's monotonic
#: clock and the Redis server's expiry clock (NTP slewing, a stepped clock):
#: a tenth of owner_ttl, at most LIVENESS_MARGIN_MAX seconds.
LIVENESS_MARGIN_FRACTION = 0.1
LIVENESS_MARGIN_MAX = 2.0
#: Most validated requests a manager keeps (see ``LockManager._request``).
_REQUEST_CACHE = 1024
#: What close() pushes to its own ``{ns}:lost:<owner>`` to wake its watcher
#: (not a loss notice: cleanups push "dead", "operator" and the like).
_WATCH_STOP = "closing"
#: select.poll where the platform has it (not on Windows); see _stale.
_POLL: Any = getattr(select, "poll", None)
#: Seconds an idle lost-owner watcher sleeps between looks at its process's
#: state (no Redis traffic): a lease granted meanwhile is watched this late
#: (at most half the heartbeat interval, like the watcher's BLPOP).
_WATCH_IDLE_SLICE = 0.05
#: What ``_block`` returns for a ``t`` on the wake list (``defer_nudge.lua``):
#: a grant in transit to a parked task waits for a pool slot ahead of this
#: request (docs/defer.md, "Waiting tasks behind a grant in transit").
_TRANSIT_WAKE = -2
#: Values of ``LockManager(eviction_check=...)``.
EVICTION_CHECK_MODES = ("warn", "raise", "ignore")


#: The cache key of resource names that are not cached (another iterable).
_UNCACHED: Any = object()


def _cache_key(names: Any) -> Any:
    """The request cache's key for ``names`` (None, a str, or a list or tuple
    of str: a tuple of them), or :data:`_UNCACHED`."""
    if names is None or type(names) is str:
        return names
    kind = type(names)
    if kind is list or kind is tuple:
        for name in names:
            if type(name) is not str:
                return _UNCACHED
        return tuple(names)
    return _UNCACHED


#: Leases an owner holds before its further resource names go to its
#: registry's buckets (``_common.lua`` ``registry_add``): every registry hash
#: then stays a compact listpack/ziplist (at most 128 fields by default),
#: however many locks one process holds. Costs one more command per acquire
#: and release of such an owner.
REGISTRY_SPILL_AT = 64

#: Errors that mean Redis cannot be reached or cannot serve (reported as
#: RedisUnavailable): a dropped or refused connection, a timeout, and a Redis
#: Cluster that marked itself down (CLUSTERDOWN, e.g. a master lost).
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
)


#: Encoded ``BLPOP``, the command name of a waiter's wait (:mod:`.wire`).
_BLPOP = wire.bulk("BLPOP")


def _stale(conn: Any) -> bool:
    """Whether a held connection has something to read between two commands
    (a reply nobody read, or the end of a socket the server closed).

    One ``poll`` with no wait on its socket: redis-py's own ``can_read``
    costs three system calls and an exception here. Without ``poll``, or
    without the socket redis-py keeps in ``_sock``, its ``can_read``.
    """
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False  # not connected: the command connects
    if _POLL is None:
        try:
            return bool(conn.can_read())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return True
    try:
        p = _POLL()
        p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True  # an unusable socket: reconnect


def _can_hold(client: Any) -> bool:
    """Whether LockManager._conn may give each thread a held connection of
    ``client``'s pool."""
    return (
        isinstance(client, redis.Redis)
        and not getattr(client, "_single_connection_client", False)
        and not isinstance(
            client.connection_pool, (redis.BlockingConnectionPool, SentinelConnectionPool)
        )
    )


def _socket_timeout(client: AnyRedis) -> float | None:
    """The socket timeout the client's connections use (None: no timeout).

    ``Redis.from_url`` leaves ``socket_timeout`` out of the pool's kwargs when
    the URL does not set it, and the connection class's default (5 s in
    redis-py 5+) applies: read that default rather than assume none.
    """
    if isinstance(client, RedisCluster):  # its node pools share these kwargs
        cluster_value = client.nodes_manager.connection_kwargs.get("socket_timeout", 5.0)
        return float(cluster_value) if cluster_value else None
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if "socket_timeout" in kwargs:
        value = kwargs["socket_timeout"]
    else:
        # The first class in the MRO whose __init__ names socket_timeout
        # (Connection and SentinelManagedConnection take **kwargs).
        value = 5.0
        for cls in pool.connection_class.__mro__:
            init = cls.__dict__.get("__init__")
            param = inspect.signature(init).parameters.get("socket_timeout") if init else None
            if param is not None:
                if param.default is not inspect.Parameter.empty:
                    value = param.default
                break
    return float(value) if value else None


#: What each place that finds an owner lost tells the operator (logged once).
_GONE = (
    "liveness key gone: paused or partitioned longer than owner_ttl, force-released, "
    "evicted by Redis (maxmemory-policy), or Redis lost its data (restart without "
    "persistence, FLUSHALL, failover to a replica that missed it)"
)
_LOSS_CAUSES = {
    "heartbeat": _GONE,
    "acquire": _GONE,
    "watch": _GONE,
    "declared-dead": "a cleanup declared this owner dead (its worker, reconcile or an operator)",
    "deadline": "local liveness deadline passed: no confirmed refresh for owner_ttl less the "
    "margin (this process was paused or starved, or Redis was unreachable)",
    "node-heartbeat": "the worker's node heartbeat found the liveness key gone",
    "node-state-lost": "Redis lost the worker's node record or group (restart without "
    "persistence, FLUSHALL, failover, eviction)",
}
#: What each cause means for the operator reading the heartbeat.lost line.
_LOSS_DETAIL = {
    CAUSE_OPERATOR: "an operator freed this owner's locks (`redislock release --force`); "
    "its liveness key was deleted",
    CAUSE_DECLARED_DEAD: "a cleanup declared this owner dead (its worker, reconcile or a "
    "successor node's eviction) and freed its locks",
    CAUSE_EXPIRED: "no confirmed refresh for owner_ttl: this process was paused, starved "
    "or partitioned from Redis longer than that (or Redis evicted the liveness key)",
    CAUSE_REDIS_LOST: "Redis lost its data (restart without persistence, FLUSHALL, "
    "failover to a replica that missed it) or evicted the lock",
}


#: Reason codes a cleanup leaves in the owner's tombstone ``{ns}:dead:<owner>``
#: and pushes to its lost list (``cleanup_owner(reason=...)``), and what
#: each means. Any other value (node_evict.lua writes '1') reads as declared dead.
CLEANUP_REASONS = {
    "operator": CAUSE_OPERATOR,
    "dead": CAUSE_DECLARED_DEAD,
}
#: The cause (``Lease.lost_cause``) of each engine loss code.
_CAUSES = {
    "operator": CAUSE_OPERATOR,
    "declared-dead": CAUSE_DECLARED_DEAD,
    "dead": CAUSE_DECLARED_DEAD,
    "deadline": CAUSE_EXPIRED,
    "expired": CAUSE_EXPIRED,
    "redis-lost": CAUSE_REDIS_LOST,
    "node-state-lost": CAUSE_REDIS_LOST,
    "grant-gone": CAUSE_REDIS_LOST,
}


def cause_text(code: str | None) -> str | None:
    """The operator-facing cause of an engine loss code (or a cause itself)."""
    if code is None or code in LOST_CAUSES:
        return code
    return _CAUSES.get(code, CAUSE_DECLARED_DEAD if code in ("1", "lost") else CAUSE_EXPIRED)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def format_verdict(namespace: str, url: str, found: str | None, how: str) -> int | None:
    """The namespace's data format, or :class:`FormatMismatch` if not ours.

    ``found``: the format read (None: the namespace holds no lock data);
    ``how``: ``'stored'`` (read from ``{ns}:format``), ``'created'`` (just
    written) or ``'unversioned'`` (inferred from data of a release from
    before format versioning).
    """
    if found is None:
        return None
    try:
        version = int(found)
    except ValueError:
        version = -1  # not a number: no release of ours wrote it
    if version != FORMAT_VERSION:
        raise FormatMismatch(namespace, url, version, FORMAT_VERSION, how == "unversioned")
    return version


@dataclass(frozen=True)
class _Request:
    """A validated request: resources, their modes and their keys."""

    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    modes: str
    lock_keys: tuple[str, ...]
    queue_keys: tuple[str, ...]
    #: ``modes`` and ``lock_keys`` encoded once, as the scripts receive them.
    wire_modes: bytes = b""
    wire_locks: tuple[bytes, ...] = ()

    @property
    def resources(self) -> tuple[str, ...]:
        return self.exclusive + self.shared


@dataclass(frozen=True)
class TaskGrant:
    """What :meth:`LockManager.acquire_for_task` got.

    Attributes:
        task_id: the task the request was made for.
        granted: True when the task owner holds every resource.
        fencing_token: the grant's fencing token (None when refused).
        token: the holder token stored in the locks (None when refused).
        holder: when refused, the holder token of a grant that blocked it
            (None if it left before it could be read).
        repeated: granted, and the task owner already held this grant before
            the call (an earlier call for the same task and attempt). A
            read made just before the script in the same round trip: a
            call that redis-py retried after a lost reply may also see it.
    """

    task_id: str
    granted: bool
    fencing_token: int | None
    token: str | None
    holder: str | None
    repeated: bool = False

    @property
    def holder_owner(self) -> str | None:
        """The owner id of the blocking holder (a task owner or a process)."""
        return None if self.holder is None else self.holder.split("|", 1)[0]

    @property
    def holder_task_id(self) -> str | None:
        """The task id the blocking grant was made for, queued or running.

        A task's grant keeps naming its task after a worker process adopted
        it. None when the blocker is not a task's grant (a plain lock).
        """
        return None if self.holder is None else task_id_of_token(self.holder)


@dataclass(frozen=True)
class Adoption:
    """What :meth:`LockManager.adopt` did.

    Attributes:
        task_id: the task whose owner was adopted.
        status: ``"adopted"``, or why nothing was: ``"expired"``,
            ``"tombstoned"``, ``"adopted-elsewhere"`` or ``"superseded"``
            (a deferred task's park record names another life or state).
        leases: the adopted grants (empty unless ``"adopted"``).
        by: the owner id that adopted them (this process's, or another's).
    """

    task_id: str
    status: str
    leases: list[Lease]
    by: str | None

    @property
    def adopted(self) -> bool:
        """True when this process now holds the task's locks."""
        return self.status == "adopted"


class _Outage:
    """How long one waiter rides out Redis failures, and its backoff.

    A waiter whose Redis call fails (a dropped or refused connection, a
    socket timeout of a stalled server) re-runs its acquire until the
    *bound*: its own deadline, and at most ``owner_ttl`` after the first
    failure of the current outage (by then the owner's liveness, so its
    place in the queue, is gone: the error is reported instead of queueing
    again at the back). ``timeout=0`` has a bound of now: no retry.
    """

    #: First pause after a failure, doubled per failure up to BACKOFF_MAX (s).
    BACKOFF_MIN = 0.05
    BACKOFF_MAX = 1.0

    __slots__ = ("deadline", "failures", "limit", "owner_ttl")

    def __init__(self, deadline: float | None, owner_ttl: float) -> None:
        self.deadline = deadline
        self.owner_ttl = owner_ttl
        self.failures = 0
        self.limit = math.inf

    def left(self) -> float:
        """Seconds until the bound of the current outage."""
        return max(0.0, self.limit - time.monotonic())

    def failed(self) -> float | None:
        """Count one failure: the pause before retrying, or None to give up."""
        now = time.monotonic()
        if self.failures == 0:
            self.limit = now + self.owner_ttl
            if self.deadline is not None:
                self.limit = min(self.limit, self.deadline)
        self.failures += 1
        left = self.limit - now
        if left <= 0:
            return None
        pause = min(self.BACKOFF_MAX, self.BACKOFF_MIN * 2.0 ** min(self.failures - 1, 16))
        return min(left, pause * random.uniform(0.5, 1.0))


class _OrphanRetry:
    """Backoff of one deferred release: 0.5 s doubling up to a cap."""

    __slots__ = ("failures", "next_at")

    def __init__(self) -> None:
        self.failures = 0
        self.next_at = 0.0

    def failed(self, now: float, cap: float) -> float:
        """Count a failure; return the pause before the next try."""
        self.failures += 1
        pause = min(cap, 0.5 * 2.0 ** min(self.failures - 1, 16))
        self.next_at = now + pause
        return pause


class _Depth:
    """Leases held by one thread or greenlet (to recognise nested acquires).

    ``count``: leases held (reentrant ones included); ``leases``: the leases
    with a grant of their own, which a nested acquire of the same thread or
    greenlet may re-enter.
    """

    __slots__ = ("count", "leases")

    def __init__(self) -> None:
        self.count = 0
        self.leases: list[Lease] = []


def _names(value: str | Iterable[str] | None, kind: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (validate_resource(value),)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidResource(f"{kind} resources must be str names, not bytes", value)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise InvalidResource(
            f"{kind} must be a resource name (str), an iterable of names or None, "
            f"not {type(value).__name__} {value!r}",
            value,
        )
    out: list[str] = []
    for name in value:
        name = validate_resource(name)
        if name not in out:
            out.append(name)
    return tuple(out)


class RequestMoved(Exception):
    """Raised by :meth:`LockManager.acquire` when the thread's
    ``park_behind_transit`` hook (set by ``@locked`` around a task's own
    wait) took the queued request over: it waits on as a parked task's
    request, in its place (docs/defer.md, "Waiting tasks behind a grant in
    transit"). Nothing of the acquire's own token is left to release.
    ``behind``: the task id of the grant in transit named by the script's
    reply ('' when a nudge told it)."""

    def __init__(self, resources: Iterable[str], behind: str) -> None:
        self.resources = tuple(resources)
        self.behind = behind
        super().__init__(self.resources, behind)


class LockManager:
    """Acquire exclusive and shared Redis locks, all or nothing, fairly.

    Args:
        redis_url: a ``redis://``, ``rediss://``, ``unix://`` or
            ``sentinel://`` URL (forms: docs/configuration.md), or a
            ready :class:`redis.Redis` or :class:`redis.cluster.RedisCluster`
            client (its pool is reused; replies may be bytes or str).
        namespace: keys live under the hash tag ``{namespace}``; managers,
            workers and the CLI with the same namespace share the same locks.
        owner_ttl: seconds an owner stays alive without a heartbeat. A
            crashed owner's locks are reclaimable this long after its last
            beat; 0.1..86400. Default 30: long enough to ride out a GC or scheduling
            pause of several seconds, short enough that an unattended crash
            clears within half a minute.
        heartbeat_interval: seconds between liveness refreshes, at least
            0.05 (a warning is logged below 0.5) and at most half of
            ``owner_ttl``. Default ``owner_ttl / 3``: two beats may be
            lost (a slow Redis, a blocked process) before the owner is dead.
        queue_scan_limit: most live wait-queue entries one script inspects
            per resource (and the page size of a scan of a lock's holders);
            bounds the work of every script. Dead entries a script removes
            do not count against it: they have a budget of their own, four
            times this limit, past which the work goes on in a later call.
            1..100000.
        name: a label stored with the owner's liveness (shown by the CLI).
        heartbeat: run this process's own heartbeat thread (default). Turn
            it off only when something else refreshes the owner's liveness
            key, as the Celery worker's main process does for its children.
        group: a callable returning the key of a group hash
            (``{ns}:group:<id>``) that the owner registers itself in
            (``owner -> process tag``, see ``identity.process_tag``) on its
            first acquire, or None. The Celery integration groups a worker
            incarnation's owners this way.
        wait_replicas: after every grant, ``WAIT wait_replicas`` so that the
            grant is on that many replicas before ``acquire`` returns (a
            failover then cannot forget it). ``0`` (default): no ``WAIT``.
            The script's reply and ``WAIT`` share one round trip (a
            pipeline); a grant handed over while waiting costs one more.
            Not supported on Redis Cluster.
        wait_timeout: seconds ``WAIT`` may block (default 1.0); at most 60
            and below the client's socket timeout. Every acquire attempt,
            granted or not, may block this long while replicas lag.
        wait_policy: when fewer replicas acknowledge, the grant is released,
            then ``"fail"`` (default) raises :class:`ReplicationTimeout`
            and ``"retry"`` asks again (at the back of the queue) until the
            acquire's own ``timeout`` runs out, then raises
            :class:`ReplicationTimeout`.
        eviction_check: what the first round trip does when Redis may evict
            keys (``maxmemory-policy`` other than ``noeviction``, read from
            INFO): ``"warn"`` (default) logs ``startup.eviction-risk`` once,
            ``"raise"`` refuses every call with :class:`ConfigurationError`,
            ``"ignore"`` skips the check. An evicted liveness key or lock
            frees locks early; the heartbeat tells the holder, but only after
            the fact.
        metrics: a :class:`~celery_redislock.metrics.MetricsHook` told of
            every acquire (wait and outcome), release (hold time), lost
            lease, cleanup and failed heartbeat in this process (and in
            processes forked from it), e.g.
            :class:`celery_redislock.prometheus.PrometheusMetrics`. None
            (default): nothing is recorded, at the cost of one ``is None``
            test per event.
        hold_connection: True (default): each thread (greenlet, forked
            process) that uses the manager keeps one connection of the
            client's pool for the manager's own commands, given back when
            the thread ends or the manager is closed; this skips the pool's
            checkout per command and redis-py's command wrapper for the
            scripts. False: every command checks a connection out of the
            pool, as a plain redis-py call does (for a pool whose
            ``max_connections`` must also cover many managers in one
            thread). Ignored (never held) for Redis Cluster, Sentinel and
            ``BlockingConnectionPool`` clients.

    ``heartbeat=False`` and ``group`` apply to the process that built the
    manager only (the *member* process; a Celery pool child becomes one
    through :signal:`worker_process_init`). A process forked from it is a
    standalone owner: its own heartbeat thread, no group, because nobody
    else knows its owner id and a group's refresher would take it for a
    dead process and free its locks.

    Redis cost: acquire (per attempt), release, heartbeat and
    ``contenders()`` are one round trip each; nothing ever SCANs the keyspace.
    """

    def __init__(
        self,
        redis_url: str | AnyRedis = "redis://127.0.0.1:6379/0",
        namespace: str = "redislock",
        *,
        owner_ttl: float = DEFAULT_OWNER_TTL,
        heartbeat_interval: float | None = None,
        queue_scan_limit: int = DEFAULT_SCAN_LIMIT,
        name: str | None = None,
        heartbeat: bool = True,
        group: Callable[[], str | None] | None = None,
        wait_replicas: int = 0,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        wait_policy: str = "fail",
        eviction_check: str = "warn",
        metrics: MetricsHook | None = None,
        hold_connection: bool = True,
    ) -> None:
        owner_ttl = _v.duration(
            "owner_ttl", owner_ttl, minimum=_v.MIN_OWNER_TTL, maximum=_v.MAX_OWNER_TTL
        )
        heartbeat_interval = _v.duration(
            "heartbeat_interval",
            max(owner_ttl / 3, _v.MIN_HEARTBEAT_INTERVAL)
            if heartbeat_interval is None
            else heartbeat_interval,
            minimum=_v.MIN_HEARTBEAT_INTERVAL,
            maximum=owner_ttl / 2,
        )
        _v.warn_fast_heartbeat("heartbeat_interval", heartbeat_interval)
        queue_scan_limit = _v.integer(
            "queue_scan_limit", queue_scan_limit, minimum=1, maximum=_v.MAX_SCAN_LIMIT
        )
        name = _v.label("name", name)
        heartbeat = _v.flag("heartbeat", heartbeat)
        hold_connection = _v.flag("hold_connection", hold_connection)
        if group is not None and not callable(group):
            raise ConfigurationError("group", f"must be a callable or None, not {group!r}")
        if eviction_check not in EVICTION_CHECK_MODES:
            raise ConfigurationError(
                "eviction_check",
                f"must be one of {', '.join(EVICTION_CHECK_MODES)}, not {eviction_check!r}",
            )
        self.keys = Keyspace(namespace)
        self.namespace = namespace
        self.owner_ttl = float(owner_ttl)
        self.heartbeat_interval = float(heartbeat_interval)
        self.queue_scan_limit = queue_scan_limit
        self.name = name
        if isinstance(redis_url, str):
            self.client: AnyRedis = client_from_url(redis_url, setting="redis_url")
            # Display only (errors, logs, status): a Sentinel URL in canonical
            # form; every password masked.
            self.url = (
                parse_sentinel_url(redis_url).to_url(redacted=True)
                if is_sentinel_url(redis_url)
                else redact(redis_url)
            )
        elif isinstance(redis_url, (redis.Redis, RedisCluster)):
            self.client = redis_url
            self.url = describe_client(redis_url)
        else:
            raise ConfigurationError(
                "redis_url",
                "must be a URL, a redis.Redis or a redis.cluster.RedisCluster client, "
                f"not {type(redis_url).__name__}",
            )
        timeout = _socket_timeout(self.client)
        #: Longest single BLPOP: below the client's socket timeout (a client
        #: made from a URL has redis-py's 5 s default, absent from its kwargs).
        #: Redis ends a blocking command up to 1/hz (100 ms) late: keep half of
        #: a short timeout as margin (a 0.4 s socket timeout blocks 0.2 s).
        self._block_cap = max(0.05, timeout - min(1.0, timeout / 2)) if timeout else 30.0
        self._scripts = Scripts(self.client)
        #: Per-thread clients holding one connection of the client's pool
        #: (see _conn), and every one made, for close().
        self._conn_local = threading.local()
        self._conns: weakref.WeakSet[redis.Redis] = weakref.WeakSet()
        self._hold_ok = hold_connection and _can_hold(self.client)
        self._requests: dict[tuple[str | None, str | None], _Request] = {}
        #: The prefix as the scripts receive it.
        self._wire_prefix = self.keys.prefix.encode()
        self.wait_replicas, self.wait_timeout, self.wait_policy = self._wait_options(
            wait_replicas, wait_timeout, wait_policy
        )
        self._identity = IdentitySource(on_fork=self._after_fork_in_child)
        self._state_lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._orphans: dict[str, _Request] = {}
        self._orphan_retry: dict[str, _OrphanRetry] = {}
        #: Failed retries of deferred releases (see ``_retry_orphans``).
        self.release_retry_failures = 0
        self._local = threading.local()
        #: What ``@locked`` and ``UniqueTask`` tell this thread's acquires
        #: (:mod:`.context`): holder record, haltable wait, request id.
        self.context = ContextStack()
        self._hb_client: AnyRedis | None = None
        self._hb_client_pid = 0
        self._metrics = metrics
        self._heartbeat = Heartbeat(
            self.heartbeat_interval, self._beat, "redislock-heartbeat", self._heartbeat_failed
        )
        self._heartbeat_setting = bool(heartbeat)
        self._group_setting = group
        #: The process in which ``heartbeat=False`` and ``group`` apply (see
        #: :meth:`_become_member`); every other process is standalone.
        self._member_pid = os.getpid()
        self._watch_pid = 0
        self._watch_running = False
        #: Passes the lost-owner watcher made (idle ones included).
        self._watch_passes = 0
        #: Tokens of this process's requests blocked in a wait right now.
        self._waiting: set[str] = set()
        #: A process whose owners something else watches (the Celery worker's
        #: main process: its node heartbeat marks that owner's leases lost):
        #: no lost-owner watcher thread there. Pool children still get one.
        self._lost_watch_exempt_pid = 0
        self._closed = False
        #: Worker mode: ``{ns}:halt:<inc>``, the list the worker's main
        #: process pushes to when it begins shutting down. Waiters block on
        #: it next to their wake list (same BLPOP) and give up with
        #: ShuttingDown. ``_halted``: this process has seen it. Only acquires
        #: made in a ``haltable`` context (``@locked``'s wait) are halted.
        self._halt_key: str | None = None
        self._halted = False
        self._eviction_mode = eviction_check
        #: The eviction check is still due (it runs before the first script).
        self._eviction_pending = eviction_check != "ignore"
        #: Set in "raise" mode when Redis may evict: every call is refused.
        self._eviction_refusal: str | None = None
        #: The eviction check found that Redis may evict keys ("warn" mode):
        #: the heartbeat then also verifies that Redis still records each
        #: held grant (a lock hash may be evicted while the liveness stays).
        self._may_evict = False
        #: Owners of this process retired because their local deadline passed
        #: while their liveness key may still exist: the heartbeat (or the
        #: lost-owner watcher, or the node heartbeat) force-cleans them.
        self._doomed: set[str] = set()
        # Owners whose registry spilled into buckets (REGISTRY_SPILL_AT):
        # their releases remove a name from its bucket too.
        self._spill_at = REGISTRY_SPILL_AT
        self._spilled_owners: set[str] = set()
        #: Seconds the local liveness deadline keeps from owner_ttl.
        self.liveness_margin = min(LIVENESS_MARGIN_MAX, self.owner_ttl * LIVENESS_MARGIN_FRACTION)
        #: The data-format check is due: the first script call runs
        #: format.lua first (once; again after Redis lost this owner's data,
        #: which may have taken ``{ns}:format`` with it). See check_format().
        self._format_pending = True
        self._format_lock = threading.Lock()

    # -- identity ---------------------------------------------------------

    @property
    def _own_heartbeat(self) -> bool:
        """Whether this process refreshes its owner's liveness itself.

        True when built with ``heartbeat=True``, and in any process other
        than the member process (a helper forked from a worker process).
        """
        return self._heartbeat_setting or self._member_pid != os.getpid()

    @property
    def _group(self) -> Callable[[], str | None] | None:
        """The group callable in the member process; None anywhere else."""
        return self._group_setting if self._member_pid == os.getpid() else None

    def _become_member(self) -> None:
        """Make this process the member: ``heartbeat=False`` and ``group`` apply.

        Called by the Celery integration in a pool child, from
        ``worker_process_init`` (only real pool children send it), before
        the child acquires anything. No I/O; idempotent. The parent stays
        the member of its own copy.
        """
        self._member_pid = os.getpid()

    @property
    def owner_id(self) -> str:
        """This process's owner id; a forked child gets a different one."""
        return self._identity.current().owner_id

    @property
    def heartbeat(self) -> Heartbeat:
        """The background heartbeat of this process (``ticks`` counts beats)."""
        return self._heartbeat

    # -- for the worker integration (package-internal, not public API) -----

    @property
    def metrics(self) -> MetricsHook | None:
        """The metrics hook told of this manager's events (None: none).

        Set by the worker integration once its hook exists; events from then
        on are reported to it."""
        return self._metrics

    @metrics.setter
    def metrics(self, hook: MetricsHook | None) -> None:
        self._metrics = hook

    def become_member(self) -> None:
        """Make this process the member process (see :meth:`_become_member`)."""
        self._become_member()

    def set_halt_key(self, key: str | None) -> None:
        """The worker's halt list (``{ns}:halt:<incarnation>``): haltable
        waits of this process give way once something is pushed to it."""
        self._halt_key = key

    def exempt_from_lost_watch(self) -> None:
        """This process's owners are watched by someone else (the worker's
        node heartbeat): no lost-owner watcher thread here."""
        self._lost_watch_exempt_pid = os.getpid()

    @property
    def upkeep_due(self) -> bool:
        """Whether deferred releases wait for a retry that no heartbeat of
        this process will make (no own heartbeat: a pool child)."""
        return bool(self._orphans) and not self._own_heartbeat

    def upkeep(self) -> None:
        """One heartbeat pass in the calling thread: refresh the liveness,
        put retired owners to death, retry deferred releases."""
        self._beat()

    def hold_in_thread(self, leases: Iterable[Lease]) -> None:
        """Count adopted ``leases`` as held by the calling thread (see
        :meth:`_hold_in_thread`)."""
        self._hold_in_thread(leases)

    def request(
        self, exclusive: str | Iterable[str] | None, shared: str | Iterable[str] | None
    ) -> _Request:
        """The validated request for these resources (no I/O; cached)."""
        return self._request(exclusive, shared)

    def _after_fork_in_child(self) -> None:
        reset_locks_after_fork(self.client)
        self._state_lock = threading.Lock()
        self._format_lock = threading.Lock()
        for lease in self._leases.values():
            lease._lost = True  # the parent's, not ours: never released from here
        self._leases = {}
        self._orphans = {}
        self._orphan_retry = {}
        self._halted = False
        self._local = threading.local()
        self.context.reset()
        self._hb_client = None
        # The parent's held connections are not ours: new ones on first use.
        self._conn_local = threading.local()
        self._conns = weakref.WeakSet()
        self._heartbeat.after_fork_in_child()
        self._watch_pid = 0
        self._watch_running = False
        self._watch_passes = 0
        self._waiting = set()
        self._doomed = set()
        self._spilled_owners = set()

    def _depth(self) -> _Depth:
        depth = getattr(self._local, "depth", None)
        if depth is None:
            depth = self._local.depth = _Depth()
        return depth

    # -- requests ---------------------------------------------------------

    def _request(
        self, exclusive: str | Iterable[str] | None, shared: str | Iterable[str] | None
    ) -> _Request:
        # The usual request names its resources as str, None, or a list or
        # tuple of str: validated once and kept (a bounded cache, keyed by
        # a tuple copy of a list; a _Request is immutable).
        key = (_cache_key(exclusive), _cache_key(shared))
        if key[0] is _UNCACHED or key[1] is _UNCACHED:
            return self._validated_request(exclusive, shared)
        cached = self._requests.get(key)
        if cached is not None:
            return cached
        req = self._validated_request(exclusive, shared)
        if len(self._requests) >= _REQUEST_CACHE:
            self._requests.clear()
        self._requests[key] = req
        return req

    def _validated_request(
        self, exclusive: str | Iterable[str] | None, shared: str | Iterable[str] | None
    ) -> _Request:
        ex = _names(exclusive, "exclusive")
        sh = _names(shared, "shared")
        if not ex and not sh:
            raise InvalidResource("a lock request needs at least one resource")
        both = set(ex) & set(sh)
        if both:
            raise InvalidResource(
                f"resources requested both exclusive and shared: {sorted(both)}", sorted(both)
            )
        if len(ex) + len(sh) > MAX_RESOURCES:
            raise InvalidResource(f"a request may name at most {MAX_RESOURCES} resources")
        names = ex + sh
        modes = "x" * len(ex) + "s" * len(sh)
        lock_keys = tuple(self.keys.lock(r) for r in names)
        return _Request(
            exclusive=ex,
            shared=sh,
            modes=modes,
            lock_keys=lock_keys,
            queue_keys=tuple(self.keys.queue(r) for r in names),
            wire_modes=modes.encode(),
            wire_locks=tuple(k.encode() for k in lock_keys),
        )

    def _conn(self) -> AnyRedis:
        """This thread's client for the manager's own commands.

        A plain ``redis.Redis`` gets, per thread (per greenlet under gevent)
        and per process, a client on the same pool that holds one connection
        (``single_connection_client``): each command then skips the pool's
        checkout and check-in (its locks and bookkeeping), keeping only its
        ``poll`` of the socket (unread data or a connection the server
        closed: reconnect first). The
        connection goes back to the pool when its thread ends or the
        manager is closed. A Redis Cluster client, a ``BlockingConnectionPool``
        (whose size a held connection would eat into), a Sentinel pool (whose
        checkout follows a failover to the new master) and a client that is
        already single-connection are used as they are; so is the plain
        client when the connection cannot be made (the command then fails
        the usual way).
        """
        client = self.client
        if not self._hold_ok or not isinstance(client, redis.Redis):
            return client
        local = self._conn_local
        held: redis.Redis | None = getattr(local, "client", None)
        if held is not None and local.pid == os.getpid():
            conn = held.connection
            if conn is not None:
                if local.busy:
                    # The last command sent on it was cut short (an exception,
                    # SoftTimeLimitExceeded, a greenlet killed): its reply may
                    # still arrive and must never be read as another's.
                    conn.disconnect()
                else:
                    # The pool's checkout check: unread data, or a socket the
                    # server closed (a restart) -> a new connection, so the
                    # command is not sent into a dead socket.
                    if _stale(conn):
                        conn.disconnect()
            local.busy = True
            return held
        try:
            held = redis.Redis(
                connection_pool=client.connection_pool, single_connection_client=True
            )
        except Exception:  # unreachable: not cached, the next call tries again
            return self.client
        local.client, local.pid, local.busy = held, os.getpid(), True
        self._conns.add(held)
        return held

    def _direct(self, c: AnyRedis) -> Any:
        """The connection of ``c``, a client from :meth:`_conn`, if commands
        may be sent straight on it (:mod:`.wire`): a held client whose
        connection class is redis-py's own or keeps its way of encoding and
        sending commands (:func:`.wire.direct`). None: send through ``c`` as
        usual."""
        if c is self.client:
            return None
        conn = getattr(c, "connection", None)
        return conn if conn is not None and wire.direct(conn.__class__) else None

    def _conn_done(self) -> None:
        """The command sent on this thread's :meth:`_conn` client completed."""
        self._conn_local.busy = False

    def _call(
        self,
        name: str,
        keys: list[str],
        args: list[Any],
        client: Any = None,
        *,
        wait: int = 0,
        again: list[Any] | None = None,
    ) -> Any:
        """Run a script (one round trip); ``wait=N``: also ``WAIT N`` in the same pipeline.

        With ``wait`` the answer is ``(script reply, replicas that acknowledged)``.
        ``again``: arguments for any send that may be a resend. ``args`` then
        go only as the first send on the held connection (:mod:`.wire`, which
        resends ``again``); every other path, whose retries resend what they
        were given, sends ``again``.
        """
        resend = args if again is None else again
        if self._eviction_pending or self._eviction_refusal is not None:
            self._check_eviction_once()  # first: a refusal must write nothing
        if self._format_pending:
            self._check_format_once(client)
        try:
            if wait:
                return self._scripts.run_and_wait(name, keys, resend, wait, self._wait_ms)
            if client is not None:
                return self._scripts.run(name, keys, resend, client=client)
            c = self._conn()
            conn = self._direct(c)
            if conn is not None:
                reply = self._scripts.run_direct(conn, c, name, keys, args, again)
            else:
                reply = self._scripts.run(name, keys, resend, client=c)
            self._conn_done()
            return reply
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            sent = f"EVALSHA {name}" + (" + WAIT" if wait else "")
            denied = permission_denied(exc, self.url, sent)
            if denied is None:
                raise
            raise denied from exc

    def _command(self, name: str, *args: Any) -> Any:
        """Send one plain command with ``_call``'s error mapping.

        Redis down -> :class:`RedisUnavailable`; refused by the ACL ->
        :class:`PermissionDenied` naming the command.
        """
        try:
            reply = self._conn().execute_command(name, *args)
            self._conn_done()
            return reply
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            denied = permission_denied(exc, self.url, name)
            if denied is None:
                raise
            raise denied from exc

    # -- acquire ----------------------------------------------------------

    def acquire(
        self,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        timeout: float | None = None,
        nested: bool | None = None,
    ) -> Lease:
        """Acquire every resource at once, waiting first come, first served.

        Args:
            exclusive: resource names to hold alone (writer).
            shared: resource names to hold alongside other shared holders.
            timeout: seconds to wait; ``0`` tries once without queueing;
                ``None`` waits for ever.
            nested: whether this request is made from inside a lock held by
                the same thread or greenlet. Nested requests wait only for
                holders, never behind queued requests (otherwise two tasks
                would deadlock), and need a finite timeout. ``None``: detect.
                ``False`` also turns reentrancy off: the request is a grant
                of its own that queues like any other (a thread holding a
                resource exclusively would then wait for itself).

        Reentrancy: resources this thread or greenlet already holds (through
        a lease not yet released) are granted again at once, without a round
        trip, and counted like ``threading.RLock``: the lease returned
        counts on the outer one, whose fencing token it carries, and the
        locks are released in Redis when the last of them is released. An
        exclusive hold covers a shared request. A request holding only some
        of its resources takes the others as a nested acquire (finite
        timeout) and counts on the outer lease for the rest. Other threads
        of the process are not reentrant: they queue like everyone else.

        Raises:
            LockTimeout: not granted in time; nothing is left behind.
            InvalidResource: bad names or request shape (before any I/O).
            ConfigurationError: (a ValueError) a timeout that is not None or a
                number >= 0, or a ``nested`` that is not None/True/False.
            ValueError: a nested request without a finite timeout.
            LockUpgradeError: (a ValueError) an exclusive request for a
                resource this thread or greenlet holds only shared.
            RedisUnavailable: Redis could not be reached for longer than the
                outage bound: ``timeout``, and at most ``owner_ttl`` after
                the first failure (``timeout=0``: at once). Shorter
                outages (a stalled server, a dropped or refused connection)
                are ridden out by re-running the idempotent acquire.
            PermissionDenied: the Redis user's ACL refused a command or key.

        Whatever ends the call (a timeout, KeyboardInterrupt, a soft time
        limit, a gevent kill), the request's grant or queue entries are
        released by its own token before the exception leaves this method.
        """
        req = self._request(exclusive, shared)
        if self._closed:
            raise LockError(f"this LockManager ({self.url}) is closed: make a new one")
        timeout = _v.seconds("timeout", timeout, allow_none=True, allow_inf=True)
        if timeout is not None and math.isinf(timeout):
            timeout = None
        nested = _v.optional_flag("nested", nested)
        depth = self._depth()
        if depth.leases and nested is not False:
            reentry = self._reentry(depth, req)
            if reentry is not None:
                return self._reenter(depth, req, reentry, timeout, nested)
        if nested is None:
            nested = depth.count > 0
        if nested and timeout is None:
            raise ValueError(
                "a nested acquire (made while this thread holds a lock) needs a finite "
                "timeout: it skips the wait queue and could otherwise wait for ever"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        # Only a task's own lock wait (@locked, before its body) gives way to a
        # worker shutdown; a body's later or nested acquire is never cut short.
        ctx = self.context.current()
        haltable = not nested and ctx.haltable
        block_call = functools.partial(self._block, halt=True) if haltable else self._block
        # A @locked task's own wait may turn into a park in its place when a
        # grant in transit waits ahead of it (docs/defer.md, T3): the hook
        # takes the queued request over and returns True, or returns False
        # (the request is left as it was: keep waiting).
        take_over: Callable[[str, _Request], bool] | None = None if nested else ctx.take_over
        told_transit = False  # woken by defer_nudge.lua since the last script run
        # A task's own request id (``task:<id>``, set by UniqueTask around
        # the call) makes the grant name its task, like acquire_for_task's.
        request_id = ctx.request_id
        # A request id made here gives a token never sent before: its first
        # script run may skip the look for an earlier grant or queue entry
        # (acquire.lua flag 'f'; a resend never carries it).
        first = request_id is None
        request_id = request_id or new_request_id()
        # Who holds it, only when a Celery task acquires (@locked sets it).
        holder = ctx.holder or ""
        began = time.monotonic()
        ident = self._identity.current()
        if self._own_heartbeat:
            self._heartbeat.ensure_started()
        else:
            self._ensure_lost_watch()
        token = f"{ident.owner_id}|{request_id}"
        outage = _Outage(deadline, self.owner_ttl)
        # Whether Redis ever answered this request's script: until it has, the
        # request is at most possibly there (a script sent as the connection
        # broke), and its clean-up after a failure is not worth a warning.
        answered = False
        try:
            reply: Any = None
            while True:
                if self._closed:
                    raise LockError(f"this LockManager ({self.url}) was closed")
                if reply is None:
                    started = time.monotonic()
                    reply = self._riding_out(
                        outage,
                        token,
                        self._attempt,
                        ident,
                        token,
                        req,
                        timeout != 0,
                        nested,
                        holder,
                        first,
                    )
                    first = False
                    if reply is None:  # Redis failed; backed off: run the attempt again
                        continue
                    answered = True
                    # Past step 1 the script refreshed our liveness: a confirmed
                    # refresh, unless our local deadline had already passed.
                    if int(reply[0]) != -1 and not self._confirm(ident, started, self.owner_ttl):
                        self._owner_lost(ident, "deadline")
                code = int(reply[0])
                if code == 1:
                    ident.registered = True
                    if self.wait_replicas:
                        acked = self._replicas_acked(outage, token, reply)
                        if acked is None:  # Redis failed; backed off: run the attempt again
                            reply = None
                            continue
                        if acked < self.wait_replicas:
                            request_id = self._replication_short(
                                ident, token, req, acked, deadline, timeout
                            )
                            token = f"{ident.owner_id}|{request_id}"
                            reply = None
                            # Never granted, never blocked: look at the halt list
                            # here, or a warm shutdown would wait for the replicas.
                            if haltable and (
                                self._halted
                                or self._riding_out(outage, token, block_call, token, 0.001) == -1
                            ):
                                raise ShuttingDown(req.resources)
                            continue
                    lease = Lease(self, req, ident, token, int(reply[1]), depth)
                    # Granted by the script call that replied (not a hand-off,
                    # not a retry finding an earlier grant): its release has no
                    # request keys to delete (a holder record is a registry value).
                    lease._clean = len(reply) > 2 and not self.wait_replicas
                    # Kept only while its identity is current (checked under the
                    # lock that _owner_lost takes to mark leases lost): a grant
                    # made to a retired identity, e.g. handed off just as a
                    # cleanup declared the owner dead, is never returned.
                    with self._state_lock:
                        current = self._identity.peek() is ident and not self._closed
                        if current:
                            # Counted last: an interrupt before this must not leave
                            # the thread looking nested (it would skip the queue).
                            self._leases[token] = lease
                            depth.leases.append(lease)
                            depth.count += 1
                    if current:
                        if self._metrics is not None:
                            self._metrics.acquired(time.monotonic() - began, "granted")
                        if log_acquire.isEnabledFor(logging.DEBUG):
                            log_acquire.debug(
                                "acquire.granted owner=%s resources=%s fence=%s",
                                ident.owner_id,
                                ",".join(req.resources),
                                lease.fencing_token,
                            )
                        return lease
                    retired = True
                else:
                    retired = code == 0 and self._identity.peek() is not ident
                if retired:
                    # Granted or queued under an identity that was retired
                    # meanwhile (or the manager was closed): end that request
                    # and ask again as the current identity.
                    self._end_request(ident.owner_id, token, req)
                    if self._closed:
                        raise LockError(f"this LockManager ({self.url}) was closed")
                    ident = self._identity.current()
                    token = f"{ident.owner_id}|{request_id}"
                    reply = None
                    log_acquire.warning(
                        "acquire.re-request resources=%s owner=%s: granted or queued under "
                        "an identity declared dead meanwhile; released and asked again",
                        ",".join(req.resources),
                        ident.owner_id,
                    )
                    continue
                if code == -1:
                    self._owner_lost(ident, "acquire")
                    ident = self._identity.current()
                    token = f"{ident.owner_id}|{request_id}"
                    reply = None
                    continue
                ident.registered = True
                if timeout == 0:
                    raise LockTimeout(req.resources, timeout)
                remaining = math.inf if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise LockTimeout(req.resources, timeout)
                if haltable and self._halted:
                    raise ShuttingDown(req.resources)
                transit = _text(reply[4]) if len(reply) > 4 else ""
                if take_over is not None and (transit or told_transit):
                    # Blocked behind a grant in transit: give the slot up.
                    if take_over(token, req):
                        raise RequestMoved(req.resources, transit)
                    take_over = None  # not taken over: wait as before
                told_transit = False
                wait_ms = int(reply[1])
                block = min(remaining, self._block_cap, self.owner_ttl)
                if wait_ms >= 0:
                    block = min(block, wait_ms / 1000.0 + 0.01)
                # Re-run the script (a liveness refresh) while a third of
                # owner_ttl is still left before the local deadline: a lease
                # handed off during the wait is not born close to its deadline
                # (a pool child's watcher confirms within owner_ttl / 4).
                block = min(block, ident.valid_until - time.monotonic() - self.owner_ttl / 3)
                # A release that finds us at the head hands us the locks and
                # pushes 'g<fence>': granted without another round trip.
                # Anything else (a plain wake, a timeout) re-runs the script,
                # which re-checks the state in Redis.
                self._waiting.add(token)  # the lost-owner watcher watches while we wait
                try:
                    fence = self._riding_out(outage, token, block_call, token, max(block, 0.001))
                finally:
                    self._waiting.discard(token)
                if fence == -1:
                    raise ShuttingDown(req.resources)
                told_transit = fence == _TRANSIT_WAKE
                reply = None if fence is None or told_transit else (1, fence)
        except RequestMoved:
            raise  # the request is a task owner's now: nothing of this token is left
        except BaseException as exc:
            with self._state_lock:
                gone = self._leases.pop(token, None)
                if gone is not None:  # interrupted at the return
                    depth.count = max(0, depth.count - 1)
                    if gone in depth.leases:
                        depth.leases.remove(gone)
            self._end_request(ident.owner_id, token, req, quiet=not answered)
            if self._metrics is not None and isinstance(exc, Exception):
                outcome = "timeout" if isinstance(exc, LockTimeout) else "error"
                # A deferred task's first try (``parking``): busy is not a
                # timeout; the park that follows tells its outcome.
                if outcome != "timeout" or not ctx.parking:
                    self._metrics.acquired(time.monotonic() - began, outcome)
            if self._closed and isinstance(exc, Exception) and not isinstance(exc, LockError):
                # close() shut the connection under a waiting thread
                raise LockError(f"this LockManager ({self.url}) was closed") from exc
            raise

    def _reentry(
        self, depth: _Depth, req: _Request
    ) -> tuple[tuple[Lease, ...], tuple[str, ...], tuple[str, ...]] | None:
        """Which of ``req``'s resources this thread/greenlet already holds.

        Returns None when it holds none of them, else (the outer leases that
        hold some, the exclusive and the shared resources still to acquire).
        No I/O. Raises LockUpgradeError for an exclusive request of a
        resource held only shared. A lost outer lease is not re-entered.
        """
        pid = os.getpid()
        with self._state_lock:
            leases = [x for x in depth.leases if not x._released and x.pid == pid]
        # A lost lease holds nothing any more (its identity is retired): the
        # request is a fresh one for those resources, not a reentry.
        leases = [x for x in leases if not x.lost]
        held: dict[str, tuple[Lease, str]] = {}
        for lease in leases:
            for name in lease._request.exclusive:
                held[name] = (lease, "x")
            for name in lease._request.shared:
                held.setdefault(name, (lease, "s"))
        upgrade = [n for n in req.exclusive if n in held and held[n][1] == "s"]
        if upgrade:
            raise LockUpgradeError(upgrade)
        parents = tuple(dict.fromkeys(held[n][0] for n in req.resources if n in held))
        if not parents:
            return None
        rest_ex = tuple(n for n in req.exclusive if n not in held)
        rest_sh = tuple(n for n in req.shared if n not in held)
        return parents, rest_ex, rest_sh

    def _reenter(
        self,
        depth: _Depth,
        req: _Request,
        reentry: tuple[tuple[Lease, ...], tuple[str, ...], tuple[str, ...]],
        timeout: float | None,
        nested: bool | None,
    ) -> Lease:
        """A nested acquire re-entering outer leases (see :meth:`acquire`)."""
        parents, rest_ex, rest_sh = reentry
        if rest_ex or rest_sh:
            # The resources not held yet: a nested acquire of their own
            # (waits only for holders; a finite timeout is required).
            lease = self.acquire(rest_ex, rest_sh, timeout=timeout, nested=nested)
            try:
                with self._state_lock:
                    for p in parents:
                        p._holds += 1
                    lease._parents = parents
                lease.exclusive = req.exclusive
                lease.shared = req.shared
            except BaseException:
                lease.release()
                raise
            return lease
        first = parents[0]
        lease = Lease(
            self,
            req,
            first._ident,
            first.token,
            max(p.fencing_token for p in parents),
            depth,
            own=False,
        )
        lease._released = True  # no grant of its own
        with self._state_lock:
            for p in parents:
                p._holds += 1
            lease._parents = parents
            depth.count += 1
        if log_acquire.isEnabledFor(logging.DEBUG):
            log_acquire.debug(
                "acquire.reentrant owner=%s resources=%s fence=%s",
                lease.owner_id,
                ",".join(req.resources),
                lease.fencing_token,
            )
        return lease

    def _riding_out(self, outage: _Outage, token: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, or None after a Redis failure the waiter rides out.

        Within the outage bound (see :class:`_Outage`) a failure is logged
        once, slept off with backoff and answered with None: the caller
        re-runs its acquire script, which is idempotent on the token (a grant
        handed over meanwhile is found in the lock hash, a queue entry is
        kept). Past the bound the RedisUnavailable propagates.
        """
        try:
            value = call(*args)
        except RedisUnavailable as exc:
            pause = outage.failed()
            if pause is None:
                raise
            if outage.failures == 1:
                log_acquire.warning(
                    "acquire.redis-retry token=%s error=%s: re-running the acquire for up to %.3gs",
                    token,
                    exc,
                    outage.left(),
                )
            time.sleep(pause)
            return None
        if outage.failures:
            log_acquire.info("acquire.redis-resumed token=%s failures=%d", token, outage.failures)
            outage.failures = 0
        return value

    def _acquire_call(
        self,
        token: str,
        req: _Request,
        *,
        queue: bool,
        nested: bool = False,
        liveness_ms: str | bytes,
        register: str = "",
        req_ttl: str | bytes | None = None,
        group: str | None = None,
        tag: str = "",
        holder: str = "",
        listed: bool = False,
        spill: bool = False,
        first: bool = False,
    ) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV of one acquire.lua call (see its header for each slot).

        ``register``: the liveness key's value when the call registers the
        owner ('' when it is registered); ``group``: the group hash the owner
        registers in (with its process ``tag``); ``holder``: who holds it
        (task name, task id and node), sent as the holder record that names
        this token's request id (:func:`~.keys.holder_record`); ``listed``:
        the owner is in ``{ns}:owners`` already; ``spill``: the owner holds
        many locks (its registry's buckets); ``first``: the token was never
        sent before (the caller must resend without it). Only the lock keys
        travel as KEYS (the script builds the rest from the
        prefix), and the arguments are bytes where they repeat: each
        argument costs the client an encoding on every call.
        """
        keys: list[Any] = list(req.wire_locks)
        if group is not None:
            keys.append(group)
        flags = (
            ("q" if queue else "")
            + ("n" if nested else "")
            + ("l" if listed else "")
            + ("s" if spill else "")
            + ("f" if first else "")
        )
        args: list[Any] = [
            token,
            req.wire_modes,
            flags,
            liveness_ms,
            self._wire_prefix,
            self._req_ttl_arg if req_ttl is None else req_ttl,
            self._limit_arg,
        ]
        if register or group is not None or holder:
            args += [register, tag, holder_record(token, holder) if holder else ""]
        return keys, args

    def _spill(self, owner_id: str) -> bool:
        """Whether the owner holds REGISTRY_SPILL_AT leases: its resource
        names then go to its registry's buckets (acquire.lua flag 's')."""
        if len(self._leases) < self._spill_at:
            return False
        # Recorded before the script runs: a release from now on may meet
        # a name in a bucket.
        self._spilled_owners.add(owner_id)
        return True

    def _attempt(
        self,
        ident: OwnerIdentity,
        token: str,
        req: _Request,
        queue: bool,
        nested: bool,
        holder: str | None = None,
        first: bool = False,
    ) -> Any:
        """One run of acquire.lua for ``token``; ``holder``: the holder record
        (None: read from the thread's ``@locked`` state); ``first``: the token
        was never sent (flag 'f', on the first send only)."""
        # WAIT goes in a pipeline that redis-py may resend as it is: never 'f'.
        first = first and not self.wait_replicas
        group = None
        if not ident.registered:
            make_group = self._group
            group = make_group() if make_group is not None else None
        if holder is None:
            holder = self.context.current().holder or ""
        keys, args = self._acquire_call(
            token,
            req,
            queue=queue,
            nested=nested,
            liveness_ms=self._ttl_arg,  # every attempt refreshes the liveness (step 1)
            # Registering (non-empty) or not; not built on every attempt.
            register="" if ident.registered else ident.describe(self.name),
            group=group,
            tag=ident.tag if group is not None else "",
            # Who holds it, only when a Celery task acquires (@locked sets it).
            holder=holder,
            listed=ident.listed,
            spill=self._spill(ident.owner_id),
            first=first,
        )
        if self.wait_replicas:
            reply = self._call_and_wait("acquire", keys, args)
        else:
            again = None
            if first:
                # Any resend (a retry after the reply was lost) must look.
                again = list(args)
                again[2] = args[2].replace("f", "")
            reply = self._call("acquire", keys, args, again=again)
            if self._metrics is not None:
                self._note_reclaimed(reply)
        code = int(reply[0])
        if code == 1 or (code == 0 and queue):
            ident.listed = True  # the script added it to {ns}:owners
        return reply

    def _note_reclaimed(self, reply: Any) -> None:
        """Count the dead holders' grants an acquire reply says it freed."""
        code = int(reply[0])
        at = 2 if code == 1 else 3 if code == 0 else None
        if self._metrics is not None and at is not None and len(reply) > at and int(reply[at]):
            self._metrics.cleaned("reclaim", int(reply[at]))

    def _note_acquired(self, seconds: float, outcome: str) -> None:
        """An acquire made outside :meth:`acquire` ended (metrics only): a
        deferred task's adopted grant, or its park running out of time."""
        if self._metrics is not None:
            self._metrics.acquired(max(0.0, seconds), outcome)

    def _note_parked(self) -> None:
        """A deferred task was parked (metrics only; a hook without
        ``parked``, written for an earlier release, is skipped)."""
        parked = getattr(self._metrics, "parked", None)
        if parked is not None:
            parked()

    def _heartbeat_failed(self) -> None:
        """A heartbeat of this process failed (metrics only)."""
        if self._metrics is not None:
            self._metrics.heartbeat_failed()

    # -- replica acknowledgement (wait_replicas) --------------------------

    def _wait_options(self, replicas: Any, timeout: Any, policy: Any) -> tuple[int, float, str]:
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ConfigurationError(
                "wait_replicas", f"must be a non-negative int (0: off), not {replicas!r}"
            )
        if not 0 <= replicas <= MAX_WAIT_REPLICAS:
            raise ConfigurationError(
                "wait_replicas", f"must be within 0..{MAX_WAIT_REPLICAS} (0: off), not {replicas}"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigurationError(
                "wait_timeout", f"must be a number of seconds, not {timeout!r}"
            )
        # Below the socket timeout only when WAIT is sent (the default 1 s
        # must not refuse a client with a shorter socket timeout).
        cap = min(MAX_WAIT_TIMEOUT, self._block_cap) if replicas else MAX_WAIT_TIMEOUT
        if not MIN_WAIT_TIMEOUT <= timeout <= cap:  # also refuses nan and inf
            raise ConfigurationError(
                "wait_timeout",
                f"must be within {MIN_WAIT_TIMEOUT}..{cap:.3g} s (at most {MAX_WAIT_TIMEOUT} s "
                f"and below the client's socket timeout), not {timeout}",
            )
        if policy not in WAIT_POLICIES:
            raise ConfigurationError(
                "wait_policy", f"must be one of {', '.join(WAIT_POLICIES)}, not {policy!r}"
            )
        if replicas and isinstance(self.client, RedisCluster):
            raise ConfigurationError(
                "wait_replicas",
                "is not supported on Redis Cluster (WAIT has no key to route it to the "
                "namespace's master); use 0",
            )
        return replicas, float(timeout), policy

    @functools.cached_property
    def _wait_ms(self) -> int:
        return max(1, round(self.wait_timeout * 1000))

    def _call_and_wait(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script and ``WAIT`` in one round trip; a grant's reply gains the count.

        ``{1, fence, ...}`` becomes ``[1, fence, replicas that acknowledged]``;
        any other reply is returned as it is.
        """
        reply, acked = self._call(name, keys, args, wait=self.wait_replicas)
        if self._metrics is not None and name == "acquire":
            self._note_reclaimed(reply)
        if int(reply[0]) == 1:
            return [reply[0], reply[1], acked]
        return reply

    def _wait_now(self) -> int:
        """``WAIT`` for a grant made by another client (a hand-off); one round trip.

        ``WAIT`` counts the replicas that have every write made before the
        *connection's* last command; the grant was written before the push
        this waiter popped, but a pooled connection (or one whose BLPOP was
        served while blocked, Redis 6.2) may have an older offset: the PING
        sent first in the same pipeline moves it to now.
        """
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.ping()
            pipe.execute_command("WAIT", self.wait_replicas, self._wait_ms)
            return int(pipe.execute()[1])
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc

    def _replicas_acked(self, outage: _Outage, token: str, reply: Any) -> int | None:
        """How many replicas acknowledged a grant; None after a ridden-out failure."""
        if len(reply) > 2:  # counted in the script's round trip
            return int(reply[2])
        acked: int | None = self._riding_out(outage, token, self._wait_now)
        return acked

    def _replication_short(
        self,
        ident: OwnerIdentity,
        token: str,
        req: _Request,
        acked: int,
        deadline: float | None,
        timeout: float | None,
    ) -> str:
        """Too few replicas acknowledged the grant of ``token``: release it.

        ``wait_policy="fail"`` (or no time left) raises ReplicationTimeout
        (the acquire's exit path releases the grant); ``"retry"`` releases it
        here and returns a new request id to ask again with.
        """
        retry = self.wait_policy == "retry" and (
            deadline is None or deadline - time.monotonic() > 0
        )
        log_acquire.warning(
            "acquire.replication-short token=%s resources=%s wanted=%d acknowledged=%d "
            "wait_timeout=%.3gs policy=%s: grant released%s",
            token,
            ",".join(req.resources),
            self.wait_replicas,
            acked,
            self.wait_timeout,
            self.wait_policy,
            "; asking again" if retry else "",
        )
        if not retry:
            raise ReplicationTimeout(
                req.resources, timeout, self.wait_replicas, acked, self.wait_timeout
            )
        self._end_request(ident.owner_id, token, req)
        return new_request_id()

    @property
    def _req_ttl_ms(self) -> int:
        return int(self.owner_ttl * 3000)

    @functools.cached_property
    def _req_ttl_arg(self) -> bytes:
        return str(self._req_ttl_ms).encode()

    @functools.cached_property
    def _ttl_arg(self) -> bytes:
        return str(int(self.owner_ttl * 1000)).encode()

    @functools.cached_property
    def _limit_arg(self) -> bytes:
        return str(self.queue_scan_limit).encode()

    def _block(self, token: str, seconds: float, halt: bool = False) -> int | None:
        """Wait for a push to the request's wake list; the fence of a hand-off.

        With ``halt`` (``@locked``'s wait in a worker), the same BLPOP also
        watches the worker's halt list: popped, its entry is pushed back for
        the next waiter and -1 is returned (shutting down). A ``t`` (a grant
        in transit waits ahead, ``defer_nudge.lua``) returns ``_TRANSIT_WAKE``.
        """
        keys = [self.keys.wake(token)]
        halt_key = self._halt_key if halt else None
        if halt_key is not None:
            keys.append(halt_key)
        try:
            c = self._conn()
            conn = self._direct(c)
            if conn is not None:
                got = wire.call(conn, wire.pack(conn, _BLPOP, (*keys, seconds), 1))
            else:
                got = c.blpop(keys, timeout=seconds)
            self._conn_done()
            if got is not None and halt_key is not None and _text(got[0]) == halt_key:
                self._halted = True
                pipe = self.client.pipeline(transaction=False)
                pipe.rpush(halt_key, got[1])
                pipe.pexpire(halt_key, self._req_ttl_ms)
                pipe.execute()
                return -1
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            raise (permission_denied(exc, self.url, "BLPOP") or exc) from exc
        if got is None:
            return None
        msg = _text(got[1])
        if msg == "t":
            return _TRANSIT_WAKE
        return int(msg[1:]) if msg.startswith("g") else None

    @contextmanager
    def lock(
        self,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        timeout: float | None = None,
        nested: bool | None = None,
    ) -> Iterator[Lease]:
        """Context manager form of :meth:`acquire`; releases on exit."""
        lease = self.acquire(exclusive, shared, timeout=timeout, nested=nested)
        try:
            yield lease
        finally:
            lease.release()

    def try_acquire(
        self,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        nested: bool | None = None,
    ) -> Lease | None:
        """Acquire every resource at once if they are free now; else None.

        One attempt, without queueing (``acquire(..., timeout=0)``), that
        answers ``None`` where :meth:`acquire` raises :class:`LockTimeout`:
        the form of redis-py's and python-redis-lock's
        ``acquire(blocking=False)``. Every other error (bad names, Redis out
        of reach) is raised as :meth:`acquire` raises it.
        """
        try:
            return self.acquire(exclusive, shared, timeout=0, nested=nested)
        except LockTimeout:
            return None

    def holders(self, resource: str) -> list[LockHolder]:
        """Who holds ``resource`` now: one :class:`LockHolder` per grant.

        One round trip (the resource's lock hash), no liveness check: a grant
        of an owner that died is listed until somebody reclaims it (the next
        acquirer of the resource does). Exclusive first, then by owner.
        :class:`~celery_redislock.Inspector` adds each owner's liveness and
        the Celery task holding the grant. Raises :class:`InvalidResource`
        for a bad name.
        """
        key = self.keys.lock(validate_resource(resource))
        if self._format_pending:
            self._check_format_once(None)
        raw = self._command("HGETALL", key)
        if not isinstance(raw, dict):
            # RESP2 answers a flat list of field, value, ...
            items = list(raw or ())
            raw = dict(zip(items[0::2], items[1::2]))
        out = [LockHolder.from_grant(resource, _text(t), _text(v)) for t, v in raw.items()]
        return sorted(out, key=lambda h: (h.mode != "exclusive", h.owner_id))

    def is_locked(self, resource: str) -> bool:
        """Whether Redis records any grant on ``resource`` (one round trip).

        Like :meth:`holders`, a grant of an owner that died counts until it
        is reclaimed. A free answer is only a snapshot: use
        :meth:`try_acquire` to take the lock if it is free.
        """
        key = self.keys.lock(validate_resource(resource))
        if self._format_pending:
            self._check_format_once(None)
        return int(self._command("HLEN", key)) > 0

    # -- task owners: locks held by a task id, adopted by its process -----

    def acquire_for_task(
        self,
        task_id: str,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        ttl: float,
        attempt: int = 0,
        holder: str | None = None,
    ) -> TaskGrant:
        """Try once to take the resources on behalf of task ``task_id``.

        The holder is the task owner ``task:<task_id>``, not this process:
        it is registered like any owner, with a liveness key of its own that
        expires after ``ttl`` seconds (the time the task may spend in the
        broker). Nobody refreshes it: the process that runs the task takes
        the locks over with :meth:`adopt`; if no process does within
        ``ttl``, the task owner is dead and its locks are reclaimed like
        those of any dead owner (by the next acquirer of a resource, by
        :meth:`reconcile`, or by :meth:`release_task`).

        ``holder``: what to record about the holding task beside the grant
        (task name, task id and node, one per line; shown by ``redislock
        locks``), or None.

        ``attempt``: the retry number of the task's message (Celery sends a
        retried task again under the same id): each attempt has its own task
        owner (``task+<n>:<task_id>``), since an adopted one is retired.

        Never waits and never queues. One round trip: the acquire script, a
        read of the resources' holders (so a refusal names who blocked it)
        and, for a refused task owner that holds nothing else, the deletion
        of the liveness key the attempt registered go in one pipeline. The holder token is
        ``<task owner>|task:<task_id>``: a repeated
        call for the same task and attempt is the same request, and answers
        with the same grant.

        Returns a :class:`TaskGrant`: ``granted``, the fencing token, and
        when refused the owner id (and task id, for a task owner) of a
        holder that blocked it (``None`` if it left meanwhile).

        With ``wait_replicas``, ``WAIT`` goes last in the same pipeline; a
        grant fewer replicas acknowledged is released (the task owner is
        retired, as by :meth:`release_task`) and :class:`ReplicationTimeout`
        raised, whatever the ``wait_policy`` (this call never waits).

        Raises:
            ValueError: an unusable task id (empty, longer than 512 bytes with
                its prefix, or with ``|`` or control characters).
            InvalidResource, ConfigurationError: bad names or ``ttl``.
            LockError: the task owner was retired already (its locks were
                adopted or cleaned up): a task id holds locks at most once.
            ReplicationTimeout: granted, but fewer than ``wait_replicas``
                replicas acknowledged it (released again).
            RedisUnavailable, PermissionDenied: as for :meth:`acquire`.
        """
        req = self._request(exclusive, shared)
        if self._closed:
            raise LockError(f"this LockManager ({self.url}) is closed: make a new one")
        owner = task_owner_id(task_id, attempt)
        ttl = _v.duration("ttl", ttl, minimum=_v.MIN_OWNER_TTL, maximum=_v.MAX_OWNER_TTL)
        token = task_token(owner, task_id)
        keys, args = self._acquire_call(
            token,
            req,
            queue=False,  # never queue
            liveness_ms=str(int(ttl * 1000)),
            register=f"task={task_id}",  # registering: SET NX, or PEXPIRE when it exists
            holder=holder or "",
        )
        if self._eviction_pending or self._eviction_refusal is not None:
            self._check_eviction_once()  # first: a refusal must write nothing
        if self._format_pending:
            self._check_format_once()
        for _ in range(3):
            try:
                reply, holders, before, acked = self._scripts.run_then_read(
                    "acquire",
                    keys,
                    args,
                    list(req.lock_keys),
                    probe=(req.lock_keys[0], token),
                    # A refused try leaves no liveness key behind for `ttl`.
                    then=(
                        "forget_idle",
                        [self.keys.held(owner), self.keys.waits(owner), self.keys.alive(owner)],
                    ),
                    wait=(self.wait_replicas, self._wait_ms) if self.wait_replicas else None,
                )
            except REDIS_DOWN_ERRORS as exc:
                raise RedisUnavailable(self.url, exc) from exc
            except redis.ResponseError as exc:
                denied = permission_denied(exc, self.url, "EVALSHA acquire + HGETALL")
                if denied is None:
                    raise
                raise denied from exc
            code = int(reply[0])
            if code == 1:
                if acked is not None and acked < self.wait_replicas:
                    self._task_grant_short(task_id, attempt, owner, req, acked)
                return TaskGrant(task_id, True, int(reply[1]), token, None, before is not None)
            if code == -1:
                raise LockError(
                    f"task owner {owner} was retired (its locks were adopted or cleaned up): "
                    "a task id can hold locks only once"
                )
            blocker = None
            for mode, held in zip(req.modes, holders):
                for field, value in held.items():
                    t, v = _text(field), _text(value)
                    if mode == "x" or v.startswith("x"):
                        blocker = t
                        break
                if blocker is not None:
                    break
            if blocker is None:
                continue  # the holder left between the script and the read
            return TaskGrant(task_id, False, None, None, blocker)
        return TaskGrant(task_id, False, None, None, None)

    def _task_grant_short(
        self, task_id: str, attempt: int, owner: str, req: _Request, acked: int
    ) -> None:
        """Too few replicas acknowledged a task owner's grant: free it, raise.

        The call never waits, so both ``wait_policy`` values end here (as an
        acquire with ``timeout=0`` does): the task owner is released and
        retired (:meth:`release_task`), then :class:`ReplicationTimeout`.
        """
        log_acquire.warning(
            "acquire.replication-short token=%s resources=%s wanted=%d acknowledged=%d "
            "wait_timeout=%.3gs policy=%s: grant released",
            task_token(owner, task_id),
            ",".join(req.resources),
            self.wait_replicas,
            acked,
            self.wait_timeout,
            self.wait_policy,
        )
        try:
            self.release_task(task_id, attempt)
        except LockError as exc:  # its liveness (the task's ttl) frees it
            log_acquire.error("acquire.release-error owner=%s error=%r", owner, exc)
        raise ReplicationTimeout(req.resources, 0.0, self.wait_replicas, acked, self.wait_timeout)

    def release_task(self, task_id: str, attempt: int = 0) -> CleanupReport:
        """Free every lock task ``task_id``'s owner holds, and retire it.

        For a task whose message was never sent (the producer failed to
        publish it). The same atomic, O(its locks) cleanup as a dead owner's
        (forced: the task owner's liveness is deleted first); the task owner
        is tombstoned, so a later :meth:`acquire_for_task` of the same id
        raises. A task owner already adopted or gone answers ``"cleaned"``
        with nothing released.
        """
        return self._cleanup(task_owner_id(task_id, attempt), force=True)

    def _hold_in_thread(self, leases: Iterable[Lease]) -> None:
        """Count adopted ``leases`` as held by the calling thread or greenlet:
        its nested acquires of their resources re-enter them (``@locked``
        runs an adopted deferred task's body in this thread)."""
        depth = self._depth()
        with self._state_lock:
            for lease in leases:
                if lease._released or lease in depth.leases:
                    continue
                lease._depth = depth
                depth.leases.append(lease)
                depth.count += 1

    def adopt(
        self,
        task_id: str,
        attempt: int = 0,
        *,
        holder: str | None = None,
        park_record_ttl: float | None = None,
        owner: str | None = None,
    ) -> Adoption:
        """Take over every lock task ``task_id``'s owner holds, in this process.

        Call it in the process that runs the task, before its body. One
        atomic script moves each grant to this process's owner (same mode,
        same fencing token, a new holder token), retires the task owner and
        tombstones it. The grants come back as normal :class:`Lease` objects:
        they live and die with this process's owner (released by
        :meth:`Lease.release`, freed with the process when it dies). They do
        not count as locks the calling thread holds: an ``acquire`` made
        after ``adopt`` is not treated as nested.

        Idempotent: called again by the same process (say, after a reply lost
        to a connection drop), it returns the same grants (those not released
        since). One round trip, O(locks of the task owner).

        Returns an :class:`Adoption`: ``status`` is ``"adopted"`` with
        ``leases`` (possibly empty: the task owner held nothing), or nothing
        was adopted: ``"expired"`` (the task owner's liveness ran out: its
        locks are anyone's to reclaim), ``"tombstoned"`` (it was cleaned up
        or released) or ``"adopted-elsewhere"`` (another owner, ``by``, took
        it), or ``"superseded"`` (below). The caller decides what to do then
        (``UniqueTask`` acquires the resources afresh). ``attempt``: as for
        :meth:`acquire_for_task`. ``holder``: the holder record of the
        adopted grants (task name, task id and node, one per line); None
        keeps the task owner's.

        ``park_record_ttl``: for a deferred task (``on_busy="defer"``,
        docs/defer.md), the seconds its park record is kept once adopted.
        The record is then checked and marked in the same script: only a
        record that is ``parked`` or ``granted`` and names this attempt's
        task owner lets the grants move, and it becomes ``adopted`` by this
        process's owner; any other record (or none) answers
        ``"superseded"`` with nothing moved.

        With ``wait_replicas``, ``WAIT`` goes in the same round trip; when
        fewer replicas acknowledge, the adopted grants are released and
        :class:`ReplicationTimeout` is raised, whatever the ``wait_policy``
        (adopting never waits). The adoption itself stays recorded.

        ``owner``: the task owner to adopt when it is not ``task_id``'s own
        (``keys.task_owner_id``); a deferred task's park record has
        owners of its own (``defer:<task id>``, docs/defer.md).
        """
        if owner is None:
            owner = task_owner_id(task_id, attempt)
        else:
            validate_owner_id(owner)
        if self._closed:
            raise LockError(f"this LockManager ({self.url}) is closed: make a new one")
        ident = self._identity.current()
        if self._own_heartbeat:
            self._heartbeat.ensure_started()
        else:
            self._ensure_lost_watch()
        record: tuple[str, str, float] | None = None
        if park_record_ttl is not None:
            record = (task_id, task_token(owner, task_id), park_record_ttl)
        reply: Any = None
        acked: int | None = None
        for _ in range(3):
            started = time.monotonic()
            reply, acked = self._adopt_script(ident, owner, holder, record)
            if int(reply[0]) != -1:
                break
            self._owner_lost(ident, "acquire")
            ident = self._identity.current()
        code = int(reply[0])
        if code == -1:
            raise LockError(f"owner {ident.owner_id} was declared dead while adopting {owner}")
        ident.registered = True
        if not self._confirm(ident, started, self.owner_ttl):
            self._owner_lost(ident, "deadline")
        if code == 0:
            why = _text(reply[1])
            by = _text(reply[2]) or None
            return Adoption(task_id, "adopted-elsewhere" if why == "adopted" else why, [], by)
        leases: list[Lease] = []
        for entry in reply[1:]:
            token, fence, modes, *names = (_text(x) for x in entry)
            ex = [n for m, n in zip(modes, names) if m == "x"]
            sh = [n for m, n in zip(modes, names) if m != "x"]
            req = self._request(ex, sh)
            # A depth of its own: adopted locks do not make the thread's next
            # acquire a nested one.
            leases.append(Lease(self, req, ident, token, int(fence), _Depth()))
        with self._state_lock:
            current = self._identity.peek() is ident and not self._closed
            if current:
                for lease in leases:
                    self._leases[lease.token] = lease
        if not current:
            for lease in leases:
                lease._mark_lost()
        if leases and acked is not None and acked < self.wait_replicas:
            self._adoption_short(task_id, leases, acked)
        log_acquire.info(
            "acquire.adopted task=%s owner=%s grants=%d", task_id, ident.owner_id, len(leases)
        )
        return Adoption(task_id, "adopted", leases, ident.owner_id)

    def _adoption_short(self, task_id: str, leases: list[Lease], acked: int) -> None:
        """Too few replicas acknowledged an adoption: release its grants, raise."""
        names = [name for lease in leases for name in lease.resources]
        log_acquire.warning(
            "acquire.replication-short task=%s resources=%s wanted=%d acknowledged=%d "
            "wait_timeout=%.3gs policy=%s: adopted grants released",
            task_id,
            ",".join(names),
            self.wait_replicas,
            acked,
            self.wait_timeout,
            self.wait_policy,
        )
        for lease in leases:
            try:
                lease.release()
            except LockError as exc:  # retried as a deferred release
                log_acquire.error("acquire.release-error token=%s error=%r", lease.token, exc)
        raise ReplicationTimeout(names, 0.0, self.wait_replicas, acked, self.wait_timeout)

    def _adopt_script(
        self,
        ident: OwnerIdentity,
        owner: str,
        holder: str | None = None,
        record: tuple[str, str, float] | None = None,
    ) -> tuple[Any, int | None]:
        """One run of adopt.lua: ``ident`` adopts task owner ``owner``'s grants.

        ``record``: ``(task id, token, TTL s)`` of a park record to check and
        mark in the same step. Returns ``(reply, replicas that acknowledged)``,
        the count None without ``wait_replicas``."""
        group = self._group() if (self._group is not None and not ident.registered) else None
        keys = [
            self.keys.held(owner),
            self.keys.alive(owner),
            self.keys.owners,
            self.keys.held(ident.owner_id),
            self.keys.alive(ident.owner_id),
            self.keys.adopted(owner),
            self.keys.dead(owner),
        ]
        if group is not None:
            keys.append(group)
        args = [
            owner,
            ident.owner_id,
            self.keys.prefix,
            str(int(self.owner_ttl * 1000)),
            "" if ident.registered else ident.describe(self.name),
            ident.tag if group is not None else "",
            self._req_ttl_arg,
            self._limit_arg,
            holder or "",
        ]
        if record is not None:
            args += [record[0], record[1], str(max(1, int(record[2] * 1000)))]
        if self.wait_replicas:
            reply, acked = self._call("adopt", keys, args, wait=self.wait_replicas)
            return reply, int(acked)
        return self._call("adopt", keys, args), None

    # -- release ----------------------------------------------------------

    def _run_release(
        self,
        owner_id: str,
        token: str,
        req: _Request,
        client: Any = None,
        *,
        lease: bool = False,
        clean: bool = False,
    ) -> Any:
        """Run release.lua for one request (release its grant, leave its queues).

        ``lease=True`` for a request returned as a lease: granted, so it has no
        queue entries left and the script skips leaving them. ``clean=True``
        (with ``lease``): acquire.lua made the grant in the call that replied
        it, so the request has no state or wake list to delete either (a
        task's holder record is the value of its registry fields).
        """
        args = [
            token,
            req.wire_modes,
            self._wire_prefix,
            self._req_ttl_arg,
            self._limit_arg,
            (b"2" if clean else b"1") if lease else b"0",
            b"1" if owner_id in self._spilled_owners else b"0",
        ]
        keys: list[Any] = list(req.wire_locks)
        return self._call("release", keys, args, client=client)

    def _end_request(self, owner_id: str, token: str, req: _Request, quiet: bool = False) -> None:
        """Release or dequeue a request that is not returning a lease.

        ``quiet``: Redis never answered the request (it may not be there at
        all, e.g. Redis was down from the start): a failed clean-up is still
        retried like any deferred release, but logged at DEBUG, since no
        grant was ever seen.
        """
        try:
            self._run_release(owner_id, token, req)
        except BaseException as exc:  # even a second interrupt must not strand a grant
            with self._state_lock:
                self._orphans[token] = req
            log_release.log(
                logging.DEBUG if quiet else logging.WARNING,
                "release.deferred token=%s resources=%s error=%r",
                token,
                ",".join(req.resources),
                exc,
            )
            if not isinstance(exc, Exception):
                raise

    def _release(self, lease: Lease) -> bool:
        """Release ``lease``'s handle: True if this call did, False if an earlier one
        did (or the lease was inherited across a fork: nothing of it is released)."""
        if lease._handle_released:
            return False
        if lease.pid != os.getpid():
            log_release.warning(
                "release.skipped token=%s reason=inherited-across-fork", lease.token
            )
            lease._handle_released = True
            lease._released = True
            return False
        if lease._own and not lease._parents:
            # The usual lease: its own grant, nothing re-entered. One pass
            # under the lock (what _drop_hold does for the general case).
            with self._state_lock:
                if lease._handle_released:
                    return False
                lease._handle_released = True
                lease._depth.count = max(0, lease._depth.count - 1)
                lease._holds -= 1
                if lease._holds > 0 or lease._released:
                    return True
                lease._released = True
                self._leases.pop(lease.token, None)
                if lease in lease._depth.leases:
                    lease._depth.leases.remove(lease)
            self._release_grant(lease)
            return True
        with self._state_lock:
            if lease._handle_released:
                return False
            lease._handle_released = True
            lease._depth.count = max(0, lease._depth.count - 1)
        try:
            if lease._own:
                self._drop_hold(lease)
        finally:
            for parent in lease._parents:
                self._drop_hold(parent)
        return True

    def _drop_hold(self, lease: Lease, *, force: bool = False) -> None:
        """One fewer lease counts on ``lease``'s grant; at 0, release it in Redis."""
        with self._state_lock:
            lease._holds = 0 if force else lease._holds - 1
            if lease._holds > 0 or lease._released:
                return
            lease._released = True
            self._leases.pop(lease.token, None)
            if lease in lease._depth.leases:
                lease._depth.leases.remove(lease)
        self._release_grant(lease)

    def _release_grant(self, lease: Lease) -> None:
        """Release ``lease``'s grant in Redis (its count dropped to 0): one round trip."""
        if self._metrics is not None:
            self._metrics.held(time.time() - lease.acquired_at)
        req = lease._request
        try:
            reply = self._run_release(
                lease.owner_id, lease.token, req, lease=True, clean=lease._clean
            )
        except BaseException:
            with self._state_lock:
                self._orphans[lease.token] = req
            raise
        released = int(reply[0])
        if released < len(req.modes):
            # Redis lost a grant of this owner (reclaimed, evicted, or a
            # failover to a replica that missed it): it may have lost the
            # owner's {ns}:owners entry with it, so the next grant lists the
            # owner again (see OwnerIdentity.listed).
            lease._ident.listed = False
        if released < len(req.modes) and not lease.lost:
            lease._mark_lost("declared-dead")
            log_release.warning(
                "release.partial owner=%s released=%d of=%d: the other grants were gone "
                "(reclaimed after the owner was declared dead, or lost by Redis in a "
                "failover or restart); the lease is marked lost",
                lease.owner_id,
                released,
                len(req.modes),
            )

    # -- liveness ---------------------------------------------------------

    def _confirm(self, ident: OwnerIdentity, started: float, ttl: float) -> bool:
        """Record a confirmed refresh of ``ident``'s liveness; False if too late.

        ``started`` is :func:`time.monotonic` taken *before* the request was
        sent, ``ttl`` the seconds the key had left after it (owner_ttl for a
        PEXPIRE, the PTTL read by a lost-owner watcher): the key cannot expire
        in Redis before ``started + ttl``. The lease deadline becomes that,
        less :attr:`liveness_margin`. A refresh that started after the
        previous deadline had passed is refused (False): the owner must be
        treated as lost, since its key may have expired, its locks been
        reclaimed and the key re-created in between.
        """
        with self._state_lock:
            if self._lapsed_locked(ident, started):
                return False
            floor = ident.valid_until if started <= ident.valid_until else 0.0
            ident.valid_until = max(floor, started + ttl - self.liveness_margin)
            return True

    def _lapsed(self, ident: OwnerIdentity, now: float) -> bool:
        """Whether ``ident``'s deadline passed while it holds a lease."""
        with self._state_lock:
            return self._lapsed_locked(ident, now)

    def _lapsed_locked(self, ident: OwnerIdentity, now: float) -> bool:
        # A deadline that passed while the owner held nothing costs nothing:
        # an idle pool child, whose refreshes it does not watch, must not be
        # declared lost at its next acquire. Only a lease makes it a loss.
        if not ident.valid_until or now <= ident.valid_until:
            return False
        return any(
            x.owner_id == ident.owner_id and not x._lost and not x._released
            for x in self._leases.values()
        )

    def _deadline_passed(self, ident: OwnerIdentity) -> None:
        """A lease of ``ident`` found the local deadline passed (no I/O here)."""
        self._owner_lost(ident, "deadline")

    def _cause_text(self, code: str | None) -> str | None:
        return cause_text(code)

    def _loss_reason(self, owner_id: str, fence: int | None = None) -> str:
        """Why ``owner_id``'s liveness key is gone: a loss code (one round trip).

        Read only on the loss path: the owner's tombstone names the cleanup
        that declared it dead (an operator's ``release``, or a worker,
        reconcile or node eviction). Without one, Redis lost its data when
        the fencing counter (never deleted once written) is missing, or
        when the data set began (``{ns}:born``, written with the counter)
        after ``fence``, the owner's latest grant: whoever created the
        counter again since (another process's acquire), the answer is the
        same. Otherwise the liveness expired (a pause or partition longer
        than owner_ttl, or the key alone was evicted); so it reads, too,
        when the owner holds no grant to compare with and the counter
        exists, or the data set predates ``{ns}:born``.
        """
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self.keys.dead(owner_id))
            pipe.exists(self.keys.fence)
            pipe.get(self.keys.born)
            tomb, counter, born = pipe.execute()
        except Exception as exc:  # the cause is a courtesy: never fail the loss on it
            log_heartbeat.debug("heartbeat.lost-reason-error owner=%s error=%r", owner_id, exc)
            return "expired"
        if tomb is not None:
            return "operator" if _text(tomb) == "operator" else "declared-dead"
        if not int(counter):
            return "redis-lost"
        if fence is not None and born is not None and int(born) > fence:
            return "redis-lost"
        return "expired"

    def _owner_lost(self, ident: OwnerIdentity, where: str, cause: str | None = None) -> None:
        """Retire ``ident`` and mark its leases lost; logs once per identity.

        ``where``: what found it (heartbeat, acquire, watch, node-heartbeat,
        declared-dead, deadline, ...); ``cause``: why, when the finder knows
        (a cleanup's reason code); otherwise a missing liveness key is
        explained by :meth:`_loss_reason`.
        """
        if where in ("heartbeat", "acquire", "watch", "node-heartbeat"):
            # The liveness key is gone: Redis may have lost its data, the
            # format key with it. Check (and re-create) it on the next call:
            # armed before the identity is retired, so that no new identity
            # of this process registers (and re-creates the fencing counter,
            # which would then read as older data) before the check.
            self._format_pending = True
        if not self._identity.retire(ident):
            return
        if cause is None:
            if where in ("heartbeat", "acquire", "watch", "node-heartbeat"):
                with self._state_lock:
                    fences = [
                        x.fencing_token
                        for x in self._leases.values()
                        if x.owner_id == ident.owner_id
                    ]
                cause = self._loss_reason(ident.owner_id, max(fences, default=None))
            else:
                cause = where
        with self._state_lock:
            lost = [x for x in self._leases.values() if x.owner_id == ident.owner_id]
            if where == "deadline" and ident.registered:
                # Its key may still live (the pause was shorter in Redis's eyes,
                # or another process refreshes it): put it to death in Redis too.
                self._doomed.add(ident.owner_id)
        text = cause_text(cause)
        # Logged before the leases are marked: whatever the loss sets off
        # (a task failing, a child killed by on_lost="terminate") comes after.
        log_heartbeat.error(
            'heartbeat.lost owner=%s leases=%d where=%s cause="%s": %s; continuing under a '
            "new identity",
            ident.owner_id,
            len(lost),
            where,
            text,
            _LOSS_DETAIL.get(text or "", _LOSS_CAUSES.get(where, _GONE)),
        )
        for lease in lost:
            lease._mark_lost(cause)
        if where == "deadline":
            self._heartbeat.wake()

    def _holds(self, ident: OwnerIdentity) -> bool:
        with self._state_lock:
            return any(x.owner_id == ident.owner_id for x in self._leases.values())

    def _heartbeat_client(self) -> AnyRedis:
        if self._hb_client is None or self._hb_client_pid != os.getpid():
            self._hb_client = clone_client(self.client)
            self._hb_client_pid = os.getpid()
        return self._hb_client

    def _ensure_lost_watch(self) -> None:
        """Start this process's lost-owner watcher unless it already runs here.

        Without its own heartbeat (liveness refreshed by another process, as
        in a Celery pool child), an owner would learn that it was declared
        dead only at its next acquire or release. The watcher blocks on
        ``{ns}:lost:<owner>``, which every cleanup of the owner pushes to,
        and marks the owner's leases lost the moment it is told; it also
        retries deferred releases. While the owner holds a lease, each pass
        first reads the liveness key's PTTL: that feeds the leases' local
        deadline (the refreshes are made by another process) and reports a
        key that vanished (Redis lost its data, or evicted it). Cost: one
        blocked connection per process, re-blocking every
        ``min(_block_cap, heartbeat_interval / 2)`` seconds, plus one PTTL
        per pass while holding.
        """
        if self._watch_pid == os.getpid() or self._closed:
            return
        if os.getpid() == self._lost_watch_exempt_pid:
            return
        with self._state_lock:
            if self._watch_pid == os.getpid():
                return
            self._watch_pid = os.getpid()
        start_os_thread(self._lost_watch_loop, "redislock-lost-watch")

    def _lost_watch_loop(self) -> None:
        self._watch_running = True
        try:
            self._lost_watch_passes()
        finally:
            self._watch_running = False

    def _lost_watch_passes(self) -> None:
        pid = os.getpid()
        outage = False
        block = max(0.01, min(self._block_cap, self.heartbeat_interval / 2))
        idle = min(_WATCH_IDLE_SLICE, block)  # a tiny owner_ttl watches sooner
        while not self._closed and self._watch_pid == pid:
            self._watch_passes += 1
            try:
                ident = self._identity.peek()
                if ident is None or not ident.registered or not self._watch_needed():
                    real_sleep(idle)
                    continue
                client = self._heartbeat_client()
                if self._holds(ident) and not self._watch_liveness(ident, client):
                    continue
                got = client.blpop([self.keys.lost(ident.owner_id)], timeout=block)
                if outage:
                    outage = False
                    log_heartbeat.info("heartbeat.watch-resumed url=%s", self.url)
                if got is not None and _text(got[1]) == _WATCH_STOP:
                    continue  # close() woke us: the loop condition ends it
                if got is not None:
                    reason = _text(got[1])
                    self._owner_lost(
                        ident, "declared-dead", "operator" if reason == "operator" else "dead"
                    )
                self._bury_doomed(client)
                self._retry_orphans(client)
            except REDIS_DOWN_ERRORS as exc:  # an outage: one line, not a traceback a second
                if self._closed:
                    return
                self._heartbeat_failed()
                if not outage and not self._closed:
                    outage = True
                    log_heartbeat.warning(
                        "heartbeat.watch-unavailable url=%s error=%s: retrying every second",
                        self.url,
                        exc,
                    )
                real_sleep(1.0)
            except Exception:  # the watcher must outlive anything else too
                if self._closed:
                    return
                log_heartbeat.exception("heartbeat.watch-error")
                real_sleep(1.0)

    def _watch_needed(self) -> bool:
        """Whether this process has anything the watcher is for: a lease
        (loss notices, the liveness check), a request waiting (it learns of
        its owner's death at once), a deferred release or a retired owner to
        clean up. An idle pool child sends nothing: a notice to an owner
        that holds and waits for nothing changes nothing here (its next
        acquire learns it from acquire.lua, reply -1)."""
        return bool(self._leases or self._waiting or self._orphans or self._doomed)

    def _watch_liveness(self, ident: OwnerIdentity, client: AnyRedis) -> bool:
        """Watcher side of the deadline (no own heartbeat); False once lost."""
        started = time.monotonic()
        if self._lapsed(ident, started):
            self._owner_lost(ident, "deadline")
            return False
        ms = int(client.pttl(self.keys.alive(ident.owner_id)))
        if ms == -2:
            self._owner_lost(ident, "watch")
            return False
        if ms > 0 and not self._confirm(ident, started, ms / 1000.0):
            self._owner_lost(ident, "deadline")
            return False
        return True

    def _beat(self) -> None:
        """One heartbeat: extend this owner's liveness; retry deferred work.

        Never sends the refresh once the local deadline of an owner holding a
        lease has passed: that owner is lost (it may have expired, been
        reclaimed and been re-created meanwhile); it is force-cleaned instead.
        An outage (RedisUnavailable) is logged once by :class:`Heartbeat`.
        """
        client = self._heartbeat_client()
        ident = self._identity.peek()
        if ident is not None and ident.registered:
            started = time.monotonic()
            if self._lapsed(ident, started):
                self._owner_lost(ident, "deadline")
            else:
                grants = self._grants_to_verify(ident) if self._may_evict else []
                reply = self._call(
                    "heartbeat",
                    [self.keys.alive(ident.owner_id), *(key for _, key in grants)],
                    [str(int(self.owner_ttl * 1000)), "1", *(x.token for x, _ in grants)],
                    client=client,
                )
                if int(reply[0]) == 0:
                    self._owner_lost(ident, "heartbeat")
                elif not self._confirm(ident, started, self.owner_ttl):
                    self._owner_lost(ident, "deadline")
                else:
                    self._grants_gone(grants, reply[1:])
        self._bury_doomed(client)
        self._retry_orphans(client)

    def _grants_to_verify(self, ident: OwnerIdentity) -> list[tuple[Lease, str]]:
        with self._state_lock:
            leases = [
                x
                for x in self._leases.values()
                if x.owner_id == ident.owner_id and not x._lost and not x._released
            ]
        return [(x, key) for x in leases for key in x._request.lock_keys]

    def _grants_gone(self, grants: list[tuple[Lease, str]], found: list[Any]) -> None:
        """Mark lost the leases whose grant Redis no longer records (evicted)."""
        for (lease, key), ok in zip(grants, found):
            if int(ok) == 0 and not lease._lost and not lease._released:
                lease._mark_lost("grant-gone")
                log_heartbeat.error(
                    "heartbeat.grant-gone owner=%s token=%s lock=%s fence=%d: Redis no longer "
                    "records this grant (the lock was evicted: maxmemory-policy is not "
                    "noeviction); the lease is lost",
                    lease.owner_id,
                    lease.token,
                    key,
                    lease.fencing_token,
                )

    def _bury_doomed(self, client: AnyRedis) -> None:
        """Force-clean this process's owners retired by their local deadline."""
        if not self._doomed:
            return
        with self._state_lock:
            doomed = list(self._doomed)
        for owner in doomed:
            report = self._cleanup(owner, force=True, client=client)
            with self._state_lock:
                self._doomed.discard(owner)
            log_cleanup.info(
                "cleanup.retired-owner owner=%s locks=%d status=%s",
                owner,
                report.released,
                report.status,
            )

    def _retry_orphans(self, client: AnyRedis) -> None:
        """Retry the releases that failed on an exit path (deferred); never raises.

        Called by every heartbeat of this process: the manager's own
        heartbeat, a pool child's lost-owner watcher, the Celery worker's
        node heartbeat (main process: threads, solo, gevent and eventlet
        pools). Each deferred release backs off on failure (see
        :class:`_OrphanRetry`); its first failure here is logged once
        (WARNING for an outage, ERROR with the reason for anything else,
        e.g. a foreign value at a lock key or an ACL NOPERM), later ones
        are only counted (``release_retry_failures``) until it succeeds.
        """
        if not self._orphans:
            return
        now = time.monotonic()
        with self._state_lock:
            orphans = list(self._orphans.items())
        for token, req in orphans:
            retry = self._orphan_retry.get(token)
            if retry is not None and now < retry.next_at:
                continue
            owner_id = token.split("|", 1)[0]
            try:
                self._run_release(owner_id, token, req, client=client)
            except Exception as exc:  # one bad release must not stop the others
                self.release_retry_failures += 1
                if retry is None:
                    retry = self._orphan_retry[token] = _OrphanRetry()
                outage = isinstance(exc, RedisUnavailable)
                pause = retry.failed(now, self.heartbeat_interval if outage else 300.0)
                if retry.failures == 1:
                    if outage:
                        log_release.warning(
                            "release.retry-failed token=%s resources=%s error=%s: retrying "
                            "on the heartbeat once Redis answers",
                            token,
                            ",".join(req.resources),
                            exc,
                        )
                    else:
                        log_release.error(
                            "release.retry-failed token=%s resources=%s error=%r: cannot "
                            "release; retrying quietly with backoff (next in %.3gs)",
                            token,
                            ",".join(req.resources),
                            exc,
                            pause,
                        )
                continue
            with self._state_lock:
                self._orphans.pop(token, None)
            self._orphan_retry.pop(token, None)
            log_release.info(
                "release.retried token=%s failures=%d",
                token,
                retry.failures if retry is not None else 0,
            )

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Release what this manager holds, then stop it for good.

        Every lease it still holds is released (owner-checked, one round trip
        each); if Redis cannot be reached, the rest are marked lost instead
        (their owner's liveness lapses: nothing refreshes it any more). Then
        the heartbeat and the lost-owner watcher stop, :meth:`acquire` raises
        :class:`LockError`, and, for a manager with its own heartbeat whose
        owner now holds nothing, the owner leaves ``{ns}:owners`` and its
        liveness key is deleted (one ``cleanup_owner`` round trip), so
        short-lived scripts do not pile up as dead owners. A manager whose
        liveness another process refreshes (``heartbeat=False``, a Celery
        pool child) leaves its owner to that process. Idempotent.
        """
        first = not self._closed
        self._closed = True
        self._heartbeat.stop()
        ident = self._identity.peek()
        if first and ident is not None:
            self._close_owner()
            if self._watch_pid == os.getpid():
                self._stop_lost_watch(ident)
        for held in list(self._conns):
            held.close()  # its connection back to the pool
        self.client.close()
        if self._hb_client is not None and self._hb_client_pid == os.getpid():
            self._hb_client.close()  # its own pool: every connection is closed

    def _stop_lost_watch(self, ident: OwnerIdentity) -> None:
        """Wake this process's watcher out of its BLPOP and let it end.

        Without this a closed manager's watcher would keep a connection
        blocked on the server for up to ``_block_cap`` seconds (and redis-py
        would reconnect a socket merely closed under it). One pipelined
        LPUSH + PEXPIRE of a value the watcher knows is not a loss notice;
        then up to one second for the thread to leave. Best effort: if Redis
        cannot be reached, the BLPOP times out on its own.
        """
        if not self._watch_running:
            return
        lost = self.keys.lost(ident.owner_id)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(lost, _WATCH_STOP)
            pipe.pexpire(lost, self._req_ttl_ms)
            pipe.execute()
        except Exception as exc:
            log_heartbeat.debug("heartbeat.watch-stop-unsent error=%r", exc)
            return
        deadline = time.monotonic() + 1.0
        while self._watch_running and time.monotonic() < deadline:
            real_sleep(0.005)

    def _close_owner(self) -> None:
        with self._state_lock:
            leases = [x for x in self._leases.values() if x.pid == os.getpid()]
        unreachable: BaseException | None = None
        for lease in leases:
            if unreachable is None:
                try:
                    lease._handle_released = True
                    self._drop_hold(lease, force=True)
                    continue
                except Exception as exc:
                    unreachable = exc
            lease._mark_lost("expired")
        ident = self._identity.peek()
        if ident is None:
            return
        self._identity.retire(ident)
        with self._state_lock:
            rest = [x for x in self._leases.values() if x.owner_id == ident.owner_id]
        for lease in rest:  # granted to another thread meanwhile: not returned
            lease._mark_lost("expired")
        if unreachable is not None:
            log_release.warning(
                "release.close-unreachable owner=%s leases_lost=%d error=%r",
                ident.owner_id,
                len(leases),
                unreachable,
            )
            return
        if ident.registered and self._own_heartbeat:
            try:
                self._cleanup(ident.owner_id, force=True, closing=True)
            except Exception as exc:  # its liveness expires on its own
                log_cleanup.warning("cleanup.close-error owner=%s error=%r", ident.owner_id, exc)

    # -- contention -------------------------------------------------------

    def _contention(self, lease: Lease, watch: bool = False) -> tuple[int, dict[str, str]]:
        """contenders.lua: the count, and each contended stream's last entry id.

        ``watch``: when nobody waits, the streams are created (or kept) for
        3 x owner_ttl, so that acquire.lua signals the next request a holder
        blocks on them. A stream exists only while a holder watches it.
        """
        req = lease._request
        streams = [self.keys.contended(r) for r in req.resources]
        args = [lease.token, self._limit_arg]
        if watch:
            args.append(str(self._req_ttl_ms))
        reply = self._call("contenders", [*req.queue_keys, *streams], args)
        return int(reply[0]), dict(zip(streams, (_text(x) for x in reply[1:])))

    def _contenders(self, lease: Lease) -> int:
        return self._contention(lease)[0]

    def _wait_for_contender(self, lease: Lease, timeout: float) -> bool:
        limit = _v.seconds("timeout", timeout, allow_inf=True)
        assert limit is not None
        timeout = limit
        deadline = time.monotonic() + timeout
        while True:
            # Counted with watch=True: the streams exist (TTL 3 x owner_ttl,
            # renewed here at least every owner_ttl) while we read them.
            count, streams = self._contention(lease, watch=True)
            if count:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Every holder of a resource reads its one contended stream
            # (XREAD wakes every reader, where a list would wake only one),
            # from the ids read with the count: no signal in between is lost.
            # A signal may be stale (a request that only tried, or has given
            # up since): the loop counts again, and waits on while nobody does.
            block = min(remaining, self._block_cap, self.owner_ttl)
            block_ms = max(1, int(block * 1000))
            try:
                self._conn().xread(streams, block=block_ms)  # type: ignore[arg-type]
                self._conn_done()
            except REDIS_DOWN_ERRORS as exc:
                raise RedisUnavailable(self.url, exc) from exc
            except redis.ResponseError as exc:
                raise (permission_denied(exc, self.url, "XREAD") or exc) from exc

    # -- cleanup ----------------------------------------------------------

    def cleanup_owner(
        self, owner_id: str, *, force: bool = False, reason: str = "dead"
    ) -> CleanupReport:
        """Free every lock ``owner_id`` holds, if it is dead (or ``force``).

        Walks only the owner's registry: O(its locks), no SCAN. A live owner
        is left alone (``status="alive"``) unless ``force`` is set, which
        also deletes its liveness key so that, if it still runs, its next
        heartbeat finds itself dead and marks its leases lost. Keys of an
        unexpected type are kept and reported; one failing key does not stop
        the others. Raises ValueError for a malformed owner id and
        :class:`PermissionDenied` when the Redis user's ACL refuses the script.
        A cleaned owner is tombstoned (``{ns}:dead:<owner>``, for 3 x
        owner_ttl): it can never register again, so a request of it still in
        flight cannot bring it back to life.

        ``reason`` is kept as the tombstone's value and pushed to the owner's
        lost list, so that the owner, if it still runs, reports who freed its
        locks (``Lease.lost_cause``, ``LockLost.cause``): ``"operator"``
        (the CLI's ``release``) or ``"dead"`` (default).
        """
        validate_owner_id(owner_id)
        force = _v.flag("force", force)
        if reason not in CLEANUP_REASONS:
            raise ConfigurationError(
                "reason", f"must be one of {', '.join(CLEANUP_REASONS)}, not {reason!r}"
            )
        return self._cleanup(owner_id, force=force, reason=reason)

    def _cleanup(
        self,
        owner_id: str,
        *,
        force: bool,
        client: Any = None,
        closing: bool = False,
        reason: str = "dead",
    ) -> CleanupReport:
        reply = self._call(
            "cleanup_owner",
            [self.keys.held(owner_id), self.keys.alive(owner_id), self.keys.owners],
            [
                owner_id,
                self.keys.prefix,
                "1" if force else "0",
                str(self._req_ttl_ms),
                str(self.queue_scan_limit),
                "1" if closing else "0",
                reason,
            ],
            client=client,
        )
        status, released, skipped, errors, remaining, reclaimed = reply
        skipped_l = [_text(x) for x in skipped]
        errors_l = [_text(x) for x in errors]
        report = CleanupReport(
            owner_id=owner_id,
            status=_text(status),
            released=int(released),
            skipped=tuple(zip(skipped_l[::2], skipped_l[1::2])),
            errors=tuple(zip(errors_l[::2], errors_l[1::2])),
            remaining=int(remaining),
            reclaimed=int(reclaimed),
        )
        for key, kind in report.skipped:
            log_cleanup.warning(
                "cleanup.skipped owner=%s key=%s type=%s (kept in the registry)",
                owner_id,
                key,
                kind,
            )
        for key, msg in report.errors:
            log_cleanup.error("cleanup.key-error owner=%s key=%s error=%s", owner_id, key, msg)
        if report.status != "alive":
            log_cleanup.info(
                "cleanup.freed owner=%s locks=%d status=%s",
                owner_id,
                report.released,
                report.status,
            )
        return report

    def reconcile(self, *, batch_size: int = 500) -> ReconcileReport:
        """Free the locks of every dead owner in the active-owners set.

        Walks ``{ns}:owners`` with SSCAN in batches (one EXISTS pipeline per
        batch), never the keyspace; cost O(owners + dead owners' locks).
        Safe to run from many processes at once: each cleanup is atomic and
        idempotent. An owner whose cleanup fails stays for the next pass; a
        refusal by the ACL (:class:`PermissionDenied`) ends the pass, since
        every owner would fail the same way.
        """
        batch_size = _v.integer("batch_size", batch_size, minimum=1, maximum=10000)
        report = ReconcileReport()
        seen: set[str] = set()
        cursor: int = 0
        while True:
            try:
                cursor, members = self._conn().sscan(self.keys.owners, cursor, count=batch_size)
                self._conn_done()
            except REDIS_DOWN_ERRORS as exc:
                raise RedisUnavailable(self.url, exc) from exc
            except redis.ResponseError as exc:
                raise (permission_denied(exc, self.url, "SSCAN") or exc) from exc
            batch = [m for m in (_text(x) for x in members) if m not in seen]
            seen.update(batch)
            if batch:
                pipe = self.client.pipeline(transaction=False)
                for owner in batch:
                    pipe.exists(self.keys.alive(owner))
                try:
                    alive = pipe.execute()
                except redis.ResponseError as exc:
                    raise (permission_denied(exc, self.url, "EXISTS") or exc) from exc
                for owner, is_alive in zip(batch, alive):
                    report.owners_seen += 1
                    if is_alive:
                        report.alive += 1
                        continue
                    try:
                        rep = self.cleanup_owner(owner)
                        report.add(rep)
                        if self._metrics is not None and rep.status != "alive":
                            self._metrics.cleaned("reconcile")
                    except PermissionDenied:
                        raise  # not this owner's failure: every other one would fail too
                    except (redis.RedisError, LockError) as exc:
                        report.errors[owner] = repr(exc)
                        log_reconcile.error("reconcile.owner-error owner=%s error=%r", owner, exc)
            if int(cursor) == 0:
                break
        log_reconcile.info(
            "reconcile.done owners=%d alive=%d cleaned=%d partial=%d released=%d errors=%d",
            report.owners_seen,
            report.alive,
            report.cleaned,
            report.partial,
            report.released,
            len(report.errors),
        )
        return report

    # -- server checks ----------------------------------------------------

    def _check_format_once(self, client: Any = None) -> None:
        """The data-format check of the first script call (see :meth:`check_format`).

        One round trip per manager (and per process: a forked child inherits
        the parent's result). A refusal or an unreachable Redis leaves it due,
        so every later call checks again until the namespace is usable.
        """
        with self._format_lock:
            if self._format_pending:
                self.check_format(client=client)
                self._format_pending = False

    def check_format(self, *, client: Any = None) -> int:
        """Check that the namespace's lock data has this release's format.

        The namespace records its data-format version in ``{ns}:format``
        (:data:`~celery_redislock.FORMAT_VERSION`); format.lua (one round
        trip, which every manager's first script call makes) records ours
        when the key is missing: a namespace used for the first time, or a
        Redis that lost its data (restart without persistence, FLUSHALL),
        which simply re-creates it. Data of a release from before format
        versioning (a fencing counter without the key) counts as
        ``UNVERSIONED_FORMAT`` (``celery_redislock.keys``).

        Called explicitly, it also counts as the first call's check.
        Returns the format. Raises :class:`FormatMismatch` (nothing written)
        when the namespace has another one, :class:`RedisUnavailable`,
        :class:`PermissionDenied`.
        """
        c = self.client if client is None else client
        try:
            reply = self._scripts.run(
                "format",
                [self.keys.format, self.keys.fence],
                [str(FORMAT_VERSION), str(UNVERSIONED_FORMAT)],
                client=c,
            )
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            raise (permission_denied(exc, self.url, "EVALSHA format") or exc) from exc
        found = format_verdict(self.namespace, self.url, _text(reply[0]), _text(reply[1]))
        assert found is not None
        self._format_pending = False  # checked: the next script call need not
        return found

    def _check_eviction_once(self) -> None:
        """The eviction-policy check of the first round trip (``eviction_check``).

        One INFO per manager (not per call); an unreachable Redis leaves it
        due for the next call. ``"raise"`` keeps refusing every later call.
        """
        if self._eviction_refusal is not None:
            raise ConfigurationError("eviction_check", self._eviction_refusal)
        self._eviction_pending = False  # one thread checks; others go on
        try:
            check = self.check_eviction()
        except BaseException:
            self._eviction_pending = True
            raise
        if not check.may_evict:
            return
        self._may_evict = True
        if self._eviction_mode == "raise":
            self._eviction_refusal = f"{check.describe()} (or pass eviction_check='warn')"
            raise ConfigurationError("eviction_check", self._eviction_refusal)
        log_heartbeat.warning("startup.eviction-risk url=%s %s", self.url, check.describe())

    def check_eviction(self) -> EvictionCheck:
        """Whether Redis may evict keys (``maxmemory_policy`` from INFO)."""
        try:
            return check_eviction(self.client)
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
