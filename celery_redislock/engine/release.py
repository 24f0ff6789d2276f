"""Giving locks back: releases, deferred releases and their retries, contention.

:class:`Releaser` is the :class:`~celery_redislock.engine.lease.LeaseHost` of every
lease a manager grants: ``lease.release()``, ``lease.contenders()`` and
``lease.wait_for_contender()`` land here, one layer below the manager.
A release that fails on an exit path (Redis down, an interrupt) is kept as
a *deferred release* and retried by every heartbeat until it succeeds.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .. import _validate as _v
from ..exceptions import RedisUnavailable
from ..protocol.calls import contention
from ..protocol.causes import metric_label
from .shared import Part, Shared
from .state import ReleaseRetry

if TYPE_CHECKING:
    from ..protocol.request import Request
    from .identity import OwnerIdentity
    from .lease import Lease
    from .liveness import Liveness

__all__ = ["Releaser"]

log = logging.getLogger("celery_redislock.release")


class Releaser(Part):
    """Release grants and requests of this process (see the module docstring)."""

    def __init__(self, core: Shared, liveness: Liveness) -> None:
        super().__init__(core)
        self._liveness = liveness
        #: Failed retries of deferred releases (see :meth:`retry_deferred`).
        self.retry_failures = 0

    # -- LeaseHost --------------------------------------------------------

    def release(self, lease: Lease) -> bool:
        """Release ``lease``'s handle: True if this call did, False if an earlier one
        did (or the lease was inherited across a fork: nothing of it is released)."""
        if lease.released:
            return False
        if lease.pid != os.getpid():
            log.warning("release.skipped token=%s reason=inherited-across-fork", lease.token)
            lease.forget()
            return False
        state = self._state
        if lease.own and not lease.parents:
            # The usual lease: its own grant, nothing re-entered. One pass
            # under the lock (what drop_hold does for the general case).
            with state.lock:
                if not lease.close_handle():
                    return False
                if not lease.drop_hold():
                    return True
                state.leases.pop(lease.token, None)
            self.release_grant(lease)
            return True
        with state.lock:
            if not lease.close_handle():
                return False
        try:
            if lease.own:
                self.drop_hold(lease)
        finally:
            for parent in lease.parents:
                self.drop_hold(parent)
        return True

    def contenders(self, lease: Lease) -> int:
        """How many other requests wait for any of ``lease``'s resources."""
        return self.contention(lease)[0]

    def wait_for_contender(self, lease: Lease, timeout: float) -> bool:
        """Block until some request waits for ``lease``'s resources (see Lease)."""
        limit = _v.seconds("timeout", timeout, allow_inf=True)
        assert limit is not None
        deadline = time.monotonic() + limit
        while True:
            # Counted with watch=True: the streams exist (TTL 3 x owner_ttl,
            # renewed here at least every owner_ttl) while we read them.
            count, streams = self.contention(lease, watch=True)
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
            block_ms = self._options.contender_block_ms(remaining)
            with self._channel.errors("XREAD"):
                self._channel.conn().xread(streams, block=block_ms)  # type: ignore[arg-type]
                self._channel.done()

    def deadline_passed(self, ident: OwnerIdentity) -> None:
        """A lease of ``ident`` found the local deadline passed (no I/O here)."""
        self._liveness.owner_lost(ident, "deadline")

    def lease_lost(self, cause: str | None) -> None:
        """A lease was marked lost (metrics only)."""
        hook = self._telemetry.hook
        if hook is not None:
            hook.lease_lost(metric_label(cause))

    # -- releases ---------------------------------------------------------

    def run_release(
        self,
        owner_id: str,
        token: str,
        req: Request,
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
        call = self._channel.protocol.release(
            token, req, lease=lease, clean=clean, spilled=owner_id in self._state.spilled
        )
        return self._channel.call(call.name, call.keys, call.args, client=client)

    def end_request(self, owner_id: str, token: str, req: Request, quiet: bool = False) -> None:
        """Release or dequeue a request that is not returning a lease.

        ``quiet``: Redis never answered the request (it may not be there at
        all, e.g. Redis was down from the start): a failed clean-up is still
        retried like any deferred release, but logged at DEBUG, since no
        grant was ever seen.
        """
        try:
            self.run_release(owner_id, token, req)
        except BaseException as exc:  # even a second interrupt must not strand a grant
            self.defer(token, req)
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "release.deferred token=%s resources=%s error=%r",
                token,
                ",".join(req.resources),
                exc,
            )
            if not isinstance(exc, Exception):
                raise

    def defer(self, token: str, req: Request) -> None:
        """Keep the release of ``token`` for the heartbeat to retry."""
        with self._state.lock:
            self._state.deferred[token] = req
            self._state.again.discard(token)

    def release_again(self, token: str, req: Request) -> None:
        """Release ``token`` once more at the next heartbeat.

        For a request whose acquire script was cut short in flight (an
        interrupt while its reply was awaited) and then released: the script
        may still reach Redis after that release (sent on the connection the
        interrupt dropped, the release on a new one, which a proxy or a
        multi-threaded server may deliver first), and grant or queue the
        request with nobody left to release it. The second release, one
        heartbeat later, takes such a late grant or queue entry back. A
        release already deferred (it failed) is left as it is.
        """
        with self._state.lock:
            if token not in self._state.deferred:
                self._state.deferred[token] = req
                self._state.again.add(token)

    def drop_hold(self, lease: Lease, *, force: bool = False) -> None:
        """One fewer lease counts on ``lease``'s grant; at 0, release it in Redis."""
        with self._state.lock:
            if not lease.drop_hold(force=force):
                return
            self._state.leases.pop(lease.token, None)
        self.release_grant(lease)

    def release_grant(self, lease: Lease) -> None:
        """Release ``lease``'s grant in Redis (its count dropped to 0): one round trip."""
        hook = self._telemetry.hook
        if hook is not None:
            hook.held(time.time() - lease.acquired_at)
        req = lease.request
        try:
            reply = self.run_release(
                lease.owner_id, lease.token, req, lease=True, clean=lease.clean
            )
        except BaseException:
            self.defer(lease.token, req)
            raise
        released = int(reply[0])
        if released < len(req.modes):
            # Redis lost a grant of this owner (reclaimed, evicted, or a
            # failover to a replica that missed it): it may have lost the
            # owner's {ns}:owners entry with it, so the next grant lists the
            # owner again (see OwnerIdentity.listed).
            lease.ident.listed = False
        if released < len(req.modes) and not lease.lost:
            lease.mark_lost("declared-dead")
            log.warning(
                "release.partial owner=%s released=%d of=%d: the other grants were gone "
                "(reclaimed after the owner was declared dead, or lost by Redis in a "
                "failover or restart); the lease is marked lost",
                lease.owner_id,
                released,
                len(req.modes),
            )

    def retry_deferred(self, client: Any) -> None:
        """Retry the releases that failed on an exit path (deferred); never raises.

        Called by every heartbeat of this process: the manager's own
        heartbeat, a pool child's lost-owner watcher, the Celery worker's
        node heartbeat (main process: threads, solo, gevent and eventlet
        pools). Each deferred release backs off on failure (see
        :class:`~celery_redislock.engine.state.ReleaseRetry`); its first failure
        here is logged once (WARNING for an outage, ERROR with the reason for
        anything else, e.g. a foreign value at a lock key or an ACL NOPERM),
        later ones are only counted (:attr:`retry_failures`) until it
        succeeds.
        """
        state = self._state
        if not state.deferred:
            return
        now = time.monotonic()
        with state.lock:
            pending = list(state.deferred.items())
        for token, req in pending:
            retry = state.retries.get(token)
            if retry is not None and now < retry.next_at:
                continue
            owner_id = token.split("|", 1)[0]
            try:
                self.run_release(owner_id, token, req, client=client)
            except Exception as exc:  # one bad release must not stop the others
                self.retry_failures += 1
                if retry is None:
                    retry = state.retries[token] = ReleaseRetry()
                outage = isinstance(exc, RedisUnavailable)
                pause = retry.failed(now, self._options.heartbeat_interval if outage else 300.0)
                if retry.failures == 1:
                    self._log_retry_failed(token, req, exc, outage, pause)
                continue
            with state.lock:
                state.deferred.pop(token, None)
                again = token in state.again
                state.again.discard(token)
            state.retries.pop(token, None)
            log.log(
                logging.DEBUG if again and retry is None else logging.INFO,
                "release.retried token=%s failures=%d again=%s",
                token,
                retry.failures if retry is not None else 0,
                again,
            )

    @staticmethod
    def _log_retry_failed(
        token: str, req: Request, exc: Exception, outage: bool, pause: float
    ) -> None:
        if outage:
            log.warning(
                "release.retry-failed token=%s resources=%s error=%s: retrying "
                "on the heartbeat once Redis answers",
                token,
                ",".join(req.resources),
                exc,
            )
        else:
            log.error(
                "release.retry-failed token=%s resources=%s error=%r: cannot "
                "release; retrying quietly with backoff (next in %.3gs)",
                token,
                ",".join(req.resources),
                exc,
                pause,
            )

    # -- contention -------------------------------------------------------

    def contention(self, lease: Lease, watch: bool = False) -> tuple[int, dict[str, str]]:
        """contenders.lua: the count, and each contended stream's last entry id.

        ``watch``: when nobody waits, the streams are created (or kept) for
        3 x owner_ttl, so that acquire.lua signals the next request a holder
        blocks on them. A stream exists only while a holder watches it.
        """
        req = lease.request
        streams = [self.keys.contended(r) for r in req.resources]
        call = self._channel.protocol.contenders(lease.token, req, streams, watch=watch)
        return contention(streams, self._channel.run(call))
