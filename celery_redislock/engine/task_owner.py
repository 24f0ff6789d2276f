"""Grants owned by a task id, adopted by the process that runs the task.

A *task owner* (``task:<task id>``, ``task+<n>:<task id>`` for a retry,
``defer:<task id>`` for a parked deferred task) holds locks on behalf of a
task message while it travels through the broker, with a liveness of its
own that nobody refreshes. :meth:`TaskOwners.acquire_for_task` takes them
(never waiting, never queueing); the process that starts the task moves
them to its own owner with :meth:`TaskOwners.adopt`; a task owner nobody
adopts in time is dead like any other and its locks are reclaimed.
``UniqueTask`` and ``on_busy="defer"`` are built on this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from .. import _validate as _v
from ..exceptions import LockError, RedisUnavailable, ReplicationTimeout, permission_denied
from ..protocol.calls import adopted_grants, blocking_holder, text
from ..protocol.keys import task_id_of_token, task_owner_id, task_token, validate_owner_id
from ..protocol.reports import CleanupReport
from ..protocol.request import Request, RequestCache, ResourceNames
from ..store.channel import REDIS_DOWN_ERRORS
from .acquire import Acquirer
from .cleanup import Cleaner
from .identity import OwnerIdentity
from .lease import Lease
from .liveness import Liveness
from .release import Releaser
from .shared import Part, Shared
from .state import Depth

__all__ = ["Adoption", "TaskGrant", "TaskOwners"]

log = logging.getLogger("celery_redislock.acquire")


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
        holder_ttl: when refused by a task owner (a message not started
            yet), the seconds until its liveness runs out and the grant is
            free to take (one ``PTTL`` after the refusal); None when the
            holder is a process (its locks live as long as it does), not a
            task owner, or left meanwhile.
    """

    task_id: str
    granted: bool
    fencing_token: int | None
    token: str | None
    holder: str | None
    repeated: bool = False
    holder_ttl: float | None = None

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


class TaskOwners(Part):
    """Take locks for a task id; adopt them in the process that runs it."""

    def __init__(
        self,
        core: Shared,
        liveness: Liveness,
        releaser: Releaser,
        cleaner: Cleaner,
        acquirer: Acquirer,
        requests: RequestCache,
    ) -> None:
        super().__init__(core)
        self._liveness = liveness
        self._releaser = releaser
        self._cleaner = cleaner
        self._acquirer = acquirer
        self._requests = requests

    # -- acquire_for_task ---------------------------------------------------

    def acquire_for_task(
        self,
        task_id: str,
        exclusive: ResourceNames,
        shared: ResourceNames,
        *,
        ttl: float,
        attempt: int,
        holder: str | None,
    ) -> TaskGrant:
        """``LockManager.acquire_for_task`` (see its docstring)."""
        req = self._requests.get(exclusive, shared)
        if self._core.closed:
            raise self._acquirer.closed_error()
        owner = task_owner_id(task_id, attempt)
        ttl = _v.duration("ttl", ttl, minimum=_v.MIN_OWNER_TTL, maximum=_v.MAX_OWNER_TTL)
        token = task_token(owner, task_id)
        call = self._protocol.acquire(
            token,
            req,
            queue=False,  # never queue
            liveness_ms=str(int(ttl * 1000)),
            register=f"task={task_id}",  # registering: SET NX, or PEXPIRE when it exists
            holder=holder or "",
        )
        self._channel.gates()
        for _ in range(3):
            reply, holders, before, acked = self._run_then_read(owner, token, req, call.args)
            code = int(reply[0])
            if code == 1:
                if acked is not None and acked < self._options.wait_replicas:
                    self._task_grant_short(task_id, attempt, owner, req, acked)
                return TaskGrant(task_id, True, int(reply[1]), token, None, before is not None)
            if code == -1:
                raise LockError(
                    f"task owner {owner} was retired (its locks were adopted or cleaned up): "
                    "a task id can hold locks only once"
                )
            blocker = blocking_holder(req.modes, holders)
            if blocker is None:
                continue  # the holder left between the script and the read
            return TaskGrant(task_id, False, None, None, blocker, holder_ttl=self._ttl_of(blocker))
        return TaskGrant(task_id, False, None, None, None)

    def _ttl_of(self, blocker: str) -> float | None:
        """Seconds left of the liveness of ``blocker``'s owner when it is a
        task owner (one ``PTTL``), else None. A hint: None on any error."""
        owner = blocker.split("|", 1)[0]
        if not owner.startswith(("task:", "task+", "defer:", "defer+")):
            return None  # a process: its grants live as long as it does
        try:
            ms = int(self._channel.command("PTTL", self.keys.alive(owner)))
        except (LockError, redis.RedisError, ValueError, TypeError):
            return None
        return ms / 1000.0 if ms >= 0 else None

    def _run_then_read(
        self, owner: str, token: str, req: Request, args: list[Any]
    ) -> tuple[Any, list[Any], Any, int | None]:
        """acquire.lua, the holders' reads, forget_idle and WAIT: one round trip."""
        forget = self._protocol.forget_idle(owner)
        wait = self._options.wait_replicas
        try:
            return self._channel.scripts.run_then_read(
                "acquire",
                list(req.wire_locks),
                args,
                list(req.lock_keys),
                probe=(req.lock_keys[0], token),
                # A refused try leaves no liveness key behind for `ttl`.
                then=(forget.name, forget.keys),
                wait=(wait, self._options.wait_ms) if wait else None,
            )
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self._channel.url, exc) from exc
        except redis.ResponseError as exc:
            denied = permission_denied(exc, self._channel.url, "EVALSHA acquire + HGETALL")
            if denied is None:
                raise
            raise denied from exc

    def _task_grant_short(
        self, task_id: str, attempt: int, owner: str, req: Request, acked: int
    ) -> None:
        """Too few replicas acknowledged a task owner's grant: free it, raise.

        The call never waits, so both ``wait_policy`` values end here (as an
        acquire with ``timeout=0`` does): the task owner is released and
        retired (:meth:`release_task`), then :class:`ReplicationTimeout`.
        """
        opts = self._options
        log.warning(
            "acquire.replication-short token=%s resources=%s wanted=%d acknowledged=%d "
            "wait_timeout=%.3gs policy=%s: grant released",
            task_token(owner, task_id),
            ",".join(req.resources),
            opts.wait_replicas,
            acked,
            opts.wait_timeout,
            opts.wait_policy,
        )
        try:
            self.release_task(task_id, attempt)
        except LockError as exc:  # its liveness (the task's ttl) frees it
            log.error("acquire.release-error owner=%s error=%r", owner, exc)
        raise ReplicationTimeout(req.resources, 0.0, opts.wait_replicas, acked, opts.wait_timeout)

    def release_task(self, task_id: str, attempt: int = 0) -> CleanupReport:
        """``LockManager.release_task``: force-clean the task owner."""
        return self._cleaner.cleanup(task_owner_id(task_id, attempt), force=True)

    def hold_in_thread(self, leases: Iterable[Lease]) -> None:
        """Count adopted ``leases`` as held by the calling thread or greenlet:
        its nested acquires of their resources re-enter them (``@locked``
        runs an adopted deferred task's body in this thread)."""
        depth = self._state.depth()
        with self._state.lock:
            for lease in leases:
                if lease.grant_released or lease in depth.leases:
                    continue
                lease.count_in(depth)

    # -- adopt ------------------------------------------------------------

    def adopt(
        self,
        task_id: str,
        attempt: int,
        *,
        holder: str | None,
        park_record_ttl: float | None,
        owner: str | None,
    ) -> Adoption:
        """``LockManager.adopt`` (see its docstring)."""
        if owner is None:
            owner = task_owner_id(task_id, attempt)
        else:
            validate_owner_id(owner)
        if self._core.closed:
            raise self._acquirer.closed_error()
        ident = self._acquirer.start_liveness()
        record: tuple[str, str, float] | None = None
        if park_record_ttl is not None:
            record = (task_id, task_token(owner, task_id), park_record_ttl)
        reply: Any = None
        acked: int | None = None
        for _ in range(3):
            started = time.monotonic()
            reply, acked = self.run_adopt(ident, owner, holder, record)
            if int(reply[0]) != -1:
                break
            self._liveness.owner_lost(ident, "acquire")
            ident = self._liveness.identity.current()
        code = int(reply[0])
        if code == -1:
            raise LockError(f"owner {ident.owner_id} was declared dead while adopting {owner}")
        ident.registered = True
        if not self._liveness.confirm(ident, started, self._options.owner_ttl):
            self._liveness.owner_lost(ident, "deadline")
        if code == 0:
            why = text(reply[1])
            by = text(reply[2]) or None
            return Adoption(task_id, "adopted-elsewhere" if why == "adopted" else why, [], by)
        leases = self._adopted_leases(ident, reply)
        if leases and acked is not None and acked < self._options.wait_replicas:
            self._adoption_short(task_id, leases, acked)
        log.info("acquire.adopted task=%s owner=%s grants=%d", task_id, ident.owner_id, len(leases))
        return Adoption(task_id, "adopted", leases, ident.owner_id)

    def _adopted_leases(self, ident: OwnerIdentity, reply: Any) -> list[Lease]:
        """The leases of an adopt.lua reply, kept while ``ident`` is current."""
        leases: list[Lease] = []
        for grant in adopted_grants(reply):
            req = self._requests.from_spec(grant.names, grant.modes)
            # A depth of its own: adopted locks do not make the thread's next
            # acquire a nested one.
            leases.append(Lease(self._releaser, req, ident, grant.token, grant.fence, Depth()))
        with self._state.lock:
            current = self._liveness.identity.peek() is ident and not self._core.closed
            if current:
                for lease in leases:
                    self._state.leases[lease.token] = lease
        if not current:
            for lease in leases:
                lease.mark_lost()
        return leases

    def _adoption_short(self, task_id: str, leases: list[Lease], acked: int) -> None:
        """Too few replicas acknowledged an adoption: release its grants, raise."""
        opts = self._options
        names = [name for lease in leases for name in lease.resources]
        log.warning(
            "acquire.replication-short task=%s resources=%s wanted=%d acknowledged=%d "
            "wait_timeout=%.3gs policy=%s: adopted grants released",
            task_id,
            ",".join(names),
            opts.wait_replicas,
            acked,
            opts.wait_timeout,
            opts.wait_policy,
        )
        for lease in leases:
            try:
                lease.release()
            except LockError as exc:  # retried as a deferred release
                log.error("acquire.release-error token=%s error=%r", lease.token, exc)
        raise ReplicationTimeout(names, 0.0, opts.wait_replicas, acked, opts.wait_timeout)

    def run_adopt(
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
        make_group = self._liveness.group
        group = make_group() if (make_group is not None and not ident.registered) else None
        call = self._protocol.adopt(
            owner,
            ident.owner_id,
            register="" if ident.registered else ident.describe(self._options.name),
            group=group,
            tag=ident.tag,
            holder=holder,
            record=record,
        )
        wait = self._options.wait_replicas
        if wait:
            reply, acked = self._channel.run(call, wait=wait)
            return reply, int(acked)
        return self._channel.run(call), None
