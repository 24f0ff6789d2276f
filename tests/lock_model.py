"""Reference model of the lock protocol, for tests/test_model.py.

Pure Python, no Redis: what the lock semantics of docs/design.md and
docs/fairness.md promise, for simulated owners and their requests. The
state machine in tests/test_model.py drives the real scripts and compares
Redis with this model after every step.

What the model knows exactly is the *live* part of the state: owners whose
liveness key exists, their grants and their queued requests. What dead
owners leave behind (grants not yet reclaimed, queue entries not yet met)
is removed lazily by the scripts, so the model does not predict when it
goes; the test reads that residue from Redis where a prediction depends
on it (the queue scan limit counts dead entries too).
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from celery_redislock.protocol.keys import holder_record

#: A nested request's queue score is its arrival number minus this.
NESTED_OFFSET = 10**15


def purge_budget(limit: int) -> int:
    """Most dead entries (or holders) one scan removes (_common.lua)."""
    return 4 * limit


def conflicts(a: str, b: str) -> bool:
    """Two modes conflict unless both are shared (two limited requests do
    not conflict: they count, ``Model.blockers``)."""
    return a == "x" or b == "x"


def mixed(a: str, b: str) -> bool:
    """Whether modes ``a`` and ``b`` may not meet on one resource: one is
    limited and the other is not (the scripts reply ``{-2, name, mode}``)."""
    return (a == "l") != (b == "l")


def fence_of(value: str) -> int:
    """The fencing token of a lock hash value: ``x<fence>``, ``s<fence>``
    or, for a slot, ``l<fence>:<N>``."""
    return int(value[1:].split(":", 1)[0])


@dataclass
class Owner:
    """One simulated process: an owner id and its liveness."""

    id: str
    #: 'new' (never registered), 'alive' (liveness key exists), 'dead'.
    state: str = "new"
    #: Incarnation whose group the owner registers in (None: no group).
    group: str | None = None
    #: cleanup_owner freed it (the owner is dead and must stay dead).
    cleaned: bool = False
    #: A fake pid, so each owner has its own process tag in a group.
    pid: int = 0

    @property
    def alive(self) -> bool:
        return self.state == "alive"


@dataclass
class Request:
    """One acquisition: a token, its resources and modes, and its state."""

    token: str
    owner: str
    #: resource -> 'x' | 's' | 'l', in the engine's order (exclusive, then
    #: shared, then limited).
    modes: dict[str, str]
    nested: bool
    #: 'fresh' (never ran), 'queued', 'granted', 'ended' (released, given
    #: up, lost in a flush, or refused: try-once, or its owner was dead).
    state: str = "fresh"
    score: int | None = None
    fence: int | None = None
    #: Its waiter vanished without its exit path and its request state
    #: expired: the entries are dead (removable) although the owner lives.
    stale: bool = False
    #: A blocker of it died: its waiter runs again by that owner's liveness
    #: deadline (nothing is pushed for a death), until its next run.
    deadline_due: bool = False
    #: Granted by a hand-off whose 'g<fence>' the waiter has not popped yet.
    handed_off: bool = False
    #: Who holds it, when a task asks (``task name\ntask id\nnode``); '' for
    #: a plain lock. Its grant records it in the owner's registry.
    holder: str = ""
    #: resource -> its limit N, for each limited ('l') resource.
    limits: dict[str, int] = field(default_factory=dict)

    @property
    def resources(self) -> list[str]:
        return list(self.modes)

    @property
    def mode_string(self) -> str:
        """The modes as the scripts store them: one letter per resource,
        then, with limited resources, ``:`` and their limits (``xl:2``)."""
        letters = "".join(self.modes.values())
        tail = ",".join(str(self.limits[r]) for r, m in self.modes.items() if m == "l")
        return letters + ":" + tail if tail else letters

    def lock_value(self, res: str) -> str:
        """What its grant writes into ``res``'s lock hash."""
        mode = self.modes[res]
        value = f"{mode}{self.fence}"
        return value + f":{self.limits[res]}" if mode == "l" else value


@dataclass
class Model:
    """Owners and requests, and the rules that decide grants."""

    limit: int
    owners: dict[str, Owner] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    #: Last arrival number handed out ({ns}:seq).
    seq: int = 0
    #: Highest fencing token granted so far (across flushes too).
    max_fence: int = 0
    #: (owner, resource) -> the registry value the last grant of that owner
    #: on that resource wrote: its holder record, or ''.
    records: dict[tuple[str, str], str] = field(default_factory=dict)

    # -- queries ---------------------------------------------------------

    def alive(self, owner_id: str) -> bool:
        return self.owners[owner_id].alive

    def with_state(self, *states: str) -> Iterator[Request]:
        return (q for q in self.requests.values() if q.state in states)

    def live_grants(self, exclude: AbstractSet[str] = frozenset()) -> Iterator[Request]:
        """Granted requests of live owners (their locks are held)."""
        return (
            q for q in self.with_state("granted") if self.alive(q.owner) and q.token not in exclude
        )

    def live_queued(self, exclude: AbstractSet[str] = frozenset()) -> Iterator[Request]:
        """Queued requests of live owners (their entries block others)."""
        return (
            q
            for q in self.with_state("queued")
            if self.alive(q.owner) and not q.stale and q.token not in exclude
        )

    def earlier(self, q: Request, other: Request) -> bool:
        """Whether ``other`` arrived before ``q`` (``q`` not queued: any)."""
        if other.score is None:
            return False
        return q.score is None or other.score < q.score

    def live_ahead(self, q: Request, res: str) -> int:
        """Live queued requests before ``q`` in ``res``'s queue."""
        return sum(
            1
            for w in self.live_queued()
            if w.token != q.token and res in w.modes and self.earlier(q, w)
        )

    def holders_of(self, res: str, but: str = "") -> int:
        """Live grants on ``res`` (other than token ``but``)."""
        return sum(1 for h in self.live_grants() if h.token != but and res in h.modes)

    def blockers(
        self,
        q: Request,
        exclude: AbstractSet[str] = frozenset(),
        slots: dict[str, int] | None = None,
    ) -> list[str]:
        """Why ``q`` may not be granted now; empty when it may.

        The policy of docs/fairness.md: per resource, no live conflicting
        holder and (unless nested) no earlier live conflicting queue entry,
        and fewer than ``limit`` earlier live entries for the scan to look
        at (dead entries do not count: they are removed on the way).

        A limited resource (docs/design.md, "Limited resources"): with k
        holders and (unless nested) a earlier live entries, granted when
        k + 1 <= its own N and k + a + 1 <= N. In the first, k is the live
        holders, or ``slots[res]`` (the holders as a script counts them) when
        given; in the second always the live holders (the script reads their
        liveness once the entries ahead would block).
        """
        why = []
        for res, mode in q.modes.items():
            if mode == "l":
                cap = q.limits[res]
                k = (
                    slots[res]
                    if slots is not None and res in slots
                    else self.holders_of(res, q.token)
                )
                if k + 1 > cap:
                    why.append(f"{res}: {k} holders, limit {cap}")
                    continue
            else:
                for h in self.live_grants(exclude):
                    if h.token != q.token and res in h.modes and conflicts(mode, h.modes[res]):
                        why.append(f"{res}: held {h.modes[res]} by {h.token}")
            if q.nested:
                continue
            ahead = self.live_ahead(q, res)
            if mode == "l":
                # Once the entries ahead would block, the script reads the
                # holders' liveness: only live holders count with them.
                live = self.holders_of(res, q.token)
                if live + ahead + 1 > q.limits[res]:
                    why.append(
                        f"{res}: {live} live holders + {ahead} live entries ahead, limit {cap}"
                    )
            else:
                for w in self.live_queued(exclude):
                    if (
                        w.token != q.token
                        and res in w.modes
                        and self.earlier(q, w)
                        and conflicts(mode, w.modes[res])
                    ):
                        why.append(f"{res}: queued {w.modes[res]} {w.token} ahead")
            if ahead >= self.limit:
                why.append(f"{res}: {ahead} live entries ahead >= scan limit")
        return why

    def fifo_violations(self, q: Request, exclude: AbstractSet[str]) -> list[str]:
        """Earlier live conflicting requests that ``q``'s grant overtook.

        Nested requests are exempt (they wait for holders only). On a
        limited resource every earlier live request still queued counts as a
        slot taken, ``exclude`` (requests granted with ``q``, still queued in
        the model) included: ``q``'s grant overtook one when the live
        holders, those requests and ``q`` are more than its N.
        """
        if q.nested:
            return []
        out = []
        for res, mode in q.modes.items():
            if mode == "l":
                k, ahead = self.holders_of(res, q.token), self.live_ahead(q, res)
                if k + ahead + 1 > q.limits[res]:
                    out.append(f"{res}: {k} live holders + {ahead} earlier live entries")
        for w in self.live_queued(exclude):
            if w.token == q.token or not self.earlier(q, w):
                continue
            for res, mode in q.modes.items():
                if res in w.modes and conflicts(mode, w.modes[res]):
                    out.append(f"{w.token} ({w.modes}) queued ahead on {res}")
        return out

    # -- transitions -----------------------------------------------------

    def kill(self, owner_id: str) -> None:
        """The owner's liveness is gone (expired, deleted, evicted)."""
        owner = self.owners[owner_id]
        if owner.state != "new":
            owner.state = "dead"

    def next_score(self, nested: bool) -> int:
        self.seq += 1
        return self.seq - NESTED_OFFSET if nested else self.seq

    def grant(self, q: Request, fence: int) -> None:
        """Record a new grant; fencing tokens must strictly increase."""
        assert fence > self.max_fence, (
            f"fencing token {fence} of {q.token} is not above the last one ({self.max_fence})"
        )
        self.max_fence = fence
        q.state, q.fence, q.score = "granted", fence, None
        record = holder_record(q.token, q.holder) if q.holder else ""
        for res in q.modes:
            self.records[(q.owner, res)] = record

    def flush(self) -> None:
        """Redis lost everything (FLUSHALL, a restart without persistence)."""
        for owner in self.owners.values():
            if owner.state == "alive":
                owner.state = "dead"
            owner.cleaned = False  # its tombstone is gone with the data
        for q in self.requests.values():
            q.state, q.handed_off = "ended", False
        self.seq = 0
