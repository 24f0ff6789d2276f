"""The lock engine's face: :class:`LockManager` acquires, releases and cleans up.

It works without Celery. One manager per process and Redis namespace is
the normal use; it is thread-safe, fork-safe (a child gets a new owner id,
a new heartbeat and new connections) and cancellation-safe (every exit of
an acquisition releases or dequeues by its own token).

The manager is a facade: it validates its options, builds the parts that
do the work and hands each call to one of them (docs/architecture.md):

- :mod:`.channel`: every round trip (held connections, errors, gates);
- :mod:`.state`: what this process holds and owes, reset after fork;
- :mod:`.liveness`: the owner identity, its heartbeat, deadline and loss;
- :mod:`.release`: releases and deferred releases (the leases' host);
- :mod:`.watcher`: the lost-owner watcher thread of a pool child;
- :mod:`.cleanup`: freeing dead owners, reconcile, close;
- :mod:`.acquire`: the acquire loop; :mod:`.task_owner`: task-owned grants.

Most of the class's lines are the docstrings of its public methods (the
API reference); its code is a few hundred lines.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, overload

import redis
from redis.cluster import RedisCluster

from ..exceptions import ConfigurationError, LockTimeout
from ..protocol.calls import Protocol
from ..protocol.causes import CLEANUP_REASONS, cause_text
from ..protocol.keys import Keyspace, validate_resource
from ..protocol.options import (
    DEFAULT_OWNER_TTL,
    DEFAULT_SCAN_LIMIT,
    DEFAULT_WAIT_TIMEOUT,
    EVICTION_CHECK_MODES,
    LIVENESS_MARGIN_FRACTION,
    LIVENESS_MARGIN_MAX,
    MAX_WAIT_REPLICAS,
    MAX_WAIT_TIMEOUT,
    MIN_WAIT_TIMEOUT,
    REGISTRY_SPILL_AT,
    WAIT_POLICIES,
    EngineOptions,
)
from ..protocol.reports import CleanupReport, LockHolder, ReconcileReport, lock_holders
from ..protocol.request import Limits, Request, RequestCache, ResourceNames
from ..store.channel import REDIS_DOWN_ERRORS, Channel, format_verdict, socket_timeout
from ..store.checks import EvictionCheck
from ..store.connect import (
    AnyRedis,
    client_from_url,
    describe_client,
    is_sentinel_url,
    parse_sentinel_url,
    redact,
)
from ..store.valkey_client import from_valkey, is_valkey_client
from .acquire import Acquirer, RequestMoved
from .cleanup import Cleaner
from .context import ContextStack
from .heartbeat import Heartbeat
from .lease import Lease
from .liveness import Liveness
from .metrics import MetricsHook, Telemetry
from .parts import Parts
from .release import Releaser
from .shared import Shared
from .state import ProcessState
from .task_owner import Adoption, TaskGrant, TaskOwners
from .watcher import LostWatcher

__all__ = [
    "CLEANUP_REASONS",
    "DEFAULT_OWNER_TTL",
    "DEFAULT_SCAN_LIMIT",
    "DEFAULT_WAIT_TIMEOUT",
    "EVICTION_CHECK_MODES",
    "LIVENESS_MARGIN_FRACTION",
    "LIVENESS_MARGIN_MAX",
    "MAX_WAIT_REPLICAS",
    "MAX_WAIT_TIMEOUT",
    "MIN_WAIT_TIMEOUT",
    "REDIS_DOWN_ERRORS",
    "REGISTRY_SPILL_AT",
    "WAIT_POLICIES",
    "Adoption",
    "LockManager",
    "RequestMoved",
    "TaskGrant",
    "cause_text",
    "format_verdict",
]

log = logging.getLogger("celery_redislock.acquire")
_T = TypeVar("_T")


class _Option(Generic[_T]):
    """A manager attribute that reads the :class:`EngineOptions` field of
    its own name (``manager.owner_ttl`` is ``manager.options.owner_ttl``)."""

    #: The manager's attribute that holds the field.
    _holder = "options"

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, manager: None, cls: type) -> _Option[_T]: ...
    @overload
    def __get__(self, manager: LockManager, cls: type | None = None) -> _T: ...
    def __get__(self, manager: LockManager | None, cls: type | None = None) -> Any:
        return self if manager is None else getattr(getattr(manager, self._holder), self._name)


class _Part(_Option[_T]):
    """A manager attribute that is the part of its own name
    (``manager.liveness`` is ``manager.parts.liveness``)."""

    _holder = "parts"


class LockManager:
    """Acquire exclusive and shared Redis locks, all or nothing, fairly.

    Args:
        redis_url: a ``redis://``, ``rediss://``, ``unix://`` or
            ``sentinel://`` URL (forms: docs/configuration.md), or a
            ready :class:`redis.Redis` or :class:`redis.cluster.RedisCluster`
            client (its pool is reused; replies may be bytes or str); or a
            valkey-py ``Valkey`` / ``ValkeyCluster`` client, whose settings
            a redis-py client of the manager's own is made with (README,
            "valkey-py clients"). ``valkey://`` / ``valkeys://`` URLs are
            ``redis://`` / ``rediss://``.
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
        metrics: a :class:`~celery_redislock.engine.metrics.MetricsHook` told of
            every acquire (wait and outcome), release (hold time), lost
            lease, cleanup and failed heartbeat in this process (and in
            processes forked from it), e.g.
            :class:`celery_redislock.ops.prometheus.PrometheusMetrics`. None
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

    # A facade: the parts (engine/parts.py) do the work, each public method
    # hands its call to one of them. The class stays longer than its parts
    # (about 580 lines) because it carries the API reference of every public
    # method, rendered in docs/api.md (about 340 lines); its code is the
    # options, the construction and the hand-offs.

    owner_ttl = _Option[float]()
    heartbeat_interval = _Option[float]()
    queue_scan_limit = _Option[int]()
    name = _Option[str | None]()
    wait_replicas = _Option[int]()
    wait_timeout = _Option[float]()
    wait_policy = _Option[str]()
    #: Seconds the local liveness deadline keeps from owner_ttl.
    liveness_margin = _Option[float]()

    # The parts (engine/parts.py), for the worker services built on the
    # engine (node, defer): package-internal, not public API.
    protocol = _Part[Protocol]()
    channel = _Part[Channel]()
    state = _Part[ProcessState]()
    telemetry = _Part[Telemetry]()
    core = _Part[Shared]()
    context = _Part[ContextStack]()
    requests = _Part[RequestCache]()
    liveness = _Part[Liveness]()
    releaser = _Part[Releaser]()
    watcher = _Part[LostWatcher]()
    cleaner = _Part[Cleaner]()
    acquirer = _Part[Acquirer]()
    tasks = _Part[TaskOwners]()

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
        group: Any = None,
        wait_replicas: int = 0,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        wait_policy: str = "fail",
        eviction_check: str = "warn",
        metrics: MetricsHook | None = None,
        hold_connection: bool = True,
    ) -> None:
        made: list[tuple[AnyRedis, str]] = []

        def client_facts() -> tuple[float | None, bool]:
            made.append(_client(redis_url))
            return socket_timeout(made[0][0]), isinstance(made[0][0], RedisCluster)

        opts = EngineOptions.build(
            owner_ttl=owner_ttl,
            heartbeat_interval=heartbeat_interval,
            queue_scan_limit=queue_scan_limit,
            name=name,
            heartbeat=heartbeat,
            hold_connection=hold_connection,
            group=group,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            wait_policy=wait_policy,
            eviction_check=eviction_check,
            client_facts=client_facts,
        )
        self.options = opts
        self.keys = Keyspace(namespace)
        self.namespace = namespace
        self.client, self.url = made[0]
        self.parts = Parts(self.keys, opts, self.client, self.url, metrics)

    # -- identity ---------------------------------------------------------

    @property
    def owner_id(self) -> str:
        """This process's owner id; a forked child gets a different one."""
        return self.liveness.identity.current().owner_id

    @property
    def heartbeat(self) -> Heartbeat:
        """The background heartbeat of this process (``ticks`` counts beats)."""
        return self.liveness.heartbeat

    @property
    def release_retry_failures(self) -> int:
        """Failed retries of deferred releases (each retried with backoff)."""
        return self.releaser.retry_failures

    # -- for the worker integration (package-internal, not public API) -----

    @property
    def metrics(self) -> MetricsHook | None:
        """The metrics hook told of this manager's events, or None.

        Set by the worker integration once its hook exists; events from then
        on are reported to it."""
        return self.telemetry.hook

    @metrics.setter
    def metrics(self, hook: MetricsHook | None) -> None:
        self.telemetry.hook = hook

    def become_member(self) -> None:
        """Make this process the member process: ``heartbeat=False`` and
        ``group`` apply here (a Celery pool child, from
        ``worker_process_init``). No I/O; idempotent."""
        self.liveness.become_member()

    def set_halt_key(self, key: str | None) -> None:
        """The worker's halt list (``{ns}:halt:<incarnation>``): haltable
        waits of this process give way once something is pushed to it."""
        self.acquirer.halt_key = key

    def exempt_from_lost_watch(self) -> None:
        """This process's owners are watched by someone else (the worker's
        node heartbeat): no lost-owner watcher thread here."""
        self.watcher.exempt_pid = os.getpid()

    @property
    def upkeep_due(self) -> bool:
        """Whether deferred releases wait for a retry that no heartbeat of
        this process will make (no own heartbeat: a pool child)."""
        return bool(self.state.deferred) and not self.liveness.own_heartbeat

    def upkeep(self) -> None:
        """One heartbeat pass in the calling thread: refresh the liveness,
        put retired owners to death, retry deferred releases."""
        self.liveness.beat()

    def hold_in_thread(self, leases: Iterable[Lease]) -> None:
        """Count adopted ``leases`` as held by the calling thread or
        greenlet: its nested acquires of their resources re-enter them."""
        self.tasks.hold_in_thread(leases)

    def request(
        self, exclusive: ResourceNames, shared: ResourceNames, limited: Limits = None
    ) -> Request:
        """The validated request for these resources (no I/O; cached)."""
        return self.requests.get(exclusive, shared, limited)

    # -- acquire ----------------------------------------------------------

    def acquire(
        self,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
        *,
        limited: Limits = None,
        timeout: float | None = None,
        nested: bool | None = None,
    ) -> Lease:
        """Acquire every resource at once, waiting first come, first served.

        Args:
            exclusive: resource names to hold alone (writer).
            shared: resource names to hold alongside other shared holders.
            limited: resource name -> limit N (an int from 1 to 10,000):
                one slot of each, granted only while fewer than this request's
                own N hold the resource. A name used with ``limited`` is
                only ever taken limited (:class:`InvalidResource` names the
                other mode otherwise).
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
        return self.acquirer.acquire(exclusive, shared, timeout, nested, limited)

    @contextmanager
    def lock(
        self,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
        *,
        limited: Limits = None,
        timeout: float | None = None,
        nested: bool | None = None,
    ) -> Iterator[Lease]:
        """Context manager form of :meth:`acquire`; releases on exit."""
        lease = self.acquire(exclusive, shared, limited=limited, timeout=timeout, nested=nested)
        try:
            yield lease
        finally:
            lease.release()

    def try_acquire(
        self,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
        *,
        limited: Limits = None,
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
            return self.acquire(exclusive, shared, limited=limited, timeout=0, nested=nested)
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
        if self.channel.format_pending:
            self.channel.check_format_once(None)
        return lock_holders(resource, self.channel.command("HGETALL", key))

    def is_locked(self, resource: str) -> bool:
        """Whether Redis records any grant on ``resource`` (one round trip).

        Like :meth:`holders`, a grant of an owner that died counts until it
        is reclaimed. A free answer is only a snapshot: use
        :meth:`try_acquire` to take the lock if it is free.
        """
        key = self.keys.lock(validate_resource(resource))
        if self.channel.format_pending:
            self.channel.check_format_once(None)
        return int(self.channel.command("HLEN", key)) > 0

    # -- task owners: locks held by a task id, adopted by its process -----

    def acquire_for_task(
        self,
        task_id: str,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
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
        return self.tasks.acquire_for_task(
            task_id, exclusive, shared, ttl=ttl, attempt=attempt, holder=holder
        )

    def release_task(self, task_id: str, attempt: int = 0) -> CleanupReport:
        """Free every lock task ``task_id``'s owner holds, and retire it.

        For a task whose message was never sent (the producer failed to
        publish it). The same atomic, O(its locks) cleanup as a dead owner's
        (forced: the task owner's liveness is deleted first); the task owner
        is tombstoned, so a later :meth:`acquire_for_task` of the same id
        raises. A task owner already adopted or gone answers ``"cleaned"``
        with nothing released.
        """
        return self.tasks.release_task(task_id, attempt)

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
        return self.tasks.adopt(
            task_id, attempt, holder=holder, park_record_ttl=park_record_ttl, owner=owner
        )

    # -- close ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.core.closed

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
        first = not self.core.closed
        self.core.closed = True
        self.liveness.heartbeat.stop()
        ident = self.liveness.identity.peek()
        if first and ident is not None:
            self.cleaner.close_owner()
            if self.watcher.started_here:
                self.watcher.stop(ident)
        self.channel.close()
        self.liveness.close()

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
        return self.cleaner.cleanup_owner(owner_id, force=force, reason=reason)

    def reconcile(self, *, batch_size: int = 500) -> ReconcileReport:
        """Free the locks of every dead owner in the active-owners set.

        Walks ``{ns}:owners`` with SSCAN in batches (one EXISTS pipeline per
        batch), never the keyspace; cost O(owners + dead owners' locks).
        Safe to run from many processes at once: each cleanup is atomic and
        idempotent. An owner whose cleanup fails stays for the next pass; a
        refusal by the ACL (:class:`PermissionDenied`) ends the pass, since
        every owner would fail the same way.
        """
        return self.cleaner.reconcile(batch_size=batch_size)

    # -- server checks ----------------------------------------------------

    def check_format(self, *, client: Any = None) -> int:
        """Check that the namespace's lock data has this release's format.

        The namespace records its data-format version in ``{ns}:format``
        (:data:`~celery_redislock.FORMAT_VERSION`); format.lua (one round
        trip, which every manager's first script call makes) records ours
        when the key is missing: a namespace used for the first time, or a
        Redis that lost its data (restart without persistence, FLUSHALL),
        which simply re-creates it. Data of a release from before format
        versioning (a fencing counter without the key) counts as
        ``UNVERSIONED_FORMAT`` (``celery_redislock.protocol.keys``).

        Called explicitly, it also counts as the first call's check.
        Returns the format. Raises :class:`FormatMismatch` (nothing written)
        when the namespace has another one, :class:`RedisUnavailable`,
        :class:`PermissionDenied`.
        """
        return self.channel.check_format(client=client)

    def check_eviction(self) -> EvictionCheck:
        """Whether Redis may evict keys (``maxmemory_policy`` from INFO)."""
        return self.channel.check_eviction()


def _client(redis_url: str | AnyRedis) -> tuple[AnyRedis, str]:
    """The client of ``redis_url`` (a URL, or a client to use as it is), and
    the URL for display (every password masked)."""
    if isinstance(redis_url, str):
        client: AnyRedis = client_from_url(redis_url, setting="redis_url")
        # Display only (errors, logs, status): a Sentinel URL in canonical
        # form; every password masked.
        url = (
            parse_sentinel_url(redis_url).to_url(redacted=True)
            if is_sentinel_url(redis_url)
            else redact(redis_url)
        )
        return client, url
    if isinstance(redis_url, (redis.Redis, RedisCluster)):
        return redis_url, describe_client(redis_url)
    if is_valkey_client(redis_url):  # its settings, on a redis-py client of our own
        client = from_valkey(redis_url)
        return client, describe_client(client)
    raise ConfigurationError(
        "redis_url",
        "must be a URL, a redis.Redis or a redis.cluster.RedisCluster client "
        f"(or valkey-py's Valkey or ValkeyCluster), not {type(redis_url).__name__}",
    )
