"""Staying alive, and noticing and declaring a loss.

:class:`Liveness` owns this process's owner identity, its heartbeat thread
and the local liveness deadline of its leases (docs/design.md, "Loss
model"). Whatever finds the owner lost (its heartbeat, an acquire's reply,
the lost-owner watcher, the worker's node heartbeat, the deadline) calls
:meth:`Liveness.owner_lost`, which retires the identity, marks its leases
lost and logs ``heartbeat.lost`` once, with the cause.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol.calls import text
from ..protocol.causes import KEY_GONE, loss_code, lost_line
from ..protocol.owner import confirmed_until
from ..store.connect import AnyRedis, clone_client
from .heartbeat import Heartbeat
from .identity import IdentitySource, OwnerIdentity
from .shared import Part, Shared

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["Liveness"]

log = logging.getLogger("celery_redislock.heartbeat")


class Liveness(Part):
    """This process's owner: identity, heartbeat, deadline, loss.

    ``on_fork``: called in a forked child before anything else runs there
    (the manager resets every part). ``upkeep(client)``: the work every
    heartbeat does after the refresh (put retired owners to death, retry
    deferred releases), handed in by the manager; it is set after
    construction, since the parts doing it sit above this one.
    """

    def __init__(self, core: Shared, on_fork: Callable[[], None]) -> None:
        super().__init__(core)
        self.identity = IdentitySource(on_fork=on_fork)
        self.upkeep: Callable[[AnyRedis], None] = lambda client: None
        self.heartbeat = Heartbeat(
            core.options.heartbeat_interval, self.beat, "redislock-heartbeat", self.heartbeat_failed
        )
        self._hb_client: AnyRedis | None = None
        self._hb_client_pid = 0
        #: The process in which ``heartbeat=False`` and ``group`` apply (see
        #: :meth:`become_member`); every other process is standalone.
        self._member_pid = os.getpid()

    def after_fork_in_child(self) -> None:
        """A forked child: its own heartbeat and heartbeat client."""
        self._hb_client = None
        self.heartbeat.after_fork_in_child()

    # -- identity ---------------------------------------------------------

    @property
    def own_heartbeat(self) -> bool:
        """Whether this process refreshes its owner's liveness itself.

        True when built with ``heartbeat=True``, and in any process other
        than the member process (a helper forked from a worker process).
        """
        return self._options.heartbeat or self._member_pid != os.getpid()

    @property
    def group(self) -> Callable[[], str | None] | None:
        """The group callable in the member process; None anywhere else."""
        return self._options.group if self._member_pid == os.getpid() else None

    def become_member(self) -> None:
        """Make this process the member: ``heartbeat=False`` and ``group`` apply.

        Called by the Celery integration in a pool child, from
        ``worker_process_init`` (only real pool children send it), before
        the child acquires anything. No I/O; idempotent. The parent stays
        the member of its own copy.
        """
        self._member_pid = os.getpid()

    def heartbeat_client(self) -> AnyRedis:
        """The client of this process's background threads (its own pool)."""
        if self._hb_client is None or self._hb_client_pid != os.getpid():
            self._hb_client = clone_client(self._channel.client)
            self._hb_client_pid = os.getpid()
        return self._hb_client

    def close(self) -> None:
        """Close this process's heartbeat client (every connection of its pool)."""
        if self._hb_client is not None and self._hb_client_pid == os.getpid():
            self._hb_client.close()

    def heartbeat_failed(self) -> None:
        """A heartbeat of this process failed (metrics only)."""
        hook = self._telemetry.hook
        if hook is not None:
            hook.heartbeat_failed()

    # -- the deadline -----------------------------------------------------

    def confirm(self, ident: OwnerIdentity, started: float, ttl: float) -> bool:
        """Record a confirmed refresh of ``ident``'s liveness; False if too late.

        ``started`` is :func:`time.monotonic` taken *before* the request was
        sent, ``ttl`` the seconds the key had left after it (owner_ttl for a
        PEXPIRE, the PTTL read by a lost-owner watcher): the key cannot expire
        in Redis before ``started + ttl``. The lease deadline becomes that,
        less the liveness margin. A refresh that started after the previous
        deadline had passed is refused (False): the owner must be treated as
        lost, since its key may have expired, its locks been reclaimed and
        the key re-created in between.
        """
        with self._state.lock:
            if self._lapsed_locked(ident, started):
                return False
            ident.valid_until = confirmed_until(
                ident.valid_until, started, ttl, self._options.liveness_margin
            )
            return True

    def lapsed(self, ident: OwnerIdentity, now: float) -> bool:
        """Whether ``ident``'s deadline passed while it holds a lease."""
        with self._state.lock:
            return self._lapsed_locked(ident, now)

    def _lapsed_locked(self, ident: OwnerIdentity, now: float) -> bool:
        # A deadline that passed while the owner held nothing costs nothing:
        # an idle pool child, whose refreshes it does not watch, must not be
        # declared lost at its next acquire. Only a lease makes it a loss.
        if not ident.valid_until or now <= ident.valid_until:
            return False
        return any(x.owner_id == ident.owner_id and x.active for x in self._state.leases.values())

    # -- loss -------------------------------------------------------------

    def loss_reason(self, owner_id: str, fence: int | None = None) -> str:
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
            pipe = self._channel.pipeline()
            pipe.get(self.keys.dead(owner_id))
            pipe.exists(self.keys.fence)
            pipe.get(self.keys.born)
            tomb, counter, born = pipe.execute()
        except Exception as exc:  # the cause is a courtesy: never fail the loss on it
            log.debug("heartbeat.lost-reason-error owner=%s error=%r", owner_id, exc)
            return "expired"
        return loss_code(
            None if tomb is None else text(tomb),
            int(counter),
            None if born is None else int(born),
            fence,
        )

    def owner_lost(self, ident: OwnerIdentity, where: str, cause: str | None = None) -> None:
        """Retire ``ident`` and mark its leases lost; logs once per identity.

        ``where``: what found it (heartbeat, acquire, watch, node-heartbeat,
        declared-dead, deadline, ...); ``cause``: why, when the finder knows
        (a cleanup's reason code); otherwise a missing liveness key is
        explained by :meth:`loss_reason`.
        """
        if where in KEY_GONE:
            # The liveness key is gone: Redis may have lost its data, the
            # format key with it. Check (and re-create) it on the next call:
            # armed before the identity is retired, so that no new identity
            # of this process registers (and re-creates the fencing counter,
            # which would then read as older data) before the check.
            self._channel.format_pending = True
        if not self.identity.retire(ident):
            return
        if cause is None:
            if where in KEY_GONE:
                fences = [x.fencing_token for x in self._state.of_owner(ident.owner_id)]
                cause = self.loss_reason(ident.owner_id, max(fences, default=None))
            else:
                cause = where
        with self._state.lock:
            lost = [x for x in self._state.leases.values() if x.owner_id == ident.owner_id]
            if where == "deadline" and ident.registered:
                # Its key may still live (the pause was shorter in Redis's eyes,
                # or another process refreshes it): put it to death in Redis too.
                self._state.doomed.add(ident.owner_id)
        # Logged before the leases are marked: whatever the loss sets off
        # (a task failing, a child killed by on_lost="terminate") comes after.
        log.error(*lost_line(ident.owner_id, len(lost), where, cause))
        for lease in lost:
            lease.mark_lost(cause)
        if where == "deadline":
            self.heartbeat.wake()

    # -- the heartbeat ----------------------------------------------------

    def beat(self) -> None:
        """One heartbeat: extend this owner's liveness; then the upkeep.

        Never sends the refresh once the local deadline of an owner holding a
        lease has passed: that owner is lost (it may have expired, been
        reclaimed and been re-created meanwhile); it is force-cleaned instead.
        An outage (RedisUnavailable) is logged once by :class:`Heartbeat`.
        """
        client = self.heartbeat_client()
        ident = self.identity.peek()
        if ident is not None and ident.registered:
            started = time.monotonic()
            if self.lapsed(ident, started):
                self.owner_lost(ident, "deadline")
            else:
                grants = self._grants_to_verify(ident) if self._channel.may_evict else []
                call = self._channel.protocol.heartbeat(
                    ident.owner_id, [(x.token, key) for x, key in grants]
                )
                reply = self._channel.run(call, client)
                if int(reply[0]) == 0:
                    self.owner_lost(ident, "heartbeat")
                elif not self.confirm(ident, started, self._options.owner_ttl):
                    self.owner_lost(ident, "deadline")
                else:
                    self._grants_gone(grants, reply[1:])
        self.upkeep(client)

    def _grants_to_verify(self, ident: OwnerIdentity) -> list[tuple[Lease, str]]:
        with self._state.lock:
            leases = [
                x for x in self._state.leases.values() if x.owner_id == ident.owner_id and x.active
            ]
        return [(x, key) for x in leases for key in x.request.lock_keys]

    def _grants_gone(self, grants: list[tuple[Lease, str]], found: list[Any]) -> None:
        """Mark lost the leases whose grant Redis no longer records (evicted)."""
        for (lease, key), ok in zip(grants, found):
            if int(ok) == 0 and lease.active:
                lease.mark_lost("grant-gone")
                log.error(
                    "heartbeat.grant-gone owner=%s token=%s lock=%s fence=%d: Redis no longer "
                    "records this grant (the lock was evicted: maxmemory-policy is not "
                    "noeviction); the lease is lost",
                    lease.owner_id,
                    lease.token,
                    key,
                    lease.fencing_token,
                )
