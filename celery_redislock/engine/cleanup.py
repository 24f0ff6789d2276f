"""Freeing dead owners: ``cleanup_owner``, ``reconcile``, retired owners, close.

Every path walks only the dead owner's registry: O(its locks), never a
SCAN of the keyspace. :meth:`Cleaner.reconcile` walks ``{ns}:owners``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import redis

from .. import _validate as _v
from ..exceptions import ConfigurationError, LockError, PermissionDenied, permission_denied
from ..protocol.calls import text
from ..protocol.causes import CLEANUP_REASONS
from ..protocol.keys import validate_owner_id
from ..protocol.reports import CleanupReport, ReconcileReport
from .liveness import Liveness
from .release import Releaser
from .shared import Part, Shared

__all__ = ["Cleaner"]

log = logging.getLogger("celery_redislock.cleanup")
log_reconcile = logging.getLogger("celery_redislock.reconcile")
log_release = logging.getLogger("celery_redislock.release")


class Cleaner(Part):
    """Free the locks of owners that are dead (or forced)."""

    def __init__(self, core: Shared, liveness: Liveness, releaser: Releaser) -> None:
        super().__init__(core)
        self._liveness = liveness
        self._releaser = releaser

    def cleanup_owner(
        self, owner_id: str, *, force: bool = False, reason: str = "dead"
    ) -> CleanupReport:
        """``LockManager.cleanup_owner``: validate, then :meth:`cleanup`."""
        validate_owner_id(owner_id)
        force = _v.flag("force", force)
        if reason not in CLEANUP_REASONS:
            raise ConfigurationError(
                "reason", f"must be one of {', '.join(CLEANUP_REASONS)}, not {reason!r}"
            )
        return self.cleanup(owner_id, force=force, reason=reason)

    def cleanup(
        self,
        owner_id: str,
        *,
        force: bool,
        client: Any = None,
        closing: bool = False,
        reason: str = "dead",
    ) -> CleanupReport:
        """One run of cleanup_owner.lua (see ``LockManager.cleanup_owner``)."""
        call = self._channel.protocol.cleanup(owner_id, force=force, closing=closing, reason=reason)
        reply = self._channel.run(call, client)
        report = CleanupReport.from_reply(owner_id, reply)
        for key, kind in report.skipped:
            log.warning(
                "cleanup.skipped owner=%s key=%s type=%s (kept in the registry)",
                owner_id,
                key,
                kind,
            )
        for key, msg in report.errors:
            log.error("cleanup.key-error owner=%s key=%s error=%s", owner_id, key, msg)
        if report.status != "alive":
            log.info(
                "cleanup.freed owner=%s locks=%d status=%s",
                owner_id,
                report.released,
                report.status,
            )
        return report

    def reconcile(self, *, batch_size: int = 500) -> ReconcileReport:
        """``LockManager.reconcile``: free every dead owner in ``{ns}:owners``."""
        batch_size = _v.integer("batch_size", batch_size, minimum=1, maximum=10000)
        report = ReconcileReport()
        seen: set[str] = set()
        cursor: int = 0
        while True:
            with self._channel.errors("SSCAN"):
                cursor, members = self._channel.conn().sscan(
                    self.keys.owners, cursor, count=batch_size
                )
                self._channel.done()
            batch = [m for m in (text(x) for x in members) if m not in seen]
            seen.update(batch)
            if batch:
                self._reconcile_batch(batch, report)
            if int(cursor) == 0:
                break
        log_reconcile.info(
            "reconcile.done owners=%d alive=%d cleaned=%d partial=%d released=%d errors=%d",
            report.owners_seen,
            report.alive,
            report.cleaned,
            report.partial,
            report.released,
            len(report.errors),
        )
        return report

    def _reconcile_batch(self, batch: list[str], report: ReconcileReport) -> None:
        pipe = self._channel.pipeline()
        for owner in batch:
            pipe.exists(self.keys.alive(owner))
        try:
            alive = pipe.execute()
        except redis.ResponseError as exc:
            raise (permission_denied(exc, self._channel.url, "EXISTS") or exc) from exc
        for owner, is_alive in zip(batch, alive):
            report.owners_seen += 1
            if is_alive:
                report.alive += 1
                continue
            try:
                rep = self.cleanup_owner(owner)
                report.add(rep)
                hook = self._telemetry.hook
                if hook is not None and rep.status != "alive":
                    hook.cleaned("reconcile")
            except PermissionDenied:
                raise  # not this owner's failure: every other one would fail too
            except (redis.RedisError, LockError) as exc:
                report.errors[owner] = repr(exc)
                log_reconcile.error("reconcile.owner-error owner=%s error=%r", owner, exc)

    def bury_doomed(self, client: Any) -> None:
        """Force-clean this process's owners retired by their local deadline."""
        state = self._state
        if not state.doomed:
            return
        with state.lock:
            doomed = list(state.doomed)
        for owner in doomed:
            report = self.cleanup(owner, force=True, client=client)
            with state.lock:
                state.doomed.discard(owner)
            log.info(
                "cleanup.retired-owner owner=%s locks=%d status=%s",
                owner,
                report.released,
                report.status,
            )

    def close_owner(self) -> None:
        """Release this process's leases and retire its owner (``close``)."""
        state = self._state
        with state.lock:
            leases = [x for x in state.leases.values() if x.pid == os.getpid()]
        unreachable: BaseException | None = None
        for lease in leases:
            if unreachable is None:
                try:
                    lease.close_handle(uncount=False)
                    self._releaser.drop_hold(lease, force=True)
                    continue
                except Exception as exc:
                    unreachable = exc
            lease.mark_lost("expired")
        identity = self._liveness.identity
        ident = identity.peek()
        if ident is None:
            return
        identity.retire(ident)
        for lease in state.of_owner(ident.owner_id):  # granted meanwhile: not returned
            lease.mark_lost("expired")
        if unreachable is not None:
            log_release.warning(
                "release.close-unreachable owner=%s leases_lost=%d error=%r",
                ident.owner_id,
                len(leases),
                unreachable,
            )
            return
        if ident.registered and self._liveness.own_heartbeat:
            try:
                self.cleanup(ident.owner_id, force=True, closing=True)
            except Exception as exc:  # its liveness expires on its own
                log.warning("cleanup.close-error owner=%s error=%r", ident.owner_id, exc)
