"""The acquire loop of an asyncio manager: run acquire.lua, wait, re-enter.

Every script call is built by :class:`~celery_redislock.protocol.calls.Protocol`
(the threaded manager's keys and ARGV); the wait bound, the outage bound
and the reentrancy rule are the protocol's too. What is this module's own
is the loop: the wait awaits the wake list's ``BLPOP`` in a task of its
own, and every exit (cancellation included) ends the request by its own
token in a task shielded from the cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import Any

from .. import _validate as _v
from ..exceptions import LockError, LockTimeout, RedisUnavailable
from ..protocol import reentry
from ..protocol.calls import Protocol, ScriptCall, mode_refusal, text
from ..protocol.keys import new_request_id, owner_description
from ..protocol.options import MIN_BLOCK
from ..protocol.outage import Outage
from ..protocol.owner import Owner
from ..protocol.replicas import replication_short
from ..protocol.request import Limits, Request, RequestCache, ResourceNames
from .channel import AsyncChannel
from .lease import AsyncLease
from .liveness import AsyncLiveness
from .release import AsyncReleaser
from .state import AsyncState, TaskDepth

__all__ = ["AsyncAcquirer", "acquire_call"]


def acquire_call(
    protocol: Protocol,
    token: str,
    req: Request,
    owner: Owner,
    *,
    queue: bool,
    nested: bool,
    spill: bool,
) -> ScriptCall:
    """The acquire.lua call this front-end sends for ``token``: never the
    first-send flag (a resend must look for an earlier grant), no group, no
    holder record; registering ``owner`` until it is registered."""
    options = protocol.options
    return protocol.acquire(
        token,
        req,
        queue=queue,
        nested=nested,
        liveness_ms=options.ttl_arg,
        register="" if owner.registered else owner_description(owner.pid, options.name),
        listed=owner.listed,
        spill=spill,
    )


log = logging.getLogger("celery_redislock.acquire")


class _Try:
    """The state of one acquire call while it loops."""

    __slots__ = (
        "deadline",
        "depth",
        "inflight",
        "nested",
        "outage",
        "owner",
        "reply",
        "req",
        "timeout",
        "token",
    )

    def __init__(
        self,
        req: Request,
        depth: TaskDepth,
        owner: Owner,
        timeout: float | None,
        nested: bool,
        owner_ttl: float,
    ):
        self.req = req
        self.depth = depth
        self.timeout = timeout
        self.nested = nested
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.owner = owner
        self.token = f"{owner.owner_id}|{new_request_id()}"
        self.outage = Outage(self.deadline, owner_ttl)
        self.reply: Any = None
        #: The acquire script call in flight (shielded from cancellation).
        self.inflight: asyncio.Future[Any] | None = None

    def renew(self, owner: Owner) -> None:
        """Ask again as ``owner`` under a new request id."""
        self.owner = owner
        self.token = f"{owner.owner_id}|{new_request_id()}"
        self.reply = None


class AsyncAcquirer:
    """Acquire for an :class:`~celery_redislock.asyncio.AsyncLockManager`."""

    def __init__(
        self,
        state: AsyncState,
        channel: AsyncChannel,
        protocol: Protocol,
        requests: RequestCache,
        liveness: AsyncLiveness,
        releaser: AsyncReleaser,
    ) -> None:
        self.state = state
        self.channel = channel
        self.protocol = protocol
        self.options = protocol.options
        self.requests = requests
        self.liveness = liveness
        self.releaser = releaser

    def closed_error(self) -> LockError:
        """The error of a call on (or cut short by) a closed manager."""
        return LockError(f"this AsyncLockManager ({self.channel.url}) was closed")

    async def acquire(
        self,
        exclusive: ResourceNames,
        shared: ResourceNames,
        limited: Limits,
        timeout: float | None,
        nested: bool | None,
    ) -> AsyncLease:
        """``AsyncLockManager.acquire`` (see its docstring for the contract)."""
        req = self.requests.get(exclusive, shared, limited)
        timeout = _v.seconds("timeout", timeout, allow_none=True, allow_inf=True)
        if timeout is not None and math.isinf(timeout):
            timeout = None
        nested = _v.optional_flag("nested", nested)
        depth = self.state.depth()
        if depth.leases and nested is not False:
            pid = os.getpid()
            held = [x for x in depth.leases if not x.grant_released and x.pid == pid]
            found = reentry.plan(held, req)
            if found is not None:
                return await self._reenter(depth, req, found, timeout, nested)
        if nested is None:
            nested = depth.count > 0
        reentry.check_nested(nested, timeout)
        t = _Try(req, depth, self.liveness.current(), timeout, nested, self.options.owner_ttl)
        try:
            return await self._loop_until_granted(t)
        except BaseException:
            await self.releaser.abandon(t.inflight, t.token, t.req)
            raise

    async def _reenter(
        self,
        depth: TaskDepth,
        req: Request,
        found: reentry.Reentry[AsyncLease],
        timeout: float | None,
        nested: bool | None,
    ) -> AsyncLease:
        """A nested acquire re-entering outer leases of the same task."""
        parents = found.parents
        if found.exclusive or found.shared or found.limited:
            # The resources not held yet: a nested acquire of their own
            # (waits only for holders; a finite timeout is required).
            lease = await self.acquire(
                found.exclusive, found.shared, found.limited or None, timeout, nested
            )
            lease.share(parents)
            lease.exclusive = req.exclusive
            lease.shared = req.shared
            lease.limited = req.limit_map
            return lease
        first = parents[0]
        lease = AsyncLease(
            self.releaser,
            req,
            first.owner,
            first.token,
            max(p.fencing_token for p in parents),
            depth,
            own=False,
        )
        lease.share(parents)
        depth.count += 1
        return lease

    async def _loop_until_granted(self, t: _Try) -> AsyncLease:
        state = self.state
        while True:
            if state.closed:
                raise self.closed_error()
            if t.reply is None:
                started = time.monotonic()
                t.reply = await self._riding_out(t, self._attempt(t))
                if t.reply is None:  # Redis failed; backed off: run the attempt again
                    continue
                if int(t.reply[0]) != -1 and not self.liveness.confirm(t.owner, started):
                    self.liveness.lost_now(t.owner, "deadline", "deadline")
            code = int(t.reply[0])
            if code == 1:
                t.owner.registered = True
                if self.options.wait_replicas and not await self._replicated(t):
                    continue  # released, asking again (or a ridden-out failure)
                if state.owner is t.owner:
                    lease = AsyncLease(
                        self.releaser,
                        t.req,
                        t.owner,
                        t.token,
                        int(t.reply[1]),
                        t.depth,
                        clean=len(t.reply) > 2 and not self.options.wait_replicas,
                    )
                    state.leases[t.token] = lease
                    lease.count_in()
                    return lease
                retired = True  # granted to an owner retired meanwhile: never returned
            else:
                retired = code == 0 and state.owner is not t.owner
            if retired:
                await self.releaser.end_request(None, t.token, t.req)
                t.renew(self.liveness.current())
                continue
            if code == -2:
                t.owner.registered = True  # the script's step 1 ran: registered
                raise mode_refusal(t.reply)
            if code == -1:
                await self.liveness.owner_lost(t.owner, "acquire")
                t.renew(self.liveness.current())
                continue
            t.owner.registered = True
            await self._wait(t)

    async def _attempt(self, t: _Try) -> Any:
        """One run of acquire.lua for ``t.token``, shielded from cancellation.

        A cancellation landing while the reply is in flight leaves the call
        running: the acquire's exit waits for it before the release, so the
        release always runs after the script in Redis. Never sent with the
        'f' flag (redis-py may resend a command after a connection error:
        every send must look for an earlier grant of the token).
        """
        owner = t.owner
        call = acquire_call(
            self.protocol,
            t.token,
            t.req,
            owner,
            queue=t.timeout != 0,
            nested=t.nested,
            spill=self.state.spill(owner),
        )
        t.inflight = asyncio.ensure_future(self._send(call))
        reply = await asyncio.shield(t.inflight)
        t.inflight = None
        code = int(reply[0])
        if code == 1 or (code == 0 and t.timeout != 0):
            owner.listed = True
        return reply

    async def _send(self, call: ScriptCall) -> Any:
        """The acquire call; with ``wait_replicas``, ``WAIT`` in the same
        pipeline, a grant's reply gaining the count (``[1, fence, acked]``)."""
        replicas = self.options.wait_replicas
        if not replicas:
            return await self.channel.run(call)
        reply, acked = await self.channel.run_and_wait(call, replicas)
        return [reply[0], reply[1], acked] if int(reply[0]) == 1 else reply

    async def _replicated(self, t: _Try) -> bool:
        """Whether enough replicas acknowledged the grant ``t.reply`` names.

        False: ``t.reply`` is None and the loop asks again (a failure ridden
        out, or the grant released under ``wait_policy="retry"``); raises
        :class:`~celery_redislock.ReplicationTimeout` as the policy says.
        """
        if len(t.reply) > 2:  # counted in the script's round trip
            acked = int(t.reply[2])
        else:  # handed over while waiting: WAIT now
            acked = await self._riding_out(t, self.channel.wait_now(self.options.wait_replicas))
            if acked is None:
                t.reply = None
                return False
        if acked >= self.options.wait_replicas:
            return True
        replication_short(self.options, t.token, t.req, t.timeout, t.deadline, acked)
        await self.releaser.end_request(None, t.token, t.req)
        t.renew(t.owner)
        return False

    async def _wait(self, t: _Try) -> None:
        """Queued: block until handed the locks (``t.reply`` set) or told to look again."""
        if t.timeout == 0:
            raise LockTimeout(t.req.resources, t.timeout)
        remaining = math.inf if t.deadline is None else t.deadline - time.monotonic()
        if remaining <= 0:
            raise LockTimeout(t.req.resources, t.timeout)
        block = self.options.wait_bound(
            remaining, int(t.reply[1]), t.owner.valid_until - time.monotonic()
        )
        # The BLPOP runs in a task of its own, awaited through a shield: a
        # cancellation always reaches this coroutine (redis-py's blocking read
        # may end normally when cancelled, which would swallow it), and the
        # BLPOP is cancelled after it (a hand-off it pops is released by
        # token like any other grant).
        child = asyncio.ensure_future(self._block(t.token, max(block, MIN_BLOCK)))
        try:
            fence = await self._riding_out(t, asyncio.shield(child))
        except asyncio.CancelledError:
            child.cancel()
            child.add_done_callback(_retrieved)
            raise
        t.reply = None if fence is None else (1, fence)

    async def _block(self, token: str, seconds: float) -> int | None:
        """Wait for a push to the wake list; the fence of a hand-off (``g<fence>``)."""
        got = await self.channel.blpop([self.protocol.keys.wake(token)], seconds)
        if got is None:
            return None
        msg = text(got[1])
        return int(msg[1:]) if msg.startswith("g") else None

    async def _riding_out(self, t: _Try, call: Any) -> Any:
        """``await call``, or None after a Redis failure within the outage bound."""
        try:
            value = await call
        except RedisUnavailable as exc:
            pause = t.outage.failed()
            if pause is None:
                raise
            if t.outage.failures == 1:
                log.warning(
                    "acquire.redis-retry token=%s error=%s: re-running the acquire for up to %.3gs",
                    t.token,
                    exc,
                    t.outage.left(),
                )
            await asyncio.sleep(pause)
            return None
        if t.outage.failures:
            log.info("acquire.redis-resumed token=%s failures=%d", t.token, t.outage.failures)
            t.outage.failures = 0
        return value


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read a left-behind future's outcome (no "never retrieved" warning)."""
    if not future.cancelled():
        future.exception()
