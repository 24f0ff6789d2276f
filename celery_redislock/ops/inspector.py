"""Read-only introspection of one namespace: who holds, who waits, who is dead.

This is the engine side of the operator CLI (``celery -A proj redislock``);
it imports nothing from Celery and never writes to Redis.

Everything is found from the data structures the scripts keep, never from
the keyspace: owners come from the active-owners set ``{ns}:owners`` (SSCAN
in batches), an owner's locks from its registry ``{ns}:held:<owner>`` (a hash
of resource names, HSCAN in batches), a resource's holders from its lock hash and its waiters from
its queue. No SCAN, no KEYS: the cost of every call is
O(owners + their locks), in round trips of at most ``batch_size`` commands
(one pipeline per batch), whatever else the Redis holds.

A snapshot is not atomic across round trips: a lock may be released or an
owner may die between two batches. Each record says what Redis said when it
was read; re-run the command to see a later state.

Node information (which Celery worker and incarnation an owner belongs to)
is optional. For node names the caller gives, it comes from the node record
``{ns}:node:<name>`` (its ``inc`` field), that incarnation's group hash
``{ns}:group:<inc>`` (owner -> process tag, see ``identity.process_tag``)
and tombstone ``{ns}:tomb:<inc>``. An owner whose liveness value carries
``inc=`` (and ``node=`` or ``name=``) fields is labelled without being
asked. Owners of a plain :class:`LockManager` have none. Nodes are never
searched for in the keyspace.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .. import _validate as _v
from ..engine.manager import LockManager
from ..exceptions import ConfigurationError
from ..protocol.keys import validate_owner_id
from ..redact import redact_url as redact_url  # old name, kept importable
from .locks import LocksView
from .owners import OwnersView
from .reader import DEFAULT_BATCH_SIZE, Reader

# The records, their parsers and the waiter bounds were defined here; they
# stay importable from this module (and, through it, from the old path
# ``celery_redislock.inspect``).
from .records import (
    Holder,
    LimitedInfo,
    Liveness,
    LockInfo,
    NodeInfo,
    OwnerInfo,
    QueueLength,
    ReleasePlan,
    Status,
    Summary,
    Usage,
    Waiter,
    describe_fields,
    limit_of_slots,
    request_modes,
)
from .summary import SummaryView
from .waiters import DEFAULT_WAITER_LIMIT, MAX_WAITER_LIMIT, WaitersView

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_WAITER_LIMIT",
    "MAX_WAITER_LIMIT",
    "Holder",
    "Inspector",
    "LimitedInfo",
    "Liveness",
    "LockInfo",
    "NodeInfo",
    "OwnerInfo",
    "QueueLength",
    "ReleasePlan",
    "Status",
    "Summary",
    "Usage",
    "Waiter",
    "describe_fields",
    "limit_of_slots",
    "redact_url",
    "request_modes",
]


class Inspector:
    """Read-only views of a :class:`LockManager`'s namespace.

    Args:
        manager: gives the client, the namespace's key builder and the URL.
            The inspector never acquires, so the manager never registers an
            owner or starts a heartbeat on its behalf.
        batch_size: SSCAN COUNT and the most commands sent in one pipeline
            (1..10000). Bounds what one round trip costs Redis.

    Raises :class:`RedisUnavailable` (naming the URL) when Redis cannot be
    reached; nothing here writes, so an interrupted call leaves no trace.

    The one entry point of the CLI, the metrics collector and users'
    scripts, so that they all read the namespace the same batched way. The
    reads themselves live in views that share one reader (the round trips,
    the error rule, the format check), in the modules ``ops/owners.py``,
    ``ops/locks.py``, ``ops/waiters.py`` and ``ops/summary.py``; the
    release plans, built from them, are here.
    """

    def __init__(self, manager: LockManager, *, batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        if not isinstance(manager, LockManager):
            raise ConfigurationError(
                "manager", f"must be a LockManager, not {type(manager).__name__}"
            )
        batch_size = _v.integer("batch_size", batch_size, minimum=1, maximum=10000)
        self.manager = manager
        self.client = manager.client
        self.keys = manager.keys
        self.batch_size = batch_size
        self._reader = Reader(manager, batch_size)
        self._owners = OwnersView(self._reader)
        self._locks = LocksView(self._reader, self._owners)
        self._waiters = WaitersView(self._reader, self._owners)
        self._summary = SummaryView(self._reader, self._owners)

    # -- format ---------------------------------------------------------------

    def usage(self) -> Usage:
        """The namespace's format and whether it was ever used (one round trip).

        GET ``{ns}:format``, EXISTS ``{ns}:fence``, SCARD ``{ns}:owners``;
        read once per inspector, before its first other read. Never writes.
        Raises :class:`~celery_redislock.exceptions.FormatMismatch` when the
        namespace holds lock data of another format than this release reads.
        """
        return self._reader.usage()

    # -- owners and registries ------------------------------------------------

    def owner_ids(self) -> Iterator[list[str]]:
        """Batches of the ids in the active-owners set (SSCAN, never SCAN)."""
        return self._reader.owner_ids()

    def registry(self, owner_id: str) -> list[str]:
        """The lock keys of one owner's registry (HSCAN in batches).

        The registry holds resource names; they are returned as the lock keys
        ``{ns}:lock:<resource>``.
        """
        return self._owners.registry(owner_id)

    def registries(self, owners: Sequence[str]) -> dict[str, list[str]]:
        """The registries of many owners (as lock keys): one pipelined HSCAN per
        batch of owners, then further HSCANs only for the (large) registries
        not done yet."""
        return self._owners.registries(owners)

    def liveness(self, owners: Iterable[str]) -> dict[str, Liveness]:
        """PTTL and value of each owner's liveness key (pipelined in batches)."""
        return self._owners.liveness(owners)

    # -- holders and waiters --------------------------------------------------

    def holders(self, resource: str) -> list[Holder]:
        """Every grant on ``resource``: token, owner, mode, owner liveness.

        Two round trips (the lock hash, which also holds each grant's fencing
        token, then the owners' liveness). Exclusive first, then by owner.
        """
        return self._locks.holders(resource)

    def lock_info(self, resource: str) -> LockInfo:
        """The holders and wait-queue length of one resource."""
        return self._locks.lock_info(resource)

    def resource_of(self, lock_key: str) -> str:
        """The resource of a lock key (the key itself when it is not one)."""
        return self._reader.resource_of(lock_key)

    def waiters(self, resource: str, *, limit: int = DEFAULT_WAITER_LIMIT) -> list[Waiter]:
        """Queued requests of ``resource`` in the order they will be served.

        Reads at most ``limit`` queue entries (the queue is a zset scored by
        arrival; nested requests sort first), then each owner's liveness and
        each request's state: two round trips per batch.
        """
        return self._waiters.waiters(resource, limit=limit)

    def queue_lengths(self) -> list[QueueLength]:
        """Every resource somebody waits for, with its number of queued requests.

        Longest queue first. Read from the owners' waits hashes (one pipeline
        per batch of owners: HVALS each), never by scanning the keyspace: the
        cost is O(owners + their queued requests).
        """
        return self._waiters.queue_lengths()

    # -- owners and locks -----------------------------------------------------

    def owners(self, nodes: Sequence[str] = ()) -> list[OwnerInfo]:
        """Every owner in the active-owners set: liveness, registry size, node.

        Per batch of owners: one pipeline (PTTL, GET, HLEN each), plus one
        for group/tombstone lookups when owners name an incarnation. With
        ``nodes`` (Celery node names), the owners of each node's current
        incarnation are labelled with it (two round trips per node, see
        :meth:`node`); the keyspace is never searched for nodes.
        """
        return self._owners.owners(nodes)

    def node(self, name: str) -> NodeInfo | None:
        """A worker node's record and its current incarnation's group, or None.

        Reads ``{ns}:node:<name>`` (written by the Celery worker bootstep),
        then ``{ns}:group:<inc>`` and ``{ns}:tomb:<inc>``: two round trips.
        """
        return self._owners.node(name)

    def owner(self, owner_id: str) -> OwnerInfo:
        """One owner (need not be in the active-owners set)."""
        return self._owners.owner(owner_id)

    def locks(self, resources: Sequence[str] | None = None) -> list[LockInfo]:
        """Held locks: of the named ``resources``, or every lock in any registry.

        Without names, walks the active-owners set (SSCAN) and each owner's
        registry (HSCAN; never SCAN/KEYS), so it finds every lock an owner
        registered. A named resource is listed even when free (no holders).
        Sorted by resource name.
        """
        return self._locks.locks(resources)

    # -- summary --------------------------------------------------------------

    def status(self, *, max_owners: int | None = None) -> Status:
        """Counts of owners, registered locks and queued requests, eviction policy, fence.

        Per batch of owners one pipeline (EXISTS, HKEYS of the registry,
        HVALS of the waits hash, HLEN of its bucket index, each), then one
        ``HRANDFIELD`` per resource held (its mode: are limited resources
        among them?) and one ``HVALS`` per limited one, pipelined in
        batches (:meth:`summary`). With ``max_owners``, stops after that
        many owners (``truncated``), which bounds the cost of a periodic
        caller (the metrics endpoint).
        """
        return self.summary(max_owners=max_owners).status

    def limited(self, *, max_owners: int | None = None) -> list[LimitedInfo]:
        """Every limited resource held or waited for: slots held, limit, queue.

        Busiest first (most requests queued, then most slots held). The
        walk of :meth:`status` (its cost, its ``max_owners``): the resources
        the owners' registries name and their waits hashes queue for.
        """
        return list(self.summary(max_owners=max_owners).limited)

    def summary(self, *, max_owners: int | None = None) -> Summary:
        """:meth:`status` and :meth:`limited` from one walk of the owners."""
        return self._summary.summary(max_owners=max_owners)

    # -- release planning -----------------------------------------------------

    def plan_owner(self, owner_id: str) -> ReleasePlan:
        """What ``cleanup_owner(owner_id)`` would free: the owner's registry."""
        validate_owner_id(owner_id)
        info = self.owner(owner_id)
        regs = self.registries([owner_id])[owner_id]
        if not info.alive and not regs:
            member = self._reader.call(
                "SISMEMBER", lambda: self.client.sismember(self.keys.owners, owner_id)
            )
            if not member:
                return ReleasePlan(owners=(), resources={}, missing=(owner_id,))
        return ReleasePlan(
            owners=(info,),
            resources={owner_id: tuple(self.resource_of(k) for k in regs)},
        )

    def plan_resource(self, resource: str, *, force: bool = False) -> ReleasePlan:
        """Owners to clean up so that ``resource``'s holders let go of it.

        Cleanup is per owner: each owner listed loses *every* lock in its
        registry, not only ``resource`` (the plan names them all). Dead
        holders' owners are always planned; live ones only with ``force``,
        else they are returned in ``kept``.
        """
        force = _v.flag("force", force)
        holders = self.holders(resource)
        chosen = [h for h in holders if force or not h.alive]
        kept = tuple(h for h in holders if not (force or not h.alive))
        owners = list(dict.fromkeys(h.owner_id for h in chosen))
        infos = tuple(self._owners.owner_infos(owners)) if owners else ()
        regs = self.registries(owners) if owners else {}
        return ReleasePlan(
            owners=infos,
            resources={o: tuple(self.resource_of(k) for k in regs.get(o, [])) for o in owners},
            kept=kept,
        )
