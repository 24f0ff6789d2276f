"""Giving locks back from asyncio code: releases, deferred releases, contention.

:class:`AsyncReleaser` is the :class:`~celery_redislock.asyncio.lease.LeaseHost`
of every lease an :class:`~celery_redislock.asyncio.AsyncLockManager` grants.
Every release runs in a task shielded from the caller's cancellation (a
release that was sent completes); one that fails is kept as a *deferred
release* and retried by every heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .. import _validate as _v
from ..protocol.calls import Protocol, contention
from .channel import AsyncChannel
from .state import AsyncState

if TYPE_CHECKING:
    from ..protocol.owner import Owner
    from ..protocol.request import Request
    from .lease import AsyncLease
    from .liveness import AsyncLiveness

__all__ = ["AsyncReleaser"]

log_release = logging.getLogger("celery_redislock.release")


class AsyncReleaser:
    """Release grants and requests of one asyncio manager (see the module docstring)."""

    def __init__(
        self,
        state: AsyncState,
        channel: AsyncChannel,
        protocol: Protocol,
        liveness: AsyncLiveness,
    ) -> None:
        self.state = state
        self.channel = channel
        self.protocol = protocol
        self.liveness = liveness

    # -- LeaseHost --------------------------------------------------------

    async def release_lease(self, lease: AsyncLease) -> bool:
        """:meth:`AsyncLease.release` (shielded: a sent release completes)."""
        if lease.released:
            return False
        if lease.pid != os.getpid():
            log_release.warning(
                "release.skipped token=%s reason=inherited-across-fork", lease.token
            )
            lease.forget()
            return False
        if not lease.mark_released():
            return False
        try:
            if lease.own:
                await self.drop_hold(lease)
        finally:
            for parent in lease.parents:
                await self.drop_hold(parent)
        return True

    async def drop_hold(self, lease: AsyncLease, *, force: bool = False) -> None:
        """One fewer lease counts on ``lease``'s grant; at 0, release it in Redis."""
        if not lease.drop_hold(force=force):
            return
        self.state.leases.pop(lease.token, None)
        await asyncio.shield(self.state.keep(asyncio.ensure_future(self._release_grant(lease))))

    async def _release_grant(self, lease: AsyncLease) -> None:
        req = lease.request
        call = self.protocol.release(
            lease.token,
            req,
            lease=True,
            clean=lease.clean,
            spilled=lease.owner_id in self.state.spilled,
        )
        try:
            reply = await self.channel.run(call)
        except BaseException:
            self.state.deferred[lease.token] = req
            raise
        released = int(reply[0])
        if released < len(req.modes):
            lease.owner.listed = False
            if not lease.lost:
                lease.mark_lost("declared-dead")
                log_release.warning(
                    "release.partial owner=%s released=%d of=%d: the other grants were gone; "
                    "the lease is marked lost",
                    lease.owner_id,
                    released,
                    len(req.modes),
                )

    async def lease_contenders(self, lease: AsyncLease) -> int:
        """:meth:`AsyncLease.contenders`: contenders.lua, one round trip."""
        return (await self._contention(lease, watch=False))[0]

    async def wait_for_contender(self, lease: AsyncLease, timeout: float) -> bool:
        """:meth:`AsyncLease.wait_for_contender`: count, then block on the
        contended streams (``XREAD``) until somebody waits or time is up."""
        limit = _v.seconds("timeout", timeout, allow_inf=True)
        assert limit is not None
        deadline = time.monotonic() + limit
        while True:
            # Counted with watch=True: the streams exist while we read them,
            # and the ids read with the count lose no signal in between.
            count, streams = await self._contention(lease, watch=True)
            if count:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            block_ms = self.protocol.options.contender_block_ms(remaining)
            await self.channel.command(
                "XREAD", "BLOCK", block_ms, "STREAMS", *streams.keys(), *streams.values()
            )

    async def _contention(self, lease: AsyncLease, *, watch: bool) -> tuple[int, dict[str, str]]:
        req = lease.request
        streams = [self.protocol.keys.contended(r) for r in req.resources]
        call = self.protocol.contenders(lease.token, req, streams, watch=watch)
        return contention(streams, await self.channel.run(call))

    def deadline_passed(self, owner: Owner) -> None:
        """A lease of ``owner`` found the local deadline passed (no I/O)."""
        self.liveness.lost_now(owner, "deadline", "deadline")

    # -- requests that return no lease --------------------------------------

    async def abandon(self, inflight: asyncio.Future[Any] | None, token: str, req: Request) -> None:
        """An acquire ends without a lease: end its request by its own token.

        Run in a task shielded from the cancellation that may have ended the
        acquire (it waits for an acquire call still in flight first).
        Cancelled again meanwhile, the task goes on by itself;
        :meth:`AsyncLockManager.close` waits for it.
        """
        gone = self.state.leases.pop(token, None)
        if gone is not None:
            gone.mark_released()
            gone.forget()
        task = asyncio.ensure_future(self.end_request(inflight, token, req))
        await asyncio.shield(self.state.keep(task))

    async def end_request(
        self, inflight: asyncio.Future[Any] | None, token: str, req: Request
    ) -> None:
        """release.lua for a request that returns no lease; deferred on failure."""
        if inflight is not None:
            try:
                await inflight
            except BaseException:
                pass
        owner_id = token.split("|", 1)[0]
        call = self.protocol.release(
            token, req, lease=False, clean=False, spilled=owner_id in self.state.spilled
        )
        try:
            await self.channel.run(call)
        except Exception as exc:
            self.state.deferred[token] = req
            log_release.warning(
                "release.deferred token=%s resources=%s error=%r",
                token,
                ",".join(req.resources),
                exc,
            )
