"""The records an :class:`~celery_redislock.Inspector` returns, and how replies become them.

Frozen dataclasses (``as_dict()`` gives what ``--json`` prints) and the
pure functions that read the values the scripts store (a liveness value's
fields, a grant's limit, a request's modes, a holder record). No I/O: the
inspector's views fetch, this module parses. Every record is importable
from :mod:`celery_redislock.ops.inspector` too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..protocol.keys import FORMAT_VERSION, text

_FIELD_RE = re.compile(r"(\w+)=(\S+)")


def is_spilled(index_len: Any) -> bool:
    """Whether an HLEN reply of a registry's bucket index says it spilled."""
    return not isinstance(index_len, Exception) and int(index_len) > 0


def opt_text(value: Any) -> str | None:
    """A reply as text (undecodable bytes replaced), None for None."""
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


def holder_fields(value: Any) -> tuple[str | None, str | None, str | None]:
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
    """How many requests wait for one resource (:meth:`~celery_redislock.Inspector.queue_lengths`)."""

    resource: str
    waiting: int


@dataclass(frozen=True)
class LimitedInfo(_Record):
    """One limited resource (``limited={name: N}``): slots held, limit, queue.

    Found by :meth:`~celery_redislock.Inspector.limited` from the owners' registries (the
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
    """What one walk of the owners found (:meth:`~celery_redislock.Inspector.summary`)."""

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


def waited_names(value: Any) -> list[str]:
    """The resource names of one waits-hash value ``modes\nname\nname...``."""
    if value is None or isinstance(value, Exception):
        return []
    return [n for n in text(value, "replace").split("\n")[1:] if n]


def by_length(counts: dict[str, int]) -> list[QueueLength]:
    """Longest queue first, then by name."""
    return [
        QueueLength(name, n) for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


@dataclass(frozen=True)
class Usage(_Record):
    """Whether anything ever used a namespace (one round trip, see :meth:`~celery_redislock.Inspector.usage`)."""

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

    Built by :meth:`~celery_redislock.Inspector.plan_owner` / :meth:`~celery_redislock.Inspector.plan_resource`
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
