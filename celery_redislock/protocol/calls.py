"""The engine's scripts as calls and replies, without I/O.

For each script of the lock engine, :class:`Protocol` builds its KEYS and
ARGV (see the header of each ``lua/<name>.lua``) from a validated request
and the manager's options, and the functions below read its reply. Nothing
here sends anything: a front-end (the threaded :class:`LockManager`, or
any other transport) sends each :class:`ScriptCall` and hands the reply
back, so the protocol is written once whatever carries it.

Only the lock keys of a request travel as KEYS of acquire.lua and
release.lua (the script builds the rest from the prefix), and the arguments
are bytes where they repeat: each argument costs the client an encoding on
every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from ..exceptions import InvalidResource
from .keys import FORMAT_VERSION, MODE_NAMES, UNVERSIONED_FORMAT, Keyspace, holder_record, text
from .options import EngineOptions
from .request import Request

__all__ = [
    "AdoptedGrant",
    "Protocol",
    "ScriptCall",
    "acquire_reclaimed",
    "acquire_transit",
    "adopted_grants",
    "blocking_holder",
    "text",
]


class ScriptCall(NamedTuple):
    """One script run: its name (``lua/<name>.lua``), KEYS and ARGV."""

    name: str
    keys: list[Any]
    args: list[Any]


class AdoptedGrant(NamedTuple):
    """One grant adopt.lua moved: its new token, fence, resources and their
    modes with the limits of its slots (:meth:`.RequestCache.from_spec`)."""

    token: str
    fence: int
    names: list[str]
    modes: str


class Protocol:
    """The script calls of one namespace with one manager's options."""

    def __init__(self, keys: Keyspace, options: EngineOptions) -> None:
        self.keys = keys
        self.options = options
        #: The prefix as the scripts receive it.
        self.wire_prefix = keys.prefix.encode()

    def acquire(
        self,
        token: str,
        req: Request,
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
    ) -> ScriptCall:
        """acquire.lua for ``token`` (see its header for each slot).

        ``register``: the liveness key's value when the call registers the
        owner ('' when it is registered); ``group``: the group hash the owner
        registers in (with its process ``tag``); ``holder``: who holds it
        (task name, task id and node), sent as the holder record that names
        this token's request id (:func:`~.keys.holder_record`); ``listed``:
        the owner is in ``{ns}:owners`` already; ``spill``: the owner holds
        many locks (its registry's buckets); ``first``: the token was never
        sent before (the caller must resend without it: :func:`resend`).
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
            self.wire_prefix,
            self.options.req_ttl_arg if req_ttl is None else req_ttl,
            self.options.limit_arg,
        ]
        if register or group is not None or holder:
            args += [register, tag, holder_record(token, holder) if holder else ""]
        return ScriptCall("acquire", keys, args)

    def release(
        self, token: str, req: Request, *, lease: bool, clean: bool, spilled: bool
    ) -> ScriptCall:
        """release.lua for one request (see its header)."""
        args: list[Any] = [
            token,
            req.wire_modes,
            self.wire_prefix,
            self.options.req_ttl_arg,
            self.options.limit_arg,
            (b"2" if clean else b"1") if lease else b"0",
            b"1" if spilled else b"0",
        ]
        return ScriptCall("release", list(req.wire_locks), args)

    def heartbeat(self, owner_id: str, grants: Sequence[tuple[str, str]] = ()) -> ScriptCall:
        """heartbeat.lua: refresh ``owner_id``'s liveness; ``grants``:
        ``(token, lock key)`` pairs to verify are still recorded."""
        return ScriptCall(
            "heartbeat",
            [self.keys.alive(owner_id), *(key for _, key in grants)],
            [str(int(self.options.owner_ttl * 1000)), "1", *(token for token, _ in grants)],
        )

    def cleanup(self, owner_id: str, *, force: bool, closing: bool, reason: str) -> ScriptCall:
        """cleanup_owner.lua for ``owner_id`` (see its header)."""
        return ScriptCall(
            "cleanup_owner",
            [self.keys.held(owner_id), self.keys.alive(owner_id), self.keys.owners],
            [
                owner_id,
                self.keys.prefix,
                "1" if force else "0",
                str(self.options.req_ttl_ms),
                str(self.options.queue_scan_limit),
                "1" if closing else "0",
                reason,
            ],
        )

    def contenders(
        self, token: str, req: Request, streams: list[str], *, watch: bool
    ) -> ScriptCall:
        """contenders.lua for a lease's request; ``streams``: its contended streams."""
        args: list[Any] = [token, self.options.limit_arg]
        if watch:
            args.append(str(self.options.req_ttl_ms))
        return ScriptCall("contenders", [*req.queue_keys, *streams], args)

    def format(self) -> ScriptCall:
        """format.lua: read (or record) the namespace's data format."""
        return ScriptCall(
            "format",
            [self.keys.format, self.keys.fence],
            [str(FORMAT_VERSION), str(UNVERSIONED_FORMAT)],
        )

    def adopt(
        self,
        task_owner: str,
        owner_id: str,
        *,
        register: str,
        group: str | None,
        tag: str,
        holder: str | None,
        record: tuple[str, str, float] | None,
    ) -> ScriptCall:
        """adopt.lua: ``owner_id`` adopts ``task_owner``'s grants (see its header).

        ``register``: the adopting owner's liveness value when it registers
        ('' when registered); ``record``: ``(task id, token, TTL s)`` of a
        park record to check and mark in the same step.
        """
        keys = [
            self.keys.held(task_owner),
            self.keys.alive(task_owner),
            self.keys.owners,
            self.keys.held(owner_id),
            self.keys.alive(owner_id),
            self.keys.adopted(task_owner),
            self.keys.dead(task_owner),
        ]
        if group is not None:
            keys.append(group)
        args: list[Any] = [
            task_owner,
            owner_id,
            self.keys.prefix,
            str(int(self.options.owner_ttl * 1000)),
            register,
            tag if group is not None else "",
            self.options.req_ttl_arg,
            self.options.limit_arg,
            holder or "",
        ]
        if record is not None:
            args += [record[0], record[1], str(max(1, int(record[2] * 1000)))]
        return ScriptCall("adopt", keys, args)

    def forget_idle(self, owner_id: str) -> ScriptCall:
        """forget_idle.lua: drop a refused task owner's liveness if it holds nothing."""
        return ScriptCall(
            "forget_idle",
            [self.keys.held(owner_id), self.keys.waits(owner_id), self.keys.alive(owner_id)],
            [],
        )


def resend(call: ScriptCall) -> list[Any]:
    """The ARGV of any resend of an acquire call made with ``first``: a
    retry after a lost reply must look for its earlier grant (no 'f')."""
    again = list(call.args)
    again[2] = call.args[2].replace("f", "")
    return again


def acquire_reclaimed(reply: Any) -> int:
    """Dead holders' grants an acquire reply says it freed (0 if none)."""
    code = int(reply[0])
    at = 2 if code == 1 else 3 if code == 0 else None
    if at is None or len(reply) <= at:
        return 0
    return int(reply[at])


def contention(streams: list[str], reply: Any) -> tuple[int, dict[str, str]]:
    """A contenders.lua reply: how many requests wait, and each contended
    stream's last entry id (what a holder that waits for one reads from)."""
    return int(reply[0]), dict(zip(streams, (text(x) for x in reply[1:])))


def acquire_transit(reply: Any) -> str:
    """The task id of a grant in transit an acquire reply (queued) names, or ''."""
    return text(reply[4]) if len(reply) > 4 else ""


def adopted_grants(reply: Any) -> list[AdoptedGrant]:
    """The grants an adopt.lua reply ``{1, entry...}`` moved."""
    out = []
    for entry in reply[1:]:
        token, fence, modes, *names = (text(x) for x in entry)
        out.append(AdoptedGrant(token, int(fence), names, modes))
    return out


def mode_refusal(reply: Any) -> InvalidResource:
    """The error of an acquire reply ``{-2, name, mode}``: the resource is
    held or queued for in a mode this request's may not meet."""
    name, mode = text(reply[1]), text(reply[2])
    if mode == "l":
        what = "as a limited resource, so it cannot also be taken exclusive or shared"
    else:
        what = f"{MODE_NAMES.get(mode, mode)}, so it cannot also be taken limited"
    return InvalidResource(
        f"resource {name!r} is held or waited for {what}: a name used with limited "
        "is only ever taken limited",
        name,
    )


def blocking_holder(modes: str, holders: Iterable[Any]) -> str | None:
    """The token of a grant that blocks a request of ``modes``, from each
    resource's lock hash (``HGETALL``, same order), or None if none does."""
    for mode, held in zip(modes, holders):
        for field, value in held.items():
            t, v = text(field), text(value)
            if mode == "x" or v.startswith("x"):
                return t
    return None


# -- a worker node's scripts (celery_redislock.node) -------------------------


def node_start(
    node_key: str, incarnation: str, record: list[str], interval_ms: int, record_ttl_ms: int
) -> ScriptCall:
    """node_start.lua: claim ``node_key`` for ``incarnation`` (see its header).

    ``record``: the node record's pid, host and start time."""
    return ScriptCall(
        "node_start",
        [node_key],
        [incarnation, *record, str(interval_ms), str(record_ttl_ms)],
    )


def node_evict(
    prefix: str,
    node_key: str,
    predecessor: str,
    heartbeat: str,
    threshold_ms: int,
    mode: str,
    incarnation: str,
    record: list[str],
    interval_ms: int,
    record_ttl_ms: int,
    ttl_ms: int,
) -> ScriptCall:
    """node_evict.lua: take ``node_key`` over from ``predecessor`` whose
    heartbeat (last seen ``heartbeat``) stopped (see its header)."""
    return ScriptCall(
        "node_evict",
        [node_key],
        [
            prefix,
            predecessor,
            heartbeat,
            str(threshold_ms),
            mode,
            incarnation,
            *record,
            str(interval_ms),
            str(record_ttl_ms),
            str(record_ttl_ms),
            str(3 * ttl_ms),
        ],
    )


def node_heartbeat(
    prefix: str,
    keys: list[str],
    incarnation: str,
    ttl_ms: int,
    record_ttl_ms: int,
    owner: bool,
    interval_ms: int,
    own_owner: str,
    live: list[str],
) -> ScriptCall:
    """node_heartbeat.lua: one tick of ``incarnation`` (see its header).

    ``keys``: the node record, group and tombstone keys (and the group of
    an incarnation being adopted); ``owner``: this node owns its record;
    ``own_owner``: this process's owner id ('' when none); ``live``: the
    tags of the live processes."""
    return ScriptCall(
        "node_heartbeat",
        keys,
        [
            incarnation,
            str(ttl_ms),
            prefix,
            str(record_ttl_ms),
            "1" if owner else "0",
            str(interval_ms),
            own_owner,
            *live,
        ],
    )


def node_stop(node_key: str, group_key: str, incarnation: str) -> ScriptCall:
    """node_stop.lua: release the node record and list the group's owners."""
    return ScriptCall("node_stop", [node_key, group_key], [incarnation])
