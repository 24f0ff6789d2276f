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

import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import redis

from .. import _validate as _v
from ..engine.identity import pid_of_tag
from ..engine.manager import REDIS_DOWN_ERRORS, LockManager, format_verdict
from ..exceptions import ConfigurationError, RedisUnavailable, permission_denied
from ..protocol.keys import (
    FORMAT_VERSION,
    MODE_NAMES,
    UNVERSIONED_FORMAT,
    grant_limit,
    holder_info_of,
    owner_of_token,
    parse_grant,
    registry_bucket,
    text,
    validate_node_name,
    validate_owner_id,
    validate_resource,
)
from ..redact import redact_url as redact_url  # old name, kept importable
from ..store.checks import check_eviction

_T = TypeVar("_T")

#: Default number of commands per round trip (SSCAN COUNT, pipeline size).
DEFAULT_BATCH_SIZE = 500
#: Most waiters ``waiters()`` lists by default, and at most.
DEFAULT_WAITER_LIMIT = 1000
MAX_WAITER_LIMIT = 100_000


_FIELD_RE = re.compile(r"(\w+)=(\S+)")


def _command_name(queued: Any) -> str:
    """The command of a queued pipeline entry: ``(args, options)`` for a
    Redis pipeline, a ``PipelineCommand`` (``.args``) for a cluster one."""
    args = getattr(queued, "args", None)
    if args is None:
        args = queued[0]
    return str(args[0]).upper() if args else "?"


def _is_spilled(index_len: Any) -> bool:
    """Whether an HLEN reply of a registry's bucket index says it spilled."""
    return not isinstance(index_len, Exception) and int(index_len) > 0


def _task_name(raw: str | None) -> str | None:
    """The task name in a park record's message (JSON), or None."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    name = value.get("name") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


def _opt_text(value: Any) -> str | None:
    return None if value is None else text(value, "replace")


def describe_fields(description: str | None) -> dict[str, str]:
    """The ``key=value`` fields of a liveness value (``pid=1 host=h name=n``)."""
    if not description:
        return {}
    return dict(_FIELD_RE.findall(description))


# ---------------------------------------------------------------- records


class _Record:
    """Base of the records below: ``as_dict()`` for ``--json`` output."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a dict (nested records too), as ``--json`` prints it."""
        record: dict[str, Any] = asdict(self)  # type: ignore[call-overload]
        return record


@dataclass(frozen=True)
class Liveness(_Record):
    """An owner's liveness as read from ``{ns}:alive:<owner>``.

    ``ttl`` is the seconds left before the owner is dead (None when the key
    has no expiry or the owner is dead); ``description`` is the key's value
    (``pid=... host=... name=...``), None when dead.
    """

    owner_id: str
    alive: bool
    ttl: float | None
    description: str | None


@dataclass(frozen=True)
class _Grant(_Record):
    """What a :class:`Holder` and a :class:`Waiter` both say: the resource,
    the grant's (or queued request's) token and mode, and its owner's
    liveness."""

    resource: str
    token: str
    owner_id: str
    mode: str
    alive: bool
    ttl: float | None
    description: str | None


@dataclass(frozen=True)
class _InLine(_Record):
    """A :class:`Waiter`'s first two fields. A dataclass takes its fields
    from its bases in reverse order of the MRO, a field it meets again
    keeping its first place: ``Waiter(_Grant, _InLine)`` has ``resource``
    and ``position`` first, then ``_Grant``'s others, so its repr,
    positional arguments and ``as_dict()`` (``--json``) keep that order."""

    resource: str
    position: int


@dataclass(frozen=True)
class Holder(_Grant):
    """One grant stored in a lock hash."""

    #: Fencing token of the grant (stored with it in the lock hash).
    fence: int | None = None
    #: The Celery task holding it (name, id) and its worker node, when the
    #: grant was taken by a task (its holder record); None otherwise.
    task_name: str | None = None
    task_id: str | None = None
    node: str | None = None
    #: For a slot of a limited resource, the limit its request asked for
    #: (stored with the grant); None for the other modes.
    limit: int | None = None


def _holder_fields(value: Any) -> tuple[str | None, str | None, str | None]:
    """``(task name, task id, node)`` of a holder record's ``name\nid\nnode``."""
    if value is None or isinstance(value, Exception):
        return None, None, None
    parts = text(value, "replace").split("\n")
    parts += [""] * (3 - len(parts))
    name, task_id, node = parts[:3]
    return name or None, task_id or None, node or None


@dataclass(frozen=True)
class Waiter(_Grant, _InLine):
    """One queued request of a resource, in serving order (``position`` 1 first)."""

    #: A nested request (made from inside a held lock) sorts before the others.
    nested: bool
    #: ``queued``; ``parked`` (a deferred task, docs/defer.md); ``granted``
    #: (about to leave the queue); ``expired`` (its request record is gone:
    #: a stale entry the next script removes).
    state: str
    #: Id of the Celery task that made the request (a parked deferred task,
    #: or a task waiting in ``on_busy="wait"``, from its holder record), else None.
    task_id: str | None = None
    #: Name of that task, else None.
    task_name: str | None = None
    #: For a request of a slot of a limited resource, the limit it asked
    #: for; None for the other modes (or an expired request).
    limit: int | None = None


@dataclass(frozen=True)
class LockInfo(_Record):
    """A lock key found in a registry (or named by the caller)."""

    resource: str
    key: str
    holders: tuple[Holder, ...]
    #: Entries in the resource's wait queue (including stale ones).
    waiting: int
    #: None for a lock hash; the Redis type otherwise (kept by cleanup, see
    #: invariant 4: an odd key is reported, never silently dropped).
    odd_type: str | None = None
    #: The limit of a limited resource, the one the most recent slot's
    #: request asked for (highest fencing token); None unless slots are held.
    limit: int | None = None
    #: Every limit its holders' requests asked for, in ascending order (two
    #: while a rolling deploy changes the limit, see :func:`limit_of_slots`).
    limits: tuple[int, ...] = ()

    @property
    def slots(self) -> str | None:
        """``"3/5"`` (slots held / :attr:`limit`) for a limited resource, else None."""
        return None if self.limit is None else f"{len(self.holders)}/{self.limit}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "key": self.key,
            "holders": [h.as_dict() for h in self.holders],
            "waiting": self.waiting,
            "odd_type": self.odd_type,
            "limit": self.limit,
            "limits": list(self.limits),
        }


@dataclass(frozen=True)
class OwnerInfo(_Record):
    """An owner from the active-owners set, with its registry size."""

    owner_id: str
    alive: bool
    ttl: float | None
    description: str | None
    #: Lock keys in its registry ``{ns}:held:<owner>``.
    locks: int
    pid: int | None = None
    host: str | None = None
    #: Celery node name and incarnation, when the integration recorded them.
    node: str | None = None
    incarnation: str | None = None
    #: True when the incarnation's group hash lists this owner.
    in_group: bool | None = None
    #: True when the incarnation was tombstoned (evicted by its successor).
    tombstoned: bool | None = None


@dataclass(frozen=True)
class NodeInfo(_Record):
    """A Celery worker node's record ``{ns}:node:<name>`` and its group.

    ``record`` is the hash as stored (``inc``, ``hb``, ``hb_ms``, ``iv``,
    ``pid``, ``host``, ...); ``owners`` maps each owner of the current
    incarnation's group ``{ns}:group:<inc>`` to its pid (parsed from the
    process tag stored there).
    """

    name: str
    incarnation: str | None
    record: dict[str, str]
    owners: dict[str, int]
    tombstoned: bool


@dataclass(frozen=True)
class Status(_Record):
    """A summary of one namespace."""

    namespace: str
    url: str
    redis_version: str | None
    eviction_policy: str | None
    may_evict: bool
    eviction_note: str
    #: Last fencing token handed out (None before the first acquisition).
    fence: int | None
    owners: int
    alive_owners: int
    dead_owners: int
    #: Sum of registry sizes (a lock shared by two owners counts twice).
    registered_locks: int
    #: Registry entries of dead owners (what ``reconcile`` would free).
    dead_owner_locks: int
    warnings: list[str] = field(default_factory=list)
    #: The namespace's data-format version (``{ns}:format``; None before
    #: any process used it) and this release's.
    format_version: int | None = None
    release_format: int = FORMAT_VERSION
    #: Queued requests (entries of the owners' waits hashes).
    waiting_requests: int = 0
    #: True when ``status(max_owners=N)`` stopped after N owners: the counts
    #: cover those only.
    truncated: bool = False
    #: Owners holding at least one lock, and owners that hold none and only
    #: wait (queued requests); the rest are idle (registered, nothing yet).
    holding_owners: int = 0
    waiting_only_owners: int = 0
    #: The resource with the most queued requests, and how many (None, 0
    #: when nothing waits).
    busiest_resource: str | None = None
    busiest_waiting: int = 0
    #: Limited resources (``limited={name: N}``) held or waited for, the
    #: slots their holders take (dead holders' included, until freed) and
    #: the requests queued for one of them (see :class:`LimitedInfo`).
    limited_resources: int = 0
    limited_slots: int = 0
    limited_waiting: int = 0


@dataclass(frozen=True)
class QueueLength(_Record):
    """How many requests wait for one resource (:meth:`Inspector.queue_lengths`)."""

    resource: str
    waiting: int


@dataclass(frozen=True)
class LimitedInfo(_Record):
    """One limited resource (``limited={name: N}``): slots held, limit, queue.

    Found by :meth:`Inspector.limited` from the owners' registries (the
    resources they hold, each read once: one ``HRANDFIELD`` tells its mode)
    and their waits hashes (the requests queued for it).
    """

    resource: str
    #: The slots held, as the lock hash's grants (a dead holder's slot counts
    #: until it is freed, as in ``redislock locks``).
    slots: int
    #: The limit the most recent slot's request asked for (None when no slot
    #: is held, only requests wait); see :func:`limit_of_slots`.
    limit: int | None
    #: Every limit the holders' requests asked for, ascending.
    limits: tuple[int, ...]
    #: Requests queued for a slot (from the owners' waits hashes).
    waiting: int

    def as_dict(self) -> dict[str, Any]:
        record = super().as_dict()
        record["limits"] = list(self.limits)
        return record


@dataclass(frozen=True)
class Summary:
    """What one walk of the owners found (:meth:`Inspector.summary`)."""

    status: Status
    #: The limited resources, busiest first (most requests queued, then most
    #: slots held, then by name).
    limited: tuple[LimitedInfo, ...]


def limit_of_slots(
    grants: Iterable[tuple[int | None, int | None]],
) -> tuple[int | None, tuple[int, ...]]:
    """The limit shown for a limited resource, and every limit its holders
    asked for, from its slots' ``(fencing token, limit)``.

    A limit belongs to each request, so while a rolling deploy changes it
    the holders carry two. The one shown is the most recent grant's (the
    highest fencing token), the limit that let the last holder in: each
    grant leaves at most its own N holders and only leaves follow it until
    the next grant, so the slots held never exceed it (``3/5``, never
    ``4/3``). While both releases request slots it follows whichever was
    granted last; ``limits`` then lists both (docs/design.md, "Two limits
    for one resource").
    """
    best: tuple[int, int] | None = None
    seen: set[int] = set()
    for fence, limit in grants:
        if limit is None:
            continue
        seen.add(limit)
        key = (fence if fence is not None else -1, limit)
        if best is None or key > best:
            best = key
    return (best[1] if best is not None else None), tuple(sorted(seen))


def request_modes(spec: str, names: Sequence[str]) -> dict[str, tuple[str, int | None]]:
    """``name -> (mode letter, limit or None)`` of a request's modes spec
    (``xl:5``: one letter per resource, then the limits of its ``l`` ones)
    and its resource names, as the request state and the waits hash store them."""
    modes, _, tail = spec.partition(":")
    limits = [int(n) if n.isdigit() else None for n in tail.split(",")] if tail else []
    out: dict[str, tuple[str, int | None]] = {}
    k = 0
    for i, name in enumerate(names):
        mode = modes[i : i + 1]
        limit = None
        if mode == "l":
            limit = limits[k] if k < len(limits) else None
            k += 1
        out[name] = (mode, limit)
    return out


def _waited_names(value: Any) -> list[str]:
    """The resource names of one waits-hash value ``modes\nname\nname...``."""
    if value is None or isinstance(value, Exception):
        return []
    return [n for n in text(value, "replace").split("\n")[1:] if n]


def _limited_names(value: Any) -> list[str]:
    """The names a waits-hash value ``modes\nname...`` queues for a slot of."""
    parts = text(value, "replace").split("\n")
    return [n for n, (m, _) in request_modes(parts[0], parts[1:]).items() if m == "l" and n]


def _by_length(counts: dict[str, int]) -> list[QueueLength]:
    """Longest queue first, then by name."""
    return [
        QueueLength(name, n) for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


@dataclass(frozen=True)
class Usage(_Record):
    """Whether anything ever used a namespace (one round trip, see :meth:`Inspector.usage`)."""

    #: The format in ``{ns}:format`` (or inferred from older data), None if unset.
    format_version: int | None
    #: True when the fencing counter exists (something acquired a lock here).
    fenced: bool
    #: How many owners the active-owners set has.
    owners: int

    @property
    def used(self) -> bool:
        """False for a namespace no process ever used (or whose data Redis lost)."""
        return self.format_version is not None or self.fenced or self.owners > 0


@dataclass(frozen=True)
class ReleasePlan(_Record):
    """What freeing some owners would release: each owner and its locks.

    Built by :meth:`Inspector.plan_owner` / :meth:`Inspector.plan_resource`
    before anything is freed, so the operator can confirm. ``owners`` are
    the owners the release would clean up; ``kept`` the live holders left
    alone because ``force`` was not given.
    """

    owners: tuple[OwnerInfo, ...]
    #: owner id -> resources in its registry (every one would be freed).
    resources: dict[str, tuple[str, ...]]
    kept: tuple[Holder, ...] = ()
    #: Owner ids asked for that Redis knows nothing of (no liveness key, no
    #: registered lock, not in the active-owners set).
    missing: tuple[str, ...] = ()

    @property
    def live_owners(self) -> tuple[OwnerInfo, ...]:
        return tuple(o for o in self.owners if o.alive)

    def as_dict(self) -> dict[str, Any]:
        return {
            "owners": [
                dict(o.as_dict(), resources=list(self.resources.get(o.owner_id, ())))
                for o in self.owners
            ],
            "kept": [h.as_dict() for h in self.kept],
            "missing": list(self.missing),
        }


# ---------------------------------------------------------------- inspector


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

    One class holds every view (about 740 lines), so that the CLI, the
    metrics collector and users' scripts read the namespace the same
    batched way; its batched readers and its release plans are the parts to
    move out first when it grows.
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
        self._usage: Usage | None = None

    # -- format -------------------------------------------------------------

    def usage(self) -> Usage:
        """The namespace's format and whether it was ever used (one round trip).

        GET ``{ns}:format``, EXISTS ``{ns}:fence``, SCARD ``{ns}:owners``;
        read once per inspector, before its first other read. Never writes.
        Raises :class:`~celery_redislock.exceptions.FormatMismatch` when the
        namespace holds lock data of another format than this release reads.
        """
        if self._usage is None:
            pipe = self._pipe()
            pipe.get(self.keys.format)
            pipe.exists(self.keys.fence)
            pipe.scard(self.keys.owners)
            self._usage = Usage(None, False, 0)  # _run below must not recurse here
            try:
                stored, fenced, owners = self._run(pipe)
            except BaseException:
                self._usage = None
                raise
            fenced = bool(fenced) and not isinstance(fenced, Exception)
            how = "stored"
            found = None if isinstance(stored, Exception) else _opt_text(stored)
            if found is None and fenced:
                found, how = str(UNVERSIONED_FORMAT), "unversioned"
            try:
                version = format_verdict(self.keys.namespace, self.manager.url, found, how)
            except BaseException:
                self._usage = None
                raise
            self._usage = Usage(
                version, fenced, 0 if isinstance(owners, Exception) else int(owners)
            )
        return self._usage

    # -- plumbing ---------------------------------------------------------

    def _run(self, pipe: Any) -> list[Any]:
        """Execute a pipeline; replies that are errors stay in the list, but a
        refusal by the ACL raises :class:`PermissionDenied` (an unreadable
        key must never read as an absent one: a live owner as DEAD)."""
        if self._usage is None:
            self.usage()
        sent = [_command_name(c) for c in pipe.command_stack]
        try:
            replies = list(pipe.execute(raise_on_error=False))
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.manager.url, exc) from exc
        for command, reply in zip(sent, replies):
            if isinstance(reply, Exception):
                denied = permission_denied(reply, self.manager.url, command)
                if denied is not None:
                    raise denied from reply
        return replies

    def _call(self, command: str, fn: Callable[[], Any]) -> Any:
        """One command: Redis down -> RedisUnavailable; refused -> PermissionDenied."""
        if self._usage is None:
            self.usage()
        try:
            return fn()
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.manager.url, exc) from exc
        except redis.ResponseError as exc:
            denied = permission_denied(exc, self.manager.url, command)
            if denied is not None:
                raise denied from exc
            raise

    def _pipe(self) -> Any:
        return self.client.pipeline(transaction=False)

    def _batches(self, items: Sequence[_T]) -> Iterator[Sequence[_T]]:
        for i in range(0, len(items), self.batch_size):
            yield items[i : i + self.batch_size]

    def _sscan(self, key: str) -> Iterator[list[str]]:
        """Members of a set, one SSCAN batch at a time (deduplicated)."""
        return self._scan("SSCAN", self.client.sscan, key)

    def _hscan_keys(self, key: str) -> Iterator[list[str]]:
        """Field names of a hash, one HSCAN batch at a time (deduplicated)."""
        return self._scan("HSCAN", self.client.hscan, key)

    def _scan(self, name: str, scan: Callable[..., Any], key: str) -> Iterator[list[str]]:
        """What ``scan`` (SSCAN, HSCAN) walks of ``key``: names, one batch
        at a time, each name once (a cursor may return one twice)."""
        seen: set[str] = set()
        cursor: int = 0
        while True:
            cursor, found = self._call(
                name, functools.partial(scan, key, cursor, count=self.batch_size)
            )
            # HSCAN answers a mapping field -> value; SSCAN a list of members.
            batch = [n for n in (text(x, "replace") for x in found) if n not in seen]
            seen.update(batch)
            if batch:
                yield batch
            if int(cursor) == 0:
                return

    def owner_ids(self) -> Iterator[list[str]]:
        """Batches of the ids in the active-owners set (SSCAN, never SCAN)."""
        return self._sscan(self.keys.owners)

    def registry(self, owner_id: str) -> list[str]:
        """The lock keys of one owner's registry (HSCAN in batches).

        The registry holds resource names; they are returned as the lock keys
        ``{ns}:lock:<resource>``.
        """
        validate_owner_id(owner_id)
        out: list[str] = []
        seen: set[str] = set()
        held = [self.keys.held(owner_id)]
        # An owner holding many locks keeps further names in buckets that its
        # bucket index lists (docs/design.md, "Data model").
        for batch in self._hscan_keys(self.keys.held_index(owner_id)):
            held.extend(self.keys.held_bucket(owner_id, b) for b in batch)
        for key in held:
            for batch in self._hscan_keys(key):
                new = [name for name in batch if name not in seen]
                seen.update(new)
                out.extend(self.keys.lock(name) for name in new)
        return out

    def _registry_sizes(self, owners: Sequence[str]) -> dict[str, int]:
        """Registry size of each owner: one pipelined HLEN of its registry and
        of its bucket index per batch; a registry that spilled is then read."""
        sizes: dict[str, int] = {}
        for batch in self._batches(owners):
            pipe = self._pipe()
            for owner in batch:
                pipe.hlen(self.keys.held(owner))
                pipe.hlen(self.keys.held_index(owner))
            replies = self._run(pipe)
            for j, owner in enumerate(batch):
                n, spilled = replies[2 * j], replies[2 * j + 1]
                if _is_spilled(spilled):
                    sizes[owner] = len(self.registry(owner))
                else:
                    sizes[owner] = 0 if isinstance(n, Exception) else int(n)
        return sizes

    def registries(self, owners: Sequence[str]) -> dict[str, list[str]]:
        """The registries of many owners (as lock keys): one pipelined HSCAN per
        batch of owners, then further HSCANs only for the (large) registries
        not done yet."""
        out: dict[str, list[str]] = {}
        for batch in self._batches(owners):
            pipe = self._pipe()
            for owner in batch:
                pipe.hscan(self.keys.held(owner), 0, count=self.batch_size)
                pipe.hlen(self.keys.held_index(owner))
            replies = self._run(pipe)
            for j, owner in enumerate(batch):
                reply, spilled = replies[2 * j], replies[2 * j + 1]
                if isinstance(reply, Exception):
                    out[owner] = []
                    continue
                cursor, fields = reply
                if int(cursor) == 0 and not _is_spilled(spilled):
                    out[owner] = sorted({self.keys.lock(text(f, "replace")) for f in fields})
                else:
                    out[owner] = sorted(set(self.registry(owner)))
        return out

    def liveness(self, owners: Iterable[str]) -> dict[str, Liveness]:
        """PTTL and value of each owner's liveness key (pipelined in batches)."""
        if isinstance(owners, str):
            raise ConfigurationError("owners", f"must be an iterable of owner ids, not {owners!r}")
        wanted = list(dict.fromkeys(owners))
        out: dict[str, Liveness] = {}
        for batch in self._batches(wanted):
            pipe = self._pipe()
            for owner in batch:
                key = self.keys.alive(owner)
                pipe.pttl(key)
                pipe.get(key)
            replies = self._run(pipe)
            for i, owner in enumerate(batch):
                pttl, value = replies[2 * i], replies[2 * i + 1]
                pttl = -2 if isinstance(pttl, Exception) else int(pttl)
                alive = pttl != -2
                ttl = pttl / 1000.0 if pttl >= 0 else None
                desc = None if isinstance(value, Exception) else _opt_text(value)
                out[owner] = Liveness(owner, alive, ttl, desc if alive else None)
        return out

    # -- holders and waiters ---------------------------------------------

    def holders(self, resource: str) -> list[Holder]:
        """Every grant on ``resource``: token, owner, mode, owner liveness.

        Two round trips (the lock hash, which also holds each grant's fencing
        token, then the owners' liveness). Exclusive first, then by owner.
        """
        return list(self.lock_info(resource).holders)

    def lock_info(self, resource: str) -> LockInfo:
        """The holders and wait-queue length of one resource."""
        validate_resource(resource)
        return self._lock_infos([self.keys.lock(resource)])[0]

    def _lock_infos(self, lock_keys: Sequence[str]) -> list[LockInfo]:
        raw: list[tuple[str, Any, Any]] = []
        for batch in self._batches(lock_keys):
            pipe = self._pipe()
            for key in batch:
                pipe.hgetall(key)
                pipe.zcard(self.keys.queue(self.resource_of(key)))
            replies = self._run(pipe)
            for i, key in enumerate(batch):
                raw.append((key, replies[2 * i], replies[2 * i + 1]))
        # odd types: ask what they are (rare; one round trip per batch)
        odd = [key for key, h, _ in raw if isinstance(h, Exception)]
        types: dict[str, str] = {}
        for batch in self._batches(odd):
            pipe = self._pipe()
            for key in batch:
                pipe.type(key)
            for key, t in zip(batch, self._run(pipe)):
                types[key] = text(t, "replace")
        grants: list[tuple[str, str, str, int | None]] = []  # key, token, mode, fence
        limits: dict[tuple[str, str], int] = {}  # (key, token) -> limit of a slot
        for key, h, _ in raw:
            if isinstance(h, dict):
                for token, value in h.items():
                    grant = text(value, "replace")
                    grants.append((key, text(token, "replace"), *parse_grant(grant)))
                    limit = grant_limit(grant)
                    if limit is not None:
                        limits[key, grants[-1][1]] = limit
        live = self.liveness(owner_of_token(t) for _, t, _, _ in grants)
        tasks = self._holder_infos([(self.resource_of(k), t) for k, t, _, _ in grants])
        holders: dict[str, list[Holder]] = {}
        for key, token, mode, fence in grants:
            owner = owner_of_token(token)
            lv = live[owner]
            task_name, task_id, node = tasks.get(token, (None, None, None))
            holders.setdefault(key, []).append(
                Holder(
                    resource=self.resource_of(key),
                    token=token,
                    owner_id=owner,
                    mode=MODE_NAMES.get(mode, mode),
                    alive=lv.alive,
                    ttl=lv.ttl,
                    description=lv.description,
                    fence=fence,
                    task_name=task_name,
                    task_id=task_id,
                    node=node or describe_fields(lv.description).get("name"),
                    limit=limits.get((key, token)),
                )
            )
        out: list[LockInfo] = []
        for key, _h, waiting in raw:
            hs = sorted(holders.get(key, []), key=lambda x: (x.mode != "exclusive", x.owner_id))
            limit, all_limits = limit_of_slots((h.fence, h.limit) for h in hs)
            out.append(
                LockInfo(
                    resource=self.resource_of(key),
                    key=key,
                    holders=tuple(hs),
                    waiting=0 if isinstance(waiting, Exception) else int(waiting),
                    odd_type=types.get(key),
                    limit=limit,
                    limits=all_limits,
                )
            )
        return out

    def _holder_infos(
        self, grants: Sequence[tuple[str, str]]
    ) -> dict[str, tuple[str | None, str | None, str | None]]:
        """Task name, id and node of each ``(resource, token)`` grant taken by
        a task, by token.

        The holder record is the resource's value in the owner's registry
        (its main hash, or the name's bucket when the registry spilled),
        when it names the token's request; an earlier release kept it in
        ``{ns}:holder:<token>``, read last. Three reads per grant, pipelined
        in batches.
        """
        out: dict[str, tuple[str | None, str | None, str | None]] = {}
        wanted = list(dict.fromkeys(grants))
        for batch in self._batches(wanted):
            pipe = self._pipe()
            for resource, token in batch:
                owner = owner_of_token(token)
                pipe.hget(self.keys.held(owner), resource)
                pipe.hget(self.keys.held_bucket(owner, registry_bucket(resource)), resource)
                pipe.get(self.keys.holder(token))
            replies = self._run(pipe)
            for i, (_resource, token) in enumerate(batch):
                info = None
                for record in replies[3 * i : 3 * i + 2]:
                    if info is None and isinstance(record, (str, bytes)):
                        info = holder_info_of(text(record, "replace"), token)
                legacy = replies[3 * i + 2]
                if info is None and isinstance(legacy, (str, bytes)):
                    info = text(legacy, "replace")
                out[token] = _holder_fields(info)
        return out

    def resource_of(self, lock_key: str) -> str:
        """The resource of a lock key (the key itself when it is not one)."""
        try:
            return self.keys.resource_of(lock_key)
        except ValueError:
            return lock_key

    def waiters(self, resource: str, *, limit: int = DEFAULT_WAITER_LIMIT) -> list[Waiter]:
        """Queued requests of ``resource`` in the order they will be served.

        Reads at most ``limit`` queue entries (the queue is a zset scored by
        arrival; nested requests sort first), then each owner's liveness and
        each request's state: two round trips per batch.
        """
        validate_resource(resource)
        limit = _v.integer("limit", limit, minimum=1, maximum=MAX_WAITER_LIMIT)
        try:
            entries: Any = self._call(
                "ZRANGE",
                lambda: self.client.zrange(
                    self.keys.queue(resource), 0, limit - 1, withscores=True
                ),
            )
        except redis.ResponseError:
            return []  # not a zset: nothing the engine queued
        parsed = [(text(m, "replace"), float(score)) for m, score in entries]
        tokens = [m[1:] for m, _ in parsed]
        live = self.liveness(owner_of_token(t) for t in tokens)
        states, tasks, asked = self._request_records(tokens, resource)
        parked = self._parked_tasks(tokens)
        out: list[Waiter] = []
        for pos, ((member, score), token) in enumerate(zip(parsed, tokens), start=1):
            owner = owner_of_token(token)
            lv = live[owner]
            st = states.get(token)
            is_parked = token in parked
            out.append(
                Waiter(
                    resource=resource,
                    position=pos,
                    token=token,
                    owner_id=owner,
                    mode=MODE_NAMES.get(member[:1], member[:1]),
                    alive=lv.alive,
                    ttl=lv.ttl,
                    description=lv.description,
                    nested=score < 0,
                    state=(
                        "expired"
                        if st not in ("q", "g")
                        else "parked"
                        if is_parked and st == "q"
                        else {"q": "queued", "g": "granted"}[st or "q"]
                    ),
                    task_id=(
                        token.split("|task:", 1)[1]
                        if is_parked
                        else tasks.get(token, (None, None))[1]
                    ),
                    task_name=parked.get(token) if is_parked else tasks.get(token, (None,))[0],
                    limit=asked.get(token),
                )
            )
        return out

    def _request_records(
        self, tokens: Sequence[str], resource: str
    ) -> tuple[
        dict[str, str | None], dict[str, tuple[str | None, str | None]], dict[str, int | None]
    ]:
        """Each queued request's state (``q``, ``g``; None when its record
        is gone), for a request a Celery task made, that task's name and
        id (from the holder record it carries), and for a request of a slot
        of ``resource``, the limit it asked for (from its modes spec): one
        HMGET per request, pipelined in batches."""
        states: dict[str, str | None] = {}
        tasks: dict[str, tuple[str | None, str | None]] = {}
        asked: dict[str, int | None] = {}
        for batch in self._batches(tokens):
            pipe = self._pipe()
            for token in batch:
                pipe.hmget(self.keys.req(token), "state", "holder", "modes", "res")
            for token, got in zip(batch, self._run(pipe)):
                if isinstance(got, Exception):
                    states[token] = None
                    continue
                states[token] = _opt_text(got[0])
                record = _opt_text(got[1])
                info = holder_info_of(record, token) if record else None
                if info is not None:
                    name, task_id, _node = _holder_fields(info)
                    tasks[token] = (name, task_id)
                spec, res = _opt_text(got[2]), _opt_text(got[3])
                if spec and res and "l" in spec.partition(":")[0]:
                    asked[token] = request_modes(spec, res.split("\n")).get(resource, ("", None))[1]
        return states, tasks, asked

    def _parked_tasks(self, tokens: Sequence[str]) -> dict[str, str | None]:
        """token -> task name of each request a parked deferred task made
        (its park record names the token): one HMGET per task owner's
        request, pipelined in batches."""
        parked: dict[str, str | None] = {}
        deferred = [t for t in tokens if "|task:" in t]
        for batch in self._batches(deferred):
            pipe = self._pipe()
            for token in batch:
                pipe.hmget(
                    self.keys.prefix + "defer:" + token.split("|task:", 1)[1], "token", "msg"
                )
            for token, got in zip(batch, self._run(pipe)):
                if isinstance(got, Exception) or _opt_text(got[0]) != token:
                    continue
                parked[token] = _task_name(_opt_text(got[1]))
        return parked

    def queue_lengths(self) -> list[QueueLength]:
        """Every resource somebody waits for, with its number of queued requests.

        Longest queue first. Read from the owners' waits hashes (one pipeline
        per batch of owners: HVALS each), never by scanning the keyspace: the
        cost is O(owners + their queued requests).
        """
        counts: dict[str, int] = {}
        for batch in self.owner_ids():
            pipe = self._pipe()
            for owner in batch:
                pipe.hvals(self.keys.waits(owner))
            for values in self._run(pipe):
                if isinstance(values, Exception):
                    continue
                for value in values:
                    for name in _waited_names(value):
                        counts[name] = counts.get(name, 0) + 1
        return _by_length(counts)

    # -- owners and locks --------------------------------------------------

    def owners(self, nodes: Sequence[str] = ()) -> list[OwnerInfo]:
        """Every owner in the active-owners set: liveness, registry size, node.

        Per batch of owners: one pipeline (PTTL, GET, HLEN each), plus one
        for group/tombstone lookups when owners name an incarnation. With
        ``nodes`` (Celery node names), the owners of each node's current
        incarnation are labelled with it (two round trips per node, see
        :meth:`node`); the keyspace is never searched for nodes.
        """
        if isinstance(nodes, str):
            raise ConfigurationError("nodes", f"must be a sequence of node names, not {nodes!r}")
        nodes = [validate_node_name(n, "nodes") for n in nodes]
        labels: dict[str, tuple[str, str | None, bool]] = {}
        for name in nodes:
            info = self.node(name)
            if info is not None:
                for owner in info.owners:
                    labels[owner] = (name, info.incarnation, info.tombstoned)
        out: list[OwnerInfo] = []
        for batch in self.owner_ids():
            for o in self._owner_infos(batch):
                if o.owner_id in labels:
                    node, inc, tomb = labels[o.owner_id]
                    o = replace(o, node=node, incarnation=inc, in_group=True, tombstoned=tomb)
                out.append(o)
        out.sort(key=lambda o: (o.alive, o.node or "", o.owner_id))
        return out

    def node(self, name: str) -> NodeInfo | None:
        """A worker node's record and its current incarnation's group, or None.

        Reads ``{ns}:node:<name>`` (written by the Celery worker bootstep),
        then ``{ns}:group:<inc>`` and ``{ns}:tomb:<inc>``: two round trips.
        """
        validate_node_name(name, "node")
        prefix = self.keys.prefix
        try:
            raw = self._call("HGETALL", lambda: self.client.hgetall(f"{prefix}node:{name}"))
        except redis.ResponseError:
            return None  # not a hash: no node record
        if not raw:
            return None
        record = {text(k, "replace"): text(v, "replace") for k, v in raw.items()}
        inc = record.get("inc")
        owners: dict[str, int] = {}
        tomb = False
        if inc:
            pipe = self._pipe()
            pipe.hgetall(f"{prefix}group:{inc}")
            pipe.exists(f"{prefix}tomb:{inc}")
            group, t = self._run(pipe)
            if isinstance(group, dict):
                for k, v in group.items():
                    try:
                        owners[text(k, "replace")] = pid_of_tag(text(v, "replace"))
                    except ValueError:
                        owners[text(k, "replace")] = -1
            tomb = bool(t) and not isinstance(t, Exception)
        return NodeInfo(name, inc, record, owners, tomb)

    def owner(self, owner_id: str) -> OwnerInfo:
        """One owner (need not be in the active-owners set)."""
        validate_owner_id(owner_id)
        return self._owner_infos([owner_id])[0]

    def _owner_infos(self, owners: Sequence[str]) -> list[OwnerInfo]:
        live = self.liveness(owners)
        sizes = self._registry_sizes(owners)
        fields = {o: describe_fields(live[o].description) for o in owners}
        incs = {o: f.get("inc") or f.get("incarnation") for o, f in fields.items()}
        groups = self._group_info({o: i for o, i in incs.items() if i})
        out: list[OwnerInfo] = []
        for owner in owners:
            lv, f = live[owner], fields[owner]
            pid: int | None
            try:
                pid = int(f["pid"]) if "pid" in f else None
            except ValueError:
                pid = None
            in_group, tomb = groups.get(owner, (None, None))
            out.append(
                OwnerInfo(
                    owner_id=owner,
                    alive=lv.alive,
                    ttl=lv.ttl,
                    description=lv.description,
                    locks=sizes.get(owner, 0),
                    pid=pid,
                    host=f.get("host"),
                    node=f.get("node") or f.get("name"),
                    incarnation=incs[owner],
                    in_group=in_group,
                    tombstoned=tomb,
                )
            )
        return out

    def _group_info(self, incs: dict[str, str]) -> dict[str, tuple[bool, bool]]:
        """owner -> (listed in its incarnation's group hash, incarnation tombstoned)."""
        out: dict[str, tuple[bool, bool]] = {}
        items = list(incs.items())
        prefix = self.keys.prefix
        for i in range(0, len(items), self.batch_size):
            batch = items[i : i + self.batch_size]
            pipe = self._pipe()
            for owner, inc in batch:
                pipe.hexists(f"{prefix}group:{inc}", owner)
                pipe.exists(f"{prefix}tomb:{inc}")
            replies = self._run(pipe)
            for j, (owner, _) in enumerate(batch):
                g, t = replies[2 * j], replies[2 * j + 1]
                out[owner] = (
                    bool(g) and not isinstance(g, Exception),
                    bool(t) and not isinstance(t, Exception),
                )
        return out

    def locks(self, resources: Sequence[str] | None = None) -> list[LockInfo]:
        """Held locks: of the named ``resources``, or every lock in any registry.

        Without names, walks the active-owners set (SSCAN) and each owner's
        registry (HSCAN; never SCAN/KEYS), so it finds every lock an owner
        registered. A named resource is listed even when free (no holders).
        Sorted by resource name.
        """
        if isinstance(resources, str):
            raise ConfigurationError(
                "resources", f"must be a sequence of resource names, not the str {resources!r}"
            )
        if resources:
            keys = [self.keys.lock(validate_resource(r)) for r in dict.fromkeys(resources)]
        else:
            found: set[str] = set()
            for batch in self.owner_ids():
                for regs in self.registries(batch).values():
                    found.update(regs)
            keys = sorted(found)
        infos = self._lock_infos(keys)
        if not resources:
            infos = [i for i in infos if i.holders or i.odd_type]
        return sorted(infos, key=lambda i: i.resource)

    # -- summary -----------------------------------------------------------

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
        # INFO refused by the ACL raises PermissionDenied here (an unknown
        # eviction policy must not pass for an answer); the documented ACL
        # grants it.
        ev = self._call("INFO", lambda: check_eviction(self.client, strict=True))
        server: Any = self._call("INFO", lambda: self.client.info("server"))
        fence = self._call("GET", lambda: self.client.get(self.keys.fence))
        version = server.get("redis_version") if isinstance(server, dict) else None
        owners = alive = dead = registered = dead_locks = waiting = 0
        holding = waiting_only = 0
        per_resource: dict[str, int] = {}
        held_names: set[str] = set()
        limited_queued: set[str] = set()
        truncated = False
        for batch in self.owner_ids():
            if max_owners is not None and owners + len(batch) > max_owners:
                batch = batch[: max(0, max_owners - owners)]
                truncated = True
            for is_alive, held, queued in self._owner_states(batch):
                n = len(held)
                held_names.update(held)
                w = len(queued)
                for value in queued:
                    for name in _waited_names(value):
                        per_resource[name] = per_resource.get(name, 0) + 1
                    if "l" in text(value, "replace").partition("\n")[0].partition(":")[0]:
                        limited_queued.update(_limited_names(value))
                waiting += w
                holding += 1 if n else 0
                waiting_only += 1 if w and not n else 0
                owners += 1
                registered += n
                if is_alive:
                    alive += 1
                else:
                    dead += 1
                    dead_locks += n
            if truncated:
                break
        top = _by_length(per_resource)[:1]
        limited = self._limited_infos(sorted(held_names), limited_queued, per_resource)
        warnings: list[str] = []
        if ev.may_evict:
            warnings.append(ev.describe())
        if dead_locks:
            warnings.append(
                f"{dead} dead owner(s) still hold {dead_locks} lock(s): the next acquirer "
                "reclaims them; `redislock reconcile` frees them now"
            )
        status = Status(
            namespace=self.keys.namespace,
            url=self.manager.url,  # already masked (LockManager.url)
            redis_version=_opt_text(version),
            eviction_policy=ev.policy,
            may_evict=ev.may_evict,
            eviction_note=ev.describe(),
            fence=int(text(fence, "replace")) if fence is not None else None,
            owners=owners,
            alive_owners=alive,
            dead_owners=dead,
            registered_locks=registered,
            dead_owner_locks=dead_locks,
            warnings=warnings,
            format_version=self.usage().format_version,
            waiting_requests=waiting,
            truncated=truncated,
            holding_owners=holding,
            waiting_only_owners=waiting_only,
            busiest_resource=top[0].resource if top else None,
            busiest_waiting=top[0].waiting if top else 0,
            limited_resources=len(limited),
            limited_slots=sum(x.slots for x in limited),
            limited_waiting=sum(x.waiting for x in limited),
        )
        return Summary(status, limited)

    def _limited_infos(
        self, held: Sequence[str], queued: set[str], waiting: dict[str, int]
    ) -> tuple[LimitedInfo, ...]:
        """The limited resources among ``held`` (registered names: one
        ``HRANDFIELD`` each tells the mode, every holder of a lock having
        the same kind) and ``queued`` (names a request queues for a slot
        of): one ``HVALS`` each; ``waiting``: requests queued per name.
        Busiest first."""
        limited = set(queued)
        for batch in self._batches(held):
            pipe = self._pipe()
            for name in batch:
                pipe.hrandfield(self.keys.lock(name), 1, withvalues=True)
            for name, got in zip(batch, self._run(pipe)):
                if isinstance(got, list) and len(got) == 2 and text(got[1], "replace")[:1] == "l":
                    limited.add(name)
        out: list[LimitedInfo] = []
        names = sorted(limited)
        for batch in self._batches(names):
            pipe = self._pipe()
            for name in batch:
                pipe.hvals(self.keys.lock(name))
            for name, got in zip(batch, self._run(pipe)):
                values = [] if isinstance(got, Exception) else [text(v, "replace") for v in got]
                limit, limits = limit_of_slots(
                    (parse_grant(v)[1], grant_limit(v)) for v in values if v[:1] == "l"
                )
                out.append(LimitedInfo(name, len(values), limit, limits, waiting.get(name, 0)))
        return tuple(sorted(out, key=lambda x: (-x.waiting, -x.slots, x.resource)))

    def _owner_states(self, batch: Sequence[str]) -> list[tuple[bool, list[str], list[Any]]]:
        """Per owner of ``batch``: whether it is alive, the resource names in
        its registry and its waits-hash values. One pipeline (EXISTS, HKEYS
        of the registry, HVALS of the waits hash, HLEN of the bucket index,
        each); a registry that spilled is then read."""
        if not batch:
            return []
        pipe = self._pipe()
        for owner in batch:
            pipe.exists(self.keys.alive(owner))
            pipe.hkeys(self.keys.held(owner))
            pipe.hvals(self.keys.waits(owner))
            pipe.hlen(self.keys.held_index(owner))
        replies = self._run(pipe)
        out: list[tuple[bool, list[str], list[Any]]] = []
        for j, owner in enumerate(batch):
            is_alive, names, queued, spilled = replies[4 * j : 4 * j + 4]
            if _is_spilled(spilled):
                held = [self.resource_of(k) for k in self.registry(owner)]
            else:
                held = [] if isinstance(names, Exception) else [text(x, "replace") for x in names]
            queued = [] if isinstance(queued, Exception) else list(queued)
            out.append((bool(is_alive) and not isinstance(is_alive, Exception), held, queued))
        return out

    # -- release planning ------------------------------------------------

    def plan_owner(self, owner_id: str) -> ReleasePlan:
        """What ``cleanup_owner(owner_id)`` would free: the owner's registry."""
        validate_owner_id(owner_id)
        info = self.owner(owner_id)
        regs = self.registries([owner_id])[owner_id]
        if not info.alive and not regs:
            member = self._call(
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
        infos = tuple(self._owner_infos(owners)) if owners else ()
        regs = self.registries(owners) if owners else {}
        return ReleasePlan(
            owners=infos,
            resources={o: tuple(self.resource_of(k) for k in regs.get(o, [])) for o in owners},
            kept=kept,
        )
