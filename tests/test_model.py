"""A model of the lock protocol, as a stateful property test (hypothesis).

:class:`ProtocolMachine` drives the real Lua scripts on a real redis-server
with several simulated owners (distinct owner ids, each with its own
liveness key) and compares Redis with the reference model of
``tests/lock_model.py`` after every step. It calls the engine at the level
that is deterministic in one thread: ``LockManager.acquirer.attempt`` (one run of
acquire.lua, as a waiter makes it), ``_run_release``, ``cleanup_owner``,
``reconcile`` and the heartbeat and node scripts. No heartbeat thread runs
(``owner_ttl`` is an hour): an owner dies when its ``alive:`` key is
deleted, as if it had expired. A waiter is simulated by its script runs:
"wakes" pops its wake list as its BLPOP would, and a ``g<fence>`` there is
its grant; anything else (a plain wake, or nothing: its deadline) re-runs
acquire.lua.

Rules: new owners (some registered in a worker incarnation's group, some
asyncio owners: their acquires go out as ``AsyncLockManager`` sends them,
through its channel on a ``redis.asyncio`` client: never flag 'f', no
group, no holder record);
acquire (exclusive/shared, one to three resources, try-once or queueing,
nested from an owner that holds a lock; a slot of the limited resource
``n``, limit 2, alone or with exclusive and shared ones), a request of the
other kind on a name held or queued for (``{-2, name, mode}``), a woken
waiter's re-run, a waiter
that keeps re-running, giving up (release.lua dequeues, or releases a
hand-off that landed), release, the retry of a granted request's acquire
(a lost reply), owner death, cleanup_owner (normal and force), reconcile,
the owner heartbeat, task owners (acquire_for_task, then adopt by a
process: moved, retried, expired, tombstoned, adopted elsewhere), node
start / heartbeat (with exited children) /
eviction by a successor, SCRIPT FLUSH, and a restart without persistence
(FLUSHALL + SCRIPT FLUSH: every lease is lost, new grants are allowed).

Checked after every step:

* every reply of acquire.lua is the model's: granted exactly when no live
  holder and (not nested) no earlier live queue entry conflicts, and fewer
  than ``queue_scan_limit`` live entries are ahead (dead entries do not
  count); on the limited resource, when its holders (HLEN below the limit,
  else the live ones), the live entries ahead (not nested) and the request
  are at most the limit; ``-1`` for a dead owner; ``{-2, name, mode}`` for
  the other kind; a retried grant returns its own fence;
* exclusion: no lock hash records incompatible holders, more slots than
  the limit or two kinds; every holder is a grant of the model, with its
  mode and fence (and a slot's limit); every live grant is there;
* registry truth (``held:<owner>`` is exactly the resources it holds) and
  the active-owners set covers every owner that holds or waits;
* every queue entry is a queued request of the model (live, or dead and
  removable), with its mode and score; every live queued request is in all
  its queues with its request state;
* fencing tokens strictly increase over every grant, across restarts;
* hand-off only to a live owner, of every lock at once, never overtaking
  an earlier live conflicting request (FIFO; nested requests excepted),
  with ``g<fence>`` at the head of its wake list;
* push: a queued request that nothing recorded in Redis blocks (no
  conflicting holder, no earlier conflicting entry, fewer than
  ``queue_scan_limit`` live entries ahead, dead ones included however many
  a scan may remove) has been handed its locks or has a wake-up on its wake
  list; a waiter that keeps re-running is granted when the model says it
  may (dead entries never stall a free lock);
* cleanup leaves no queue entry of the owner it freed in any queue; the
  owners' waits hashes name exactly their queued requests;
* liveness keys are exactly the live owners' (nothing re-creates one);
  request and wake keys belong to current requests or expire;
  node records, groups and tombstones match the model; no key outside the
  namespace.

Environment:

* ``REDISLOCK_MODEL_EXAMPLES`` (default 75) and ``REDISLOCK_MODEL_STEPS``
  (default 40): examples and most steps per example. ``make test`` runs the
  defaults (about 15 s); a long run, e.g. ``REDISLOCK_MODEL_EXAMPLES=5000``,
  explores much further and has no per-test timeout. A failure is shrunk
  for up to about five minutes before hypothesis prints the steps.
  ``pytest -s`` prints what the run exercised (grants, hand-offs, rules).
* An acquire that registers (the first attempt of an identity, e.g.
  retried after a lost reply) by an owner that cleanup already freed must
  reply ``-1`` (its tombstone), not re-create its liveness. A restart
  without persistence loses the tombstones with everything else, so the
  model forgets which owners were cleaned there (docs/design.md, known
  limits).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_redislock import FORMAT_VERSION, LockManager
from celery_redislock.asyncio.acquire import acquire_call
from celery_redislock.asyncio.channel import AsyncChannel
from celery_redislock.engine.identity import OwnerIdentity
from celery_redislock.protocol.keys import holder_record
from celery_redislock.worker.node import group_key, node_key, tomb_key
from engine_helpers import registry_names
from lock_model import Model, Owner, Request, conflicts, fence_of, mixed, purge_budget
from redis_server import RedisServer

ENV_EXAMPLES = "REDISLOCK_MODEL_EXAMPLES"
ENV_STEPS = "REDISLOCK_MODEL_STEPS"
DEFAULT_EXAMPLES = 75
DEFAULT_STEPS = 40
EXAMPLES = int(os.environ.get(ENV_EXAMPLES) or DEFAULT_EXAMPLES)
STEPS = int(os.environ.get(ENV_STEPS) or DEFAULT_STEPS)

NS = "m"
PREFIX = "{m}:"
#: Three resources (contention is the point); one name full of key syntax.
RESOURCES = ("a", "b", "q:{b}|é")
#: The limited resource (only ever taken limited), and the limit every
#: request of it asks for.
LIMITED = "n"
SLOTS = 2
LIMIT = 3
OWNER_TTL = 3600.0
TTL_MS = str(int(OWNER_TTL * 1000))
REC_TTL_MS = str(86_400_000)
IV_MS = str(int(OWNER_TTL * 1000 / 3))
#: Owners that may still act at once, and owner ids made per example.
MAX_LIVE_OWNERS = 5
MAX_OWNERS = 16
MAX_INCARNATIONS = 3
NODENAME = "w@model"
#: pids far above pid_max: no /proc entry, so a tag is the bare pid.
PID_BASE = 5_000_000

#: The session's redis-server, set by the test function for the machine.
_server: RedisServer | None = None

#: What the runs exercised (printed by the test: pytest -s shows it).
STATS: Counter[str] = Counter()


def note(what: str) -> None:
    STATS[what] += 1


#: Request shapes without the limited resource (task owners take no slot).
plain_shapes = st.dictionaries(
    st.sampled_from((RESOURCES[0],) * 3 + RESOURCES[1:]),
    st.sampled_from("xs"),
    min_size=1,
    max_size=3,
)
#: Request shapes: 'a' is drawn most often, so that requests meet in its
#: queue; the limited resource alone or with exclusive or shared ones.
shapes = st.dictionaries(
    st.sampled_from((RESOURCES[0],) * 3 + RESOURCES[1:] + (LIMITED,) * 2),
    st.sampled_from("xs"),
    min_size=1,
    max_size=3,
).map(lambda shape: {res: "l" if res == LIMITED else m for res, m in shape.items()})


@dataclass
class View:
    """Everything in Redis, read after a step."""

    types: dict[str, str] = field(default_factory=dict)
    pttl: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def of_kind(self, kind: str) -> Iterator[tuple[str, Any]]:
        head = PREFIX + kind + ":"
        for key, value in self.raw.items():
            if key.startswith(head):
                yield key[len(head) :], value

    def lock(self, res: str) -> dict[str, str]:
        return dict(self.raw.get(PREFIX + "lock:" + res) or {})

    def queue(self, res: str) -> list[tuple[str, int]]:
        """Entries (member, score) of one queue, in serving order."""
        return [(m, int(s)) for m, s in self.raw.get(PREFIX + "q:" + res) or []]

    def wake(self, token: str) -> list[str]:
        return list(self.raw.get(PREFIX + "wake:" + token) or [])

    def ahead(self, q: Request, res: str) -> list[tuple[str, int]]:
        """Entries of ``res``'s queue before ``q`` (all of them if not queued)."""
        return [
            (m, s)
            for m, s in self.queue(res)
            if m[1:] != q.token and (q.score is None or s < q.score)
        ]


def read_view(r: redis.Redis) -> View:
    view = View()
    keys = sorted(r.keys("*"))
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.type(k)
        pipe.pttl(k)
    meta = pipe.execute()
    for k, t, ttl in zip(keys, meta[::2], meta[1::2]):
        view.types[k] = t
        view.pttl[k] = int(ttl)
    readers = {
        "hash": lambda p, k: p.hgetall(k),
        "zset": lambda p, k: p.zrange(k, 0, -1, withscores=True),
        "set": lambda p, k: p.smembers(k),
        "list": lambda p, k: p.lrange(k, 0, -1),
        "string": lambda p, k: p.get(k),
        "stream": lambda p, k: p.xrange(k),
    }
    pipe = r.pipeline(transaction=False)
    for k in keys:
        readers[view.types[k]](pipe, k)
    for k, value in zip(keys, pipe.execute()):
        view.raw[k] = value
    return view


def registry_view(view: View) -> dict[str, set[str]]:
    """owner -> resource names in its registry: its main hash and, if it
    spilled, the buckets its bucket index lists (an unlisted bucket fails)."""
    return registry_names(view.of_kind("held"))


@dataclass
class NodeModel:
    """One node name: its record, incarnations, groups and tombstones."""

    incarnations: list[str] = field(default_factory=list)
    record: tuple[str, int] | None = None
    #: The incarnation whose beats re-create a vanished record ('owner' state).
    owning: str | None = None
    tombs: set[str] = field(default_factory=set)
    groups: dict[str, set[str]] = field(default_factory=dict)


class ProtocolMachine(RuleBasedStateMachine):
    """Simulated owners and waiters on the real scripts, against the model."""

    def __init__(self) -> None:
        super().__init__()
        assert _server is not None, "run through test_protocol_matches_the_reference_model"
        self.r = _server.client(decode_responses=True)
        self.r.flushall()
        self.attempt_group: str | None = None
        self.mgr = LockManager(
            self.r,
            NS,
            owner_ttl=OWNER_TTL,
            queue_scan_limit=LIMIT,
            heartbeat=False,
            group=lambda: self.attempt_group,
        )
        self.model = Model(limit=LIMIT)
        self.node = NodeModel()
        #: Owners whose acquires go out as the asyncio front-end sends them.
        self.async_owners: set[str] = set()
        self.aloop: asyncio.AbstractEventLoop | None = None
        self.achannel: AsyncChannel | None = None
        self.idents: dict[str, OwnerIdentity] = {}
        #: Task owner -> the owner that adopted its grants (adopt.lua's record).
        self.adopted: dict[str, str] = {}
        self.retired: set[str] = set()
        self.reqs: dict[str, Any] = {}
        self.counter = 0
        #: The last clock-based fence when the counter was set ahead of the clock.
        self.clock_fences: int | None = None
        self.view = read_view(self.r)

    def teardown(self) -> None:
        self.mgr.close()
        if self.aloop is not None:
            assert self.achannel is not None
            self.aloop.run_until_complete(self.achannel.client.aclose())
            self.aloop.close()

    def async_attempt(self, ident: OwnerIdentity, q: Request, queue: bool) -> Any:
        """acquire.lua for ``q`` as ``AsyncLockManager`` sends it
        (``asyncio.acquire.acquire_call``), through its channel."""
        assert _server is not None
        if self.aloop is None:
            import redis.asyncio

            self.aloop = asyncio.new_event_loop()
            client = redis.asyncio.Redis.from_url(_server.url, decode_responses=True)
            self.achannel = AsyncChannel(client, _server.url, self.mgr.channel.protocol)
        assert self.achannel is not None
        call = acquire_call(
            self.mgr.channel.protocol,
            q.token,
            self.reqs[q.token],
            ident,
            queue=queue,
            nested=q.nested,
            spill=self.mgr.state.spill(ident.owner_id),
        )
        reply = self.aloop.run_until_complete(self.achannel.run(call))
        code = int(reply[0])
        if code == 1 or (code == 0 and queue):
            ident.listed = True
        return reply

    # -- helpers ---------------------------------------------------------

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    def owners(self, *states: str) -> list[str]:
        return [o.id for o in self.model.owners.values() if o.state in states]

    def usable(self) -> list[str]:
        """Owners whose process still runs: not retired by a -1 reply.

        Task owners (``task:<id>``) are no process: they only take locks
        through acquire_for_task and give them up to an adopter.
        """
        return [
            o
            for o in self.owners("new", "alive", "dead")
            if o not in self.retired and not o.startswith("task:")
        ]

    def task_owners(self) -> list[str]:
        return [o for o in self.model.owners if o.startswith("task:")]

    def waiting(self) -> list[str]:
        """Requests a waiter still waits for (queued, or handed off unseen)."""
        return [
            q.token
            for q in self.model.requests.values()
            if (q.state == "queued" and q.owner not in self.retired and not q.stale) or q.handed_off
        ]

    def leases(self) -> list[str]:
        """Grants returned to their caller (a Lease exists)."""
        return [
            q.token
            for q in self.model.with_state("granted")
            if not q.handed_off and q.owner not in self.retired and not q.owner.startswith("task:")
        ]

    def make_request(
        self, token: str, owner: str, shape: dict[str, str], nested: bool = False
    ) -> Request:
        """The model's request of ``shape`` and the engine's, kept by token."""
        ex = [res for res, m in shape.items() if m == "x"]
        sh = [res for res, m in shape.items() if m == "s"]
        lim = {res: SLOTS for res, m in shape.items() if m == "l"}
        req = self.mgr.request(ex, sh, lim or None)
        q = Request(
            token=token,
            owner=owner,
            modes=dict(zip(req.resources, req.modes)),
            nested=nested,
            limits=dict(req.limit_map),
        )
        self.model.requests[q.token] = q
        self.reqs[q.token] = req
        return q

    def slots_seen(self, q: Request) -> dict[str, int]:
        """The holders of each limited resource of ``q`` as acquire.lua
        counts them: HLEN while below the limit (dead holders included),
        else the live ones (it frees the dead ones it reads)."""
        out = {}
        for res, mode in q.modes.items():
            if mode == "l":
                n = sum(1 for t in self.view.lock(res) if t != q.token)
                out[res] = n if n < q.limits[res] else self.model.holders_of(res, q.token)
        return out

    def fields_of(self, q: Request) -> int:
        return sum(1 for res in q.modes if q.token in self.view.lock(res))

    def entries_of(self, q: Request) -> int:
        return sum(
            1
            for res, mode in q.modes.items()
            if any(m == mode + q.token for m, _ in self.view.queue(res))
        )

    def dead_residue(self, q: Request) -> int:
        """Most dead entries before ``q`` in one of its queues, or dead
        conflicting holders of one of its locks (still in Redis)."""
        most = 0
        for res, mode in q.modes.items():
            most = max(most, len(self.view.ahead(q, res)) - self.model.live_ahead(q, res))
            live = {h.token for h in self.model.live_grants()}
            dead = [
                t
                for t, v in self.view.lock(res).items()
                if t not in live and conflicts(mode, v[0]) and mode != "l"
            ]
            most = max(most, len(dead))
        return most

    def run_acquire(self, q: Request, queue: bool, ident: OwnerIdentity | None = None) -> None:
        """One run of acquire.lua for ``q``, its reply checked against the model."""
        owner = self.model.owners[q.owner]
        ident = ident or self.idents[q.owner]
        why: list[str] = []
        if ident.registered and owner.state == "dead":
            expect = "dead"
        elif q.state == "granted":
            expect = "granted"
        else:
            why = self.model.blockers(q, slots=self.slots_seen(q))
            expect = "blocked" if why else "granted"
            if not why and self.dead_residue(q) >= purge_budget(LIMIT):
                expect = "either"  # more dead entries than one run removes
        self.attempt_group = group_key(PREFIX, owner.group) if owner.group else None
        # A request's first run is sent as the client sends it: flag 'f' (its
        # token was never sent, nothing to look for); every later run looks.
        first = q.state == "fresh"
        if q.owner in self.async_owners:
            reply = self.async_attempt(ident, q, queue)
        else:
            reply = self.mgr.acquirer.attempt(
                ident, q.token, self.reqs[q.token], queue, q.nested, q.holder, first
            )
        code = int(reply[0])
        q.deadline_due = False
        kind = " limited" if "l" in q.modes.values() else ""
        note(f"acquire{kind}: {expect}{' (nested)' if q.nested else ''}")
        if expect == "dead":
            assert code == -1, f"{q.token}: owner {q.owner} is dead, acquire replied {reply}"
            self.retired.add(q.owner)
            if q.state == "fresh":
                q.state = "ended"
            return
        assert code != -1, f"{q.token}: live owner told it is dead: {reply}"
        self.registered(ident, owner)
        if expect == "either":
            expect = "granted" if code == 1 else "blocked"
        if expect == "granted":
            assert code == 1, f"{q.token} {q.modes} should be granted, got {reply}"
            fence = int(reply[1])
            if q.state == "granted":
                assert fence == q.fence, f"retried grant of {q.token}: fence {fence} != {q.fence}"
                return
            assert not self.model.fifo_violations(q, set())
            self.model.grant(q, fence)
            return
        assert code == 0, f"{q.token} {q.modes} should be blocked ({why}), got {reply}"
        if q.state == "fresh":
            if queue:
                q.state, q.score = "queued", self.model.next_score(q.nested)
            else:
                q.state = "ended"

    def pop_wake(self, q: Request) -> bool:
        """The waiter's BLPOP: True when it popped its hand-off."""
        msg = self.r.lpop(PREFIX + "wake:" + q.token)
        if msg is None and q.handed_off and self.fields_of(q) < len(q.modes):
            # Its owner died and its grant was reclaimed (with its wake list):
            # the waiter's BLPOP times out, its re-run is told it is dead.
            assert not self.model.alive(q.owner), q
            q.handed_off = False
            return False
        if msg is not None and msg.startswith("g"):
            assert q.handed_off and int(msg[1:]) == q.fence, (q, msg)
            q.handed_off = False
            return True
        assert not q.handed_off, f"{q.token} was handed its locks but popped {msg!r}"
        return False

    def free_owner(self, owner_id: str, report: Any) -> None:
        """Model side of a cleanup that did not find the owner alive."""
        owner = self.model.owners[owner_id]
        assert report.status == "cleaned", report
        self.model.kill(owner_id)
        owner.cleaned = True

    def expected_cleanup(self, owner_id: str) -> int:
        """Grants ``owner_id`` still has in the locks of its registry."""
        held = registry_view(self.view).get(owner_id, set())
        n = 0
        for name in held:
            lock = self.view.raw.get(PREFIX + "lock:" + name) or {}
            n += sum(1 for t in lock if t.split("|", 1)[0] == owner_id)
        return n

    # -- rules: owners ---------------------------------------------------

    @initialize(grouped=st.lists(st.booleans(), min_size=3, max_size=3))
    def three_owners(self, grouped: list[bool]) -> None:
        """A worker incarnation and three owners, some of them in its group."""
        self.node_start()
        for g in grouped:
            self.new_owner(g)

    @precondition(
        lambda self: (
            len(self.owners("new", "alive")) < MAX_LIVE_OWNERS
            and len(self.model.owners) < MAX_OWNERS
        )
    )
    @rule(grouped=st.booleans(), front=st.booleans())
    def new_owner(self, grouped: bool, front: bool = False) -> None:
        """A new owner: in a worker incarnation's group (``grouped``), or,
        with ``front``, an asyncio owner (never in a group: a worker's
        processes are sync)."""
        k = self._next()
        oid = f"o{k}"
        live_incs = [i for i in self.node.incarnations if i not in self.node.tombs]
        group = live_incs[-1] if grouped and live_incs else None
        self.model.owners[oid] = Owner(oid, group=group, pid=PID_BASE + k)
        self.idents[oid] = OwnerIdentity(owner_id=oid, pid=PID_BASE + k)
        if front and group is None:
            self.async_owners.add(oid)
            note("asyncio owner")
        self.settle()

    @precondition(lambda self: self.owners("alive"))
    @rule(data=st.data())
    def owner_dies(self, data: st.DataObject) -> None:
        """Its liveness key expires (SIGKILL, a pause past owner_ttl)."""
        oid = data.draw(st.sampled_from(self.owners("alive")), label="owner")
        self.r.delete(PREFIX + "alive:" + oid)
        self.model.kill(oid)
        self.settle()

    @precondition(lambda self: self.owners("alive", "dead"))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        oid = data.draw(st.sampled_from(self.owners("alive", "dead")), label="owner")
        reply = self.mgr.channel.call("heartbeat", [PREFIX + "alive:" + oid], [TTL_MS])
        assert [int(x) for x in reply] == [1 if self.model.alive(oid) else 0], (oid, reply)
        self.settle()

    # -- rules: acquire, wait, release -----------------------------------

    @precondition(lambda self: self.usable())
    @rule(
        data=st.data(),
        shape=shapes,
        queue=st.booleans(),
        nested=st.booleans(),
        spill=st.booleans(),
        task=st.booleans(),
    )
    def acquire(
        self,
        data: st.DataObject,
        shape: dict[str, str],
        queue: bool,
        nested: bool,
        spill: bool = False,
        task: bool = False,
    ) -> None:
        oid = data.draw(st.sampled_from(self.usable()), label="owner")
        # Nested: made while the same thread holds a lock (the owner has a lease).
        nested = nested and any(self.model.requests[t].owner == oid for t in self.leases())
        q = self.make_request(f"{oid}|r{self._next()}", oid, shape, nested)
        if task and oid not in self.async_owners:  # as @locked asks: its grant records who holds it
            q.holder = f"t.run\n{q.token}\nnode"
        # As an owner holding many locks: its registry spills into buckets
        # (drawn per acquire, so one owner's names end up in both places).
        self.mgr.state.spill_at = 0 if spill else 10**9
        try:
            self.run_acquire(q, queue)
        finally:
            self.mgr.state.spill_at = 10**9
        self.settle()

    @precondition(lambda self: self.usable())
    @rule(data=st.data(), shape=shapes)
    def acquire_waiting(self, data: st.DataObject, shape: dict[str, str]) -> None:
        """The usual call: a blocking acquire (queues when blocked), not nested."""
        self.acquire(data, shape, True, False)

    def mixable(self) -> list[str]:
        """Resources held or queued for in Redis (a request of the other
        kind meets them)."""
        return [res for res in (*RESOURCES, LIMITED) if self.view.lock(res) or self.view.queue(res)]

    def registered_owners(self) -> list[str]:
        return [o for o in self.usable() if self.idents[o].registered and self.model.alive(o)]

    @precondition(lambda self: self.mixable() and self.registered_owners())
    @rule(data=st.data(), extra=st.sampled_from(["", *RESOURCES]), mode=st.sampled_from("xs"))
    def acquire_other_kind(self, data: st.DataObject, extra: str, mode: str) -> None:
        """A name taken limited asked for exclusive or shared, or one taken
        exclusive or shared asked for limited (with or without another
        resource of its own kind), nested or not (a nested request passes
        the queue's entries, not their kind): ``{-2, name, mode}``, nothing
        granted or queued, and the exit path's release finds nothing."""
        res = data.draw(st.sampled_from(self.mixable()), label="resource")
        oid = data.draw(st.sampled_from(self.registered_owners()), label="owner")
        if res == LIMITED:
            shape = {res: mode}
            if extra:
                shape[extra] = mode
            met = "l"
        else:
            shape = {res: "l"}
            if extra == RESOURCES[0]:
                shape[LIMITED] = "l"
            holders = self.view.lock(res)
            met = next(iter(holders.values()))[0] if holders else self.view.queue(res)[0][0][0]
        assert mixed(shape[res], met), (shape, met)
        nested = data.draw(st.booleans(), label="nested")
        q = self.make_request(f"{oid}|r{self._next()}", oid, shape, nested)
        reply = self.mgr.acquirer.attempt(
            self.idents[oid], q.token, self.reqs[q.token], True, nested, "", True
        )
        assert list(reply) == [-2, res, met], (q, nested, reply, met)
        q.state = "ended"
        reply = self.mgr.releaser.run_release(oid, q.token, self.reqs[q.token])
        assert [int(x) for x in reply] == [0, 0], (q.token, reply)
        note("acquire: other kind refused")
        self.settle()

    def registered(self, ident: OwnerIdentity, owner: Owner) -> None:
        """An acquire by ``owner`` (not refused as dead) registered it: alive, in its group."""
        if not ident.registered:
            ident.registered = True
            if owner.state == "new":
                owner.state = "alive"
                if owner.group:
                    self.node.groups.setdefault(owner.group, set()).add(owner.id)

    def drawn(self, data: st.DataObject, tokens: list[str], label: str) -> Request:
        """The request of a token drawn from ``tokens``."""
        return self.model.requests[data.draw(st.sampled_from(tokens), label=label)]

    def wakes(self, q: Request) -> None:
        """``q``'s BLPOP returns: it takes its hand-off, or re-runs its acquire."""
        if not self.pop_wake(q):
            self.run_acquire(q, queue=True)

    @precondition(lambda self: self.waiting())
    @rule(data=st.data())
    def waiter_wakes(self, data: st.DataObject) -> None:
        """A waiter's BLPOP returns (a push, or its deadline): hand-off or re-run."""
        q = self.drawn(data, self.waiting(), "waiter")
        self.wakes(q)
        self.settle()

    @precondition(lambda self: self.waiting())
    @rule(data=st.data())
    def waiter_keeps_waiting(self, data: st.DataObject) -> None:
        """A waiter re-runs until it is granted or gives up at its timeout.

        Each of its runs is checked against the model; with ``window`` strict,
        a request that the model says may go ahead (dead entries ignored)
        must be granted by the end.
        """
        q = self.drawn(data, self.waiting(), "waiter")
        ideal = self.model.alive(q.owner) and not self.model.blockers(q)
        runs = 2 + max(len(self.view.queue(res)) for res in q.modes) // LIMIT
        for _ in range(runs):
            if q.state != "queued" or q.owner in self.retired:
                break
            if not self.pop_wake(q):
                self.run_acquire(q, queue=True)
                self.view = read_view(self.r)
                self.sync_handoffs(self.view)
        if q.handed_off:
            self.pop_wake(q)
        if ideal:
            assert q.state == "granted", (
                f"{q.token} {q.modes} may go ahead (no live holder or earlier live entry "
                f"blocks it) but {runs} runs of its acquire did not grant it: "
                f"queues {[self.view.queue(res) for res in q.modes]}"
            )
        self.settle()

    @precondition(lambda self: self.waiting())
    @rule(data=st.data())
    def waiter_gives_up(self, data: st.DataObject) -> None:
        """Timeout or interrupt: release.lua by its token (it may hold a hand-off)."""
        q = self.drawn(data, self.waiting(), "waiter")
        expect = [self.fields_of(q), self.entries_of(q)]
        if q.state == "granted" and self.model.alive(q.owner):
            assert expect[0] == len(q.modes), (q, expect)
        if q.state == "queued" and self.model.alive(q.owner):
            assert expect[1] == len(q.modes), (q, expect)
        reply = self.mgr.releaser.run_release(q.owner, q.token, self.reqs[q.token])
        assert [int(x) for x in reply] == expect, (q.token, reply, expect)
        q.state, q.handed_off = "ended", False
        self.settle()

    def queued_waiters(self) -> list[str]:
        return [q.token for q in self.model.live_queued() if q.owner not in self.retired]

    @precondition(lambda self: self.queued_waiters())
    @rule(data=st.data())
    def waiter_vanishes(self, data: st.DataObject) -> None:
        """A waiter's thread ends without its exit path; its request state expires.

        Its entries are dead although its owner lives (docs/design.md race 8).
        """
        token = data.draw(st.sampled_from(self.queued_waiters()), label="waiter")
        self.r.delete(PREFIX + "req:" + token)
        self.model.requests[token].stale = True
        self.settle()

    @precondition(lambda self: self.leases())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        q = self.drawn(data, self.leases(), "lease")
        expect = self.fields_of(q)
        if self.model.alive(q.owner):
            assert expect == len(q.modes), f"live lease {q.token} lost locks in Redis"
        reply = self.mgr.releaser.run_release(q.owner, q.token, self.reqs[q.token], lease=True)
        assert [int(x) for x in reply] == [expect, 0], (q.token, reply, expect)
        q.state = "ended"
        self.settle()

    @precondition(lambda self: self.leases())
    @rule(data=st.data())
    def release_then_waiters_wake(self, data: st.DataObject) -> None:
        """The usual hand-over: a lease is released, then each waiter of its
        resources returns from its BLPOP (hand-off, or a re-run)."""
        self.release(data)
        for token in self.waiting():
            q = self.model.requests[token]
            if q.state != "queued" and not q.handed_off:
                continue
            self.wakes(q)
            self.settle()

    @precondition(lambda self: self.leases())
    @rule(data=st.data())
    def acquire_retried_after_grant(self, data: st.DataObject) -> None:
        """redis-py retries an acquire whose reply was lost: same grant, same fence."""
        q = self.drawn(data, self.leases(), "lease")
        self.run_acquire(q, queue=True)
        self.settle()

    @precondition(
        lambda self: any(
            o.cleaned and not o.id.startswith("task:") for o in self.model.owners.values()
        )
    )
    @rule(data=st.data(), shape=shapes)
    def cleaned_owner_registers_again(self, data: st.DataObject, shape: dict[str, str]) -> None:
        """An acquire that registers, by an owner cleanup already freed: -1."""
        cleaned = [
            o.id for o in self.model.owners.values() if o.cleaned and not o.id.startswith("task:")
        ]
        oid = data.draw(st.sampled_from(cleaned), label="owner")
        q = self.make_request(f"{oid}|r{self._next()}", oid, shape)
        ident = OwnerIdentity(owner_id=oid, pid=self.idents[oid].pid)
        reply = self.mgr.acquirer.attempt(ident, q.token, self.reqs[q.token], True, False)
        assert int(reply[0]) == -1, f"cleaned owner {oid} registered again: {reply}"
        q.state = "ended"
        self.settle()

    # -- rules: task owners (acquire_for_task, adopt) ---------------------

    @precondition(lambda self: len(self.model.owners) < MAX_OWNERS)
    @rule(shape=plain_shapes)
    def task_acquire(self, shape: dict[str, str]) -> None:
        """A producer takes resources for a task id (try once, never queued)."""
        tid = f"t{self._next()}"
        oid = f"task:{tid}"
        owner = self.model.owners[oid] = Owner(oid)
        ex = [res for res, m in shape.items() if m == "x"]
        sh = [res for res, m in shape.items() if m == "s"]
        req = self.mgr.request(ex, sh)
        q = Request(f"{oid}|task:{tid}", oid, dict(zip(req.resources, req.modes)), False)
        q.holder = f"t.unique\n{tid}\n"  # as UniqueTask records it at enqueue
        self.model.requests[q.token] = q
        self.reqs[q.token] = req
        why = self.model.blockers(q)
        expect = "blocked" if why else "granted"
        if not why and self.dead_residue(q) >= purge_budget(LIMIT):
            expect = "either"
        grant = self.mgr.acquire_for_task(tid, ex, sh, ttl=OWNER_TTL, holder=q.holder)
        # Registered by the attempt; a refused one holding nothing is forgotten.
        owner.state = "alive" if grant.granted else "dead"
        note(f"task acquire: {expect}")
        if expect == "either":
            expect = "granted" if grant.granted else "blocked"
        if expect == "granted":
            assert grant.granted and not grant.repeated, (q, grant)
            assert grant.token == q.token, grant
            assert not self.model.fifo_violations(q, set())
            self.model.grant(q, int(grant.fencing_token or 0))
        else:
            assert not grant.granted, f"{q.token} {q.modes} should be blocked ({why}): {grant}"
            q.state = "ended"
            if grant.holder is not None:
                assert (
                    any(self.r.hexists(PREFIX + "lock:" + res, grant.holder) for res in q.modes)
                    or self.model.requests[grant.holder].state != "granted"
                ), grant
        self.settle()

    @precondition(lambda self: self.task_owners() and self.usable())
    @rule(data=st.data())
    def task_adopt(self, data: st.DataObject) -> None:
        """The process that runs a task adopts its task owner's grants."""
        towner = data.draw(st.sampled_from(self.task_owners()), label="task owner")
        oid = data.draw(st.sampled_from(self.usable()), label="adopter")
        task, owner, ident = self.model.owners[towner], self.model.owners[oid], self.idents[oid]
        self.attempt_group = group_key(PREFIX, owner.group) if owner.group else None
        reply, _ = self.mgr.tasks.run_adopt(ident, towner)
        code = int(reply[0])
        by = self.adopted.get(towner)
        if ident.registered and owner.state == "dead":
            assert code == -1, (oid, reply)
            self.retired.add(oid)
            self.settle()
            return
        assert code != -1, (oid, reply)
        self.registered(ident, owner)

        def entries(raw: Any) -> dict[str, tuple[int, dict[str, str]]]:
            out = {}
            for e in raw:
                token, fence, modes, *names = e
                out[token] = (int(fence), dict(zip(names, modes)))
            return out

        if by is not None and by != oid:
            assert [code, reply[1], reply[2]] == [0, "adopted", by], reply
            note("adopt: adopted elsewhere")
        elif by == oid:
            assert code == 1, reply
            expect = {
                q.token: (q.fence, q.modes)
                for q in self.model.with_state("granted")
                if q.owner == oid
                and q.token.endswith("|task:" + towner.split(":", 1)[1])
                and q.token in self.view.lock(next(iter(q.modes)))
            }
            assert entries(reply[1:]) == expect, (reply, expect)
            note("adopt: retried")
        elif not task.alive:
            why = "tombstoned" if task.cleaned else "expired"
            assert [code, reply[1]] == [0, why], (towner, reply, task)
            note(f"adopt: {why}")
        else:
            grants = [q for q in self.model.with_state("granted") if q.owner == towner]
            moved = {}
            for q in grants:
                old = q.token
                q.token = oid + "|" + old.split("|", 1)[1]
                q.owner = oid
                for res in q.modes:  # the record keeps the request id
                    self.model.records[(oid, res)] = self.model.records.get((towner, res), "")
                del self.model.requests[old]
                self.model.requests[q.token] = q
                self.reqs[q.token] = self.reqs.pop(old)
                moved[q.token] = (q.fence, q.modes)
            assert code == 1 and entries(reply[1:]) == moved, (reply, moved)
            task.state, task.cleaned = "dead", True
            self.adopted[towner] = oid
            note(f"adopt: x{len(moved)}")
        self.settle()

    # -- rules: cleanup --------------------------------------------------

    @precondition(lambda self: self.owners("alive", "dead"))
    @rule(data=st.data(), force=st.booleans())
    def cleanup_owner(self, data: st.DataObject, force: bool) -> None:
        oid = data.draw(st.sampled_from(self.owners("alive", "dead")), label="owner")
        alive = self.model.alive(oid)
        expect = self.expected_cleanup(oid)
        report = self.mgr.cleanup_owner(oid, force=force)
        if alive and not force:
            assert report.status == "alive" and report.released == 0, report
        else:
            assert report.released == expect and report.remaining == 0, (report, expect)
            self.free_owner(oid, report)
        self.settle()

    @precondition(lambda self: self.owners("dead"))
    @rule()
    def reconcile(self) -> None:
        members = set(self.view.raw.get(PREFIX + "owners") or ())
        dead = {o for o in members if not self.model.alive(o)}
        expect = sum(self.expected_cleanup(o) for o in dead)
        report = self.mgr.reconcile()
        assert report.owners_seen == len(members) and report.alive == len(members - dead)
        assert report.cleaned == len(dead) and report.released == expect, (report, dead)
        assert not report.errors, report
        for r in report.reports:
            self.free_owner(r.owner_id, r)
        self.settle()

    # -- rules: node -----------------------------------------------------

    def _record_args(self) -> list[str]:
        return ["4242", "model-host", "1700000000"]

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            [
                "script-flush",
                "restart",
                "fence-ahead",
                "node-start",
                "node-beat",
                "node-evict",
                "node-evict-stale",
            ]
        ),
    )
    def outside_event(self, data: st.DataObject, kind: str) -> None:
        """Something outside the lock calls: SCRIPT FLUSH, a restart without
        persistence (once something is held or queued), a fencing counter
        ahead of the server clock, or a worker incarnation that starts,
        beats, or evicts its stalled predecessor."""
        rec = self.node.record
        can_evict = rec is not None and any(i != rec[0] for i in self.node.incarnations)
        if kind == "restart" and any(self.model.with_state("queued", "granted")):
            self.restart_without_persistence()
        elif kind == "fence-ahead":
            # The counter is ahead of the server clock (a failover to a
            # server whose clock is behind): grants count up from it.
            now = self.r.time()
            if self.clock_fences is None:
                self.clock_fences = self.model.max_fence
            ahead = max(self.model.max_fence, now[0] * 1_000_000 + now[1]) + 10**9
            self.r.set(PREFIX + "fence", str(ahead))
            # a server that has the namespace's fence has its format key too
            self.r.set(PREFIX + "format", str(FORMAT_VERSION), nx=True)
            self.model.max_fence = ahead
            self.settle()
        elif kind in ("script-flush", "restart"):
            self.r.script_flush()
            self.settle()
        elif kind == "node-start" and len(self.node.incarnations) < MAX_INCARNATIONS:
            self.node_start()
        elif kind.startswith("node-evict") and can_evict:
            self.node_evicts_predecessor(data, kind == "node-evict-stale")
        elif self.node.incarnations:
            self.node_heartbeat(data)
        else:
            self.node_start()

    def node_start(self) -> None:
        inc = f"i{self._next()}"
        self.node.incarnations.append(inc)
        reply = self.mgr.channel.call(
            "node_start",
            [node_key(PREFIX, NODENAME)],
            [inc, *self._record_args(), IV_MS, REC_TTL_MS],
        )
        if self.node.record is None:
            assert reply == ["new"], reply
            self.node.record = (inc, 0)
            self.node.owning = inc
        else:
            assert reply[:3] == ["other", self.node.record[0], str(self.node.record[1])], reply
        self.settle()

    def node_heartbeat(self, data: st.DataObject) -> None:
        """One tick of a worker's heartbeat; children that exited are freed."""
        inc = data.draw(st.sampled_from(self.node.incarnations), label="incarnation")
        group = sorted(self.node.groups.get(inc, set()))
        exited = set(
            data.draw(st.lists(st.sampled_from(group), unique=True), label="exited")
            if group
            else []
        )
        tags = [self.idents[o].tag for o in group if o not in exited]
        reply = self.mgr.channel.call(
            "node_heartbeat",
            [node_key(PREFIX, NODENAME), group_key(PREFIX, inc), tomb_key(PREFIX, inc)],
            [
                inc,
                TTL_MS,
                PREFIX,
                REC_TTL_MS,
                "1" if self.node.owning == inc else "0",
                IV_MS,
                "",  # the model's main process registers no owner of its own
                "4242",
                *tags,
            ],
        )
        if inc in self.node.tombs:
            assert reply == ["evicted"], reply
            self.settle()
            return
        if self.node.owning == inc and self.node.record is None:
            # Redis lost the record it owned: refresh nothing, re-create
            # nothing (Node continues as a fresh incarnation: node_start).
            assert reply == ["gone", "record"], reply
            self.node.owning = None
            self.settle()
            return
        dead = dict(zip(reply[7][::2], reply[7][1::2]))
        lost = dict(zip(reply[8][::2], reply[8][1::2]))
        assert set(dead) == exited, (reply, exited)
        assert set(lost) == {o for o in group if o not in exited and not self.model.alive(o)}, reply
        rec = self.node.record
        if rec is not None and rec[0] == inc:
            self.node.record = (inc, rec[1] + 1)
        owned = self.node.record is not None and self.node.record[0] == inc
        assert int(reply[1]) == int(owned), (reply, self.node)
        for oid in [*dead, *lost]:  # Node._free: force cleanup, leave the group
            expect = self.expected_cleanup(oid)
            report = self.mgr.cleanup_owner(oid, force=True)
            assert report.released == expect, (report, expect)
            self.free_owner(oid, report)
            self.r.hdel(group_key(PREFIX, inc), oid)
            self.node.groups[inc].discard(oid)
            # Freeing one may hand its locks to a waiter freed next.
            self.view = read_view(self.r)
            self.sync_handoffs(self.view)
        self.settle()

    def node_evicts_predecessor(self, data: st.DataObject, stale: bool) -> None:
        """A successor whose predecessor's heartbeat stopped evicts it (threshold 0)."""
        assert self.node.record is not None
        pred, hb = self.node.record
        succ = data.draw(
            st.sampled_from([i for i in self.node.incarnations if i != pred]), label="successor"
        )
        reply = self.mgr.channel.call(
            "node_evict",
            [node_key(PREFIX, NODENAME)],
            [
                PREFIX,
                pred,
                str(hb + 1 if stale else hb),
                "0",
                "evict",
                succ,
                *self._record_args(),
                IV_MS,
                REC_TTL_MS,
                REC_TTL_MS,
                str(3 * int(TTL_MS)),  # the evicted owners' tombstones
            ],
        )
        if stale:  # it beat since we looked: nothing touched
            assert reply == ["changed", pred, str(hb)], reply
            self.settle()
            return
        group = self.node.groups.get(pred, set())
        assert reply[0] == "evicted" and set(reply[1]) == group, (reply, group)
        self.node.tombs.add(pred)
        self.node.record = (succ, 0)
        self.node.owning = succ
        for oid in group:
            self.model.kill(oid)
        self.view = read_view(self.r)
        for oid in sorted(group):  # Node._evict: force cleanup, then drop the group
            expect = self.expected_cleanup(oid)
            report = self.mgr.cleanup_owner(oid, force=True)
            assert report.released == expect, (report, expect)
            self.free_owner(oid, report)
            self.view = read_view(self.r)
            self.sync_handoffs(self.view)
        self.r.delete(group_key(PREFIX, pred))
        self.node.groups.pop(pred, None)
        self.settle()

    # -- rules: the server -----------------------------------------------

    def restart_without_persistence(self) -> None:
        """Everything is lost: every lease, liveness, queue and node record."""
        self.r.flushall()
        self.r.script_flush()
        self.model.flush()
        if self.clock_fences is not None:
            # Tokens counted up from a counter that was ahead of the clock
            # are not above the clock after a data loss (docs/design.md,
            # Known limits): only those taken from the clock must stay below.
            self.model.max_fence, self.clock_fences = self.clock_fences, None
        self.node.record, self.node.owning = None, None
        self.node.tombs.clear()
        self.node.groups.clear()
        self.adopted.clear()
        self.settle()

    # -- after every step ------------------------------------------------

    def sync_handoffs(self, view: View) -> None:
        """Hand-offs a script made: check them and record them as grants."""
        batch = [
            q for q in self.model.with_state("queued") if q.token in view.lock(next(iter(q.modes)))
        ]
        names = {q.token for q in batch}
        for q in batch:
            assert self.model.alive(q.owner), f"hand-off to {q.token} of a dead owner"
            assert not q.stale, f"hand-off to {q.token}, whose request state expired"
            values = {res: view.lock(res).get(q.token) for res in q.modes}
            fences = {fence_of(v) for v in values.values() if v}
            assert all(v and v[0] == q.modes[res] for res, v in values.items()), (q, values)
            assert len(fences) == 1, (q, values)
            assert view.wake(q.token)[:1] == [f"g{fences.pop()}"], (q, view.wake(q.token))
            assert not self.model.fifo_violations(q, names), (
                f"hand-off to {q.token} overtook {self.model.fifo_violations(q, names)}"
            )
            for h in self.model.live_grants():
                for res, mode in q.modes.items():
                    assert res not in h.modes or not conflicts(mode, h.modes[res]), (q, h)
        if batch:
            note(f"hand-off x{len(batch)}")
            slots = sum(1 for q in batch if LIMITED in q.modes)
            if slots:
                note(f"hand-off: {slots} slot(s)")
        for q in sorted(batch, key=lambda q: fence_of(view.lock(next(iter(q.modes)))[q.token])):
            self.model.grant(q, fence_of(view.lock(next(iter(q.modes)))[q.token]))
            q.handed_off = True

    def settle(self) -> None:
        note("rule " + sys._getframe(1).f_code.co_name)
        before = self.view
        view = self.view = read_view(self.r)
        self.sync_handoffs(view)
        self.check_keys(view)
        self.check_locks(view)
        self.check_queues(view)
        self.check_push(before, view)
        self.check_node(view)

    def check_keys(self, view: View) -> None:
        model = self.model
        for key in view.raw:
            assert key.startswith(PREFIX), f"key outside the namespace: {key!r}"
        alive = {o for o, _ in view.of_kind("alive")}
        assert alive == set(self.owners("alive")), f"liveness keys {alive} != model"
        seq = view.raw.get(PREFIX + "seq")
        assert int(seq or 0) == model.seq, (seq, model.seq)
        fence = view.raw.get(PREFIX + "fence")
        assert fence is None or int(fence) == model.max_fence, (fence, model.max_fence)
        current = {q.token for q in model.with_state("queued", "granted")}
        for kind in ("req", "wake", "contended"):
            for token, _ in view.of_kind(kind):
                key = PREFIX + kind + ":" + token
                if token not in current:
                    assert view.pttl[key] >= 0, f"{key} of an ended request, no TTL"
        for token, _ in view.of_kind("wake"):
            if view.pttl[PREFIX + "wake:" + token] < 0:
                q = model.requests[token]
                assert any(token in view.lock(res) for res in q.modes), (
                    f"wake list of {token} has no TTL and no grant: {view.wake(token)}"
                )
        for owner_id, lines in view.of_kind("waits"):
            for token, shape in lines.items():
                q = model.requests.get(token)
                assert q is not None and q.owner == owner_id and q.state == "queued", (
                    f"waits:{owner_id} names {token}, which is not queued ({q})"
                )
                assert shape == q.mode_string + "\n" + "\n".join(q.modes), (token, shape)
        for q in model.live_queued():
            lines = view.raw.get(PREFIX + "waits:" + q.owner) or {}
            assert q.token in lines, f"queued {q.token} is missing from waits:{q.owner}"
        no_ttl_kinds = {
            "lock",
            "q",
            "held",
            "owners",
            "fence",
            "born",
            "seq",
            "format",
            "group",
            "wake",
            "waits",
        }
        for key, ttl in view.pttl.items():
            kind = key[len(PREFIX) :].split(":", 1)[0]
            if ttl < 0:
                assert kind in no_ttl_kinds, f"{key} has no TTL"

    def check_locks(self, view: View) -> None:
        model = self.model
        holds: dict[str, set[str]] = {}
        for res, fields in view.of_kind("lock"):
            modes = [v[0] for v in fields.values()]
            assert modes.count("x") == 0 or len(modes) == 1, (
                f"incompatible holders of {res}: {fields}"
            )
            # A name is taken in one kind: limited, or exclusive and shared.
            assert modes.count("l") in (0, len(modes)), f"mixed kinds hold {res}: {fields}"
            assert modes.count("l") == 0 or res == LIMITED, f"{res} taken limited: {fields}"
            assert len(modes) <= SLOTS or res != LIMITED, (
                f"{len(modes)} holders of {res}, limit {SLOTS}: {fields}"
            )
            for token, value in fields.items():
                q = model.requests.get(token)
                assert q is not None and q.state == "granted", f"{res}: {token} is no grant ({q})"
                assert res in q.modes and value == q.lock_value(res), (res, token, value, q)
                holds.setdefault(q.owner, set()).add(res)
        for q in model.live_grants():
            for res in q.modes:
                assert q.token in view.lock(res), f"live grant {q.token} lost {res} in Redis"
        assert model.holders_of(LIMITED) <= SLOTS, f"{model.holders_of(LIMITED)} live slots"
        held = registry_view(view)
        assert held == holds, f"registry {held} != locks held {holds}"
        # Each registry value is the record of the owner's last grant on the
        # resource ('' for a plain lock). A name in both the main hash and a
        # bucket (two tokens, spilled in between) has it in one of them.
        values: dict[tuple[str, str], list[str]] = {}
        for key, fields in view.of_kind("held"):
            owner, bar, bucket = key.partition("|")
            if bar and not bucket:
                continue  # the bucket index
            for name, value in fields.items():
                values.setdefault((owner, name), []).append(value)
        for (owner, name), found in values.items():
            expected = model.records.get((owner, name), "")
            assert expected in found, f"registry of {owner}: {name} -> {found}, not {expected!r}"
        members = set(view.raw.get(PREFIX + "owners") or ())
        waiting = {q.owner for q in model.live_queued()}
        assert set(held) | waiting <= members, f"owners set {members} lacks {set(held) | waiting}"
        assert members <= set(model.owners), members

    def check_queues(self, view: View) -> None:
        model = self.model
        for res, entries in view.of_kind("q"):
            for member, score in entries:
                q = model.requests.get(member[1:])
                assert q is not None and q.state == "queued", (
                    f"q:{res}: {member} is not queued ({q})"
                )
                assert q.modes.get(res) == member[0] and q.score == int(score), (
                    res,
                    member,
                    score,
                    q,
                )
                assert not model.owners[q.owner].cleaned, (
                    f"q:{res}: entry {member} of {q.owner} left after its cleanup"
                )
        for q in model.live_queued():
            for res, mode in q.modes.items():
                assert (mode + q.token, q.score) in view.queue(res), (
                    f"{q.token} lost its place in {res}"
                )
            state = view.raw.get(PREFIX + "req:" + q.token)
            expected = {
                "state": "q",
                "seq": str(q.score),
                "modes": q.mode_string,
                "res": "\n".join(q.modes),
                "nested": "1" if q.nested else "0",
            }
            if q.holder:  # what the hand-off writes into the registry
                expected["holder"] = holder_record(q.token, q.holder)
            assert state == expected, (q, state)

    def dead_blocker(self, q: Request, view: View) -> bool:
        """Whether a holder or earlier entry that conflicts with ``q`` in
        ``view`` belongs to a dead owner or an expired request."""
        for res, mode in q.modes.items():
            tokens = [t for t, v in view.lock(res).items() if conflicts(mode, v[0]) or mode == "l"]
            tokens += [m[1:] for m, _ in view.ahead(q, res)]
            for t in tokens:
                w = self.model.requests.get(t)
                if t != q.token and (w is None or not self.model.alive(w.owner) or w.stale):
                    return True
        return False

    def check_push(self, before: View, view: View) -> None:
        """A queued request that nothing in Redis blocks was served or woken.

        Blocking here: any conflicting holder or earlier conflicting entry
        recorded in Redis, dead or alive (a death pushes nothing: the waiter
        runs again by the dead owner's liveness deadline), ``limit`` earlier
        live entries, or more dead entries than one scan removes; on a limited
        resource, its holders and the entries ahead, dead or alive, and the
        request itself are more than its limit. An earlier
        entry with a plain wake-up carries the wake-up on (wake_front's scan
        stopped by its budget inside a run of shared entries wakes the last
        one it read, whose own script, granting it, serves the rest). A request
        that a dead owner's entry or grant blocked before the step may be
        left to its liveness deadline (a dead multi-resource waiter removed
        from one queue leaves the others without waking them).
        """
        for q in self.model.live_queued():
            blocked = False
            for res, mode in q.modes.items():
                ahead = view.ahead(q, res)
                live = self.model.live_ahead(q, res)
                if live >= LIMIT or len(ahead) - live >= purge_budget(LIMIT):
                    blocked = True
                if any(conflicts(mode, m[0]) for m, _ in ahead):
                    blocked = True
                if any(view.wake(m[1:]) for m, _ in ahead):
                    blocked = True  # carried on by that entry's own run
                if any(t != q.token and conflicts(mode, v[0]) for t, v in view.lock(res).items()):
                    blocked = True
                # A limited resource: every holder and entry ahead in Redis
                # takes a slot, dead or alive.
                held = sum(1 for t in view.lock(res) if t != q.token)
                if mode == "l" and held + len(ahead) + 1 > q.limits[res]:
                    blocked = True
            if blocked or view.wake(q.token):
                continue
            if q.deadline_due or self.dead_blocker(q, before):
                note("push: left to a dead blocker's liveness deadline")
                q.deadline_due = True
                continue
            raise AssertionError(
                f"{q.token} {q.modes} is blocked by nothing in Redis but was neither handed "
                f"its locks nor woken: queues {[view.queue(r) for r in q.modes]}, "
                f"locks {[view.lock(r) for r in q.modes]}"
            )

    def check_node(self, view: View) -> None:
        rec = view.raw.get(node_key(PREFIX, NODENAME))
        expect = self.node.record
        got = (rec["inc"], int(rec["hb"])) if rec else None
        assert got == expect, (got, expect)
        tombs = {inc for inc, _ in view.of_kind("tomb")}
        assert tombs == self.node.tombs, (tombs, self.node.tombs)
        groups = {inc: set(v) for inc, v in view.of_kind("group")}
        assert groups == {i: g for i, g in self.node.groups.items() if g}, (
            groups,
            self.node.groups,
        )


# A failure is shrunk for up to about five minutes (hypothesis' own cap): the
# timeout must not cut that short (the minimal example would be lost and the
# interrupted run reported as flaky). A long exploration has no timeout.
@pytest.mark.timeout(0 if EXAMPLES > DEFAULT_EXAMPLES or STEPS > DEFAULT_STEPS else 900)
def test_protocol_matches_the_reference_model(redis_server: RedisServer) -> None:
    global _server
    _server = redis_server
    try:
        run_state_machine_as_test(
            ProtocolMachine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        _server = None
        print("model test:", dict(sorted(STATS.items())))


class _Draws:
    """Stands for hypothesis' ``data`` in a hand-written sequence of rules:
    each draw returns the next of the values given."""

    def __init__(self, *values: Any) -> None:
        self.values = list(values)

    def draw(self, strategy: Any, label: str = "") -> Any:
        return self.values.pop(0)


def test_a_dead_slot_holder_does_not_stall_a_request_behind_a_live_entry(
    redis_server: RedisServer,
) -> None:
    """The model's rules, in order: a slot of ``n`` (limit 2) whose owner
    dies; ``b`` held exclusive; a waiter of ``b`` and a slot of ``n`` queued
    (blocked by ``b`` only); then a request of a slot of ``n``. No live
    holder and one live entry ahead (0 + 1 + 1 <= 2): it is granted at once
    (dead holders never stall a free slot)."""
    global _server
    _server = redis_server
    m = ProtocolMachine()
    try:
        m.three_owners([False, False, False])  # node i1; owners o2, o3, o4
        m.acquire(_Draws("o2"), {LIMITED: "l"}, True, False)
        m.owner_dies(_Draws("o2"))
        m.acquire(_Draws("o3"), {"b": "x"}, True, False)
        m.acquire_waiting(_Draws("o4"), {"b": "x", LIMITED: "l"})
        m.new_owner(False)
        late_owner = list(m.model.owners)[-1]
        m.acquire_waiting(_Draws(late_owner), {LIMITED: "l"})
        # Granted by its first run (the machine checked the reply against
        # the model), the dead holder's slot freed on the way.
        assert any(h.owner == late_owner for h in m.model.live_grants())
        assert not any(q.owner == late_owner for q in m.model.live_queued())
    finally:
        m.teardown()
        _server = None
