"""The owner of an asyncio manager: its heartbeat task, its deadline, its loss.

One owner per manager, alive while the heartbeat task of the manager's
event loop runs. The deadline rule (:func:`~celery_redislock.protocol.owner.confirmed_until`)
and the loss codes (:func:`~celery_redislock.protocol.causes.loss_code`) are
the protocol's; this module runs them on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ..exceptions import LockError
from ..protocol.calls import Protocol
from ..protocol.causes import KEY_GONE, loss_code, lost_line
from ..protocol.owner import Owner, confirmed_until
from .channel import AsyncChannel
from .state import AsyncState

__all__ = ["AsyncLiveness"]

log = logging.getLogger("celery_redislock.acquire")
log_hb = logging.getLogger("celery_redislock.heartbeat")
log_release = logging.getLogger("celery_redislock.release")


class AsyncLiveness:
    """The current owner, its heartbeat task and what its loss does."""

    def __init__(self, state: AsyncState, channel: AsyncChannel, protocol: Protocol) -> None:
        self.state = state
        self.channel = channel
        self.protocol = protocol
        self.options = protocol.options

    def current(self) -> Owner:
        """The current owner (a new one after a loss), its heartbeat task running."""
        state = self.state
        owner = state.owner
        if owner is None:
            owner = state.owner = Owner()
        if state.beat_task is None or state.beat_task.done():
            assert state.loop is not None
            state.beat_task = state.loop.create_task(self._heartbeat(), name="redislock-heartbeat")
        return owner

    async def stop(self) -> None:
        """Stop the heartbeat task (close)."""
        beat = self.state.beat_task
        if beat is not None and not beat.done():
            beat.cancel()
            try:
                await beat
            except BaseException:
                pass

    async def _heartbeat(self) -> None:
        """Refresh the owner's liveness every ``heartbeat_interval``; never raises."""
        failing = 0
        state = self.state
        while not state.closed:
            await asyncio.sleep(self.options.heartbeat_interval)
            if state.closed or state.pid != os.getpid():
                return
            try:
                await self.beat()
            except LockError as exc:  # an outage: one line, not one per beat
                failing += 1
                if failing == 1:
                    log_hb.warning(
                        "heartbeat.unavailable thread=redislock-heartbeat error=%s: "
                        "retrying every tick",
                        exc,
                    )
            except Exception:  # a failed beat must not end the heartbeat
                log_hb.exception("heartbeat.error thread=redislock-heartbeat")
            else:
                if failing:
                    log_hb.info(
                        "heartbeat.resumed thread=redislock-heartbeat failed_beats=%d", failing
                    )
                    failing = 0

    async def beat(self) -> None:
        """One heartbeat: extend the owner's liveness (heartbeat.lua); then the upkeep."""
        owner = self.state.owner
        if owner is not None and owner.registered:
            started = time.monotonic()
            if self.lapsed(owner, started):
                self.lost_now(owner, "deadline", "deadline")
            else:
                grants = (
                    [
                        (x, key)
                        for x in self.state.leases.values()
                        if x.owner is owner and x.active
                        for key in x.request.lock_keys
                    ]
                    if self.channel.may_evict
                    else []
                )
                call = self.protocol.heartbeat(
                    owner.owner_id, [(x.token, key) for x, key in grants]
                )
                reply = await self.channel.run(call)
                if int(reply[0]) == 0:
                    await self.owner_lost(owner, "heartbeat")
                elif not self.confirm(owner, started):
                    self.lost_now(owner, "deadline", "deadline")
                else:
                    for (lease, key), ok in zip(grants, reply[1:]):
                        if int(ok) == 0 and lease.active:
                            lease.mark_lost("grant-gone")
                            log_hb.error(
                                "heartbeat.grant-gone owner=%s token=%s lock=%s fence=%d: "
                                "Redis no longer records this grant; the lease is lost",
                                lease.owner_id,
                                lease.token,
                                key,
                                lease.fencing_token,
                            )
        await self.upkeep()

    async def upkeep(self) -> None:
        """Force-clean owners retired by their deadline; retry deferred releases."""
        state = self.state
        for owner_id in list(state.doomed):
            call = self.protocol.cleanup(owner_id, force=True, closing=False, reason="dead")
            await self.channel.run(call)
            state.doomed.discard(owner_id)
            log.info("cleanup.retired-owner owner=%s", owner_id)
        for token, req in list(state.deferred.items()):
            owner_id = token.split("|", 1)[0]
            call = self.protocol.release(
                token, req, lease=False, clean=False, spilled=owner_id in state.spilled
            )
            await self.channel.run(call)
            state.deferred.pop(token, None)
            log_release.info("release.retried token=%s", token)

    # -- the deadline and loss --------------------------------------------

    def lapsed(self, owner: Owner, now: float) -> bool:
        """Whether ``owner``'s deadline passed while it holds a lease."""
        if not owner.valid_until or now <= owner.valid_until:
            return False
        return any(x.owner is owner and x.active for x in self.state.leases.values())

    def confirm(self, owner: Owner, started: float) -> bool:
        """A refresh sent at ``started`` succeeded: move the deadline forward.

        False when the deadline had already passed with a lease held (the
        leases are lost, whatever Redis says now).
        """
        if self.lapsed(owner, started):
            return False
        owner.valid_until = confirmed_until(
            owner.valid_until, started, self.options.owner_ttl, self.options.liveness_margin
        )
        return True

    async def owner_lost(self, owner: Owner, where: str) -> None:
        """The owner's liveness key is gone: read why, then :meth:`lost_now`."""
        if where in KEY_GONE:
            self.channel.format_pending = True
        state = self.state
        if state.owner is not owner:
            return
        state.owner = None  # retired first: no acquire registers it again meanwhile
        fences = [x.fencing_token for x in state.leases.values() if x.owner is owner]
        try:
            tomb, counter, born = await self.channel.read_loss(owner.owner_id)
            cause = loss_code(tomb, counter, born, max(fences, default=None))
        except Exception as exc:  # the cause is a courtesy: never fail the loss on it
            log_hb.debug("heartbeat.lost-reason-error owner=%s error=%r", owner.owner_id, exc)
            cause = "expired"
        self.lost_now(owner, where, cause, retired=True)

    def lost_now(self, owner: Owner, where: str, cause: str, *, retired: bool = False) -> None:
        """Retire ``owner`` and mark its leases lost; logs once per owner."""
        state = self.state
        if not retired:
            if state.owner is not owner:
                return
            state.owner = None
        lost = [x for x in state.leases.values() if x.owner is owner]
        if where == "deadline" and owner.registered:
            state.doomed.add(owner.owner_id)
        log_hb.error(*lost_line(owner.owner_id, len(lost), where, cause))
        for lease in lost:
            lease.mark_lost(cause)
