"""The asyncio front-end: :class:`AsyncLockManager` on ``redis.asyncio``.

The same protocol as the threaded :class:`~celery_redislock.LockManager`:
every script call is built by :class:`~celery_redislock.protocol.calls.Protocol`
(same keys, same ARGV, same Lua), so async and threaded owners share one
queue, one fencing counter and one loss model. What is its own is the
transport (:mod:`.channel`) and the loop: the acquire loop awaits the wake
list's ``BLPOP``, the heartbeat is a task of the manager's event loop, and
every exit of an acquire (cancellation included) ends its request by its
own token in a task shielded from the cancellation.

Identity: one owner per manager. A ``redis.asyncio`` client and the
heartbeat task belong to one event loop, and the owner's liveness is only
as alive as that task: a manager is bound to the loop it is first used on,
and its owner lives and dies with it (``close()`` retires it). A forked
child gets a fresh owner id, a fresh client and no lease of its parent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import redis
import redis.asyncio
from redis.cluster import RedisCluster

from .. import _validate as _v
from ..exceptions import ConfigurationError, LockError, LockTimeout, RedisUnavailable
from ..protocol.calls import Protocol, mode_refusal, text
from ..protocol.causes import KEY_GONE, cause_text, explain, loss_code
from ..protocol.keys import (
    Keyspace,
    new_request_id,
    owner_description,
    validate_resource,
)
from ..protocol.options import (
    DEFAULT_OWNER_TTL,
    DEFAULT_SCAN_LIMIT,
    DEFAULT_WAIT_TIMEOUT,
    MIN_BLOCK,
    REGISTRY_SPILL_AT,
    EngineOptions,
)
from ..protocol.outage import Outage
from ..protocol.owner import Owner, confirmed_until
from ..protocol.request import Request, RequestCache
from ..redact import redact_url
from ..store.connect import is_cluster_url, is_sentinel_url, validate_url
from ..store.valkey_client import as_redis_url
from .channel import AsyncChannel
from .lease import AsyncLease

__all__ = ["AsyncLockManager", "Owner"]

log = logging.getLogger("celery_redislock.acquire")
log_hb = logging.getLogger("celery_redislock.heartbeat")
log_release = logging.getLogger("celery_redislock.release")


class _Try:
    """The state of one acquire call while it loops."""

    __slots__ = ("deadline", "inflight", "owner", "outage", "reply", "req", "timeout", "token")

    def __init__(self, req: Request, owner: Owner, timeout: float | None, owner_ttl: float):
        self.req = req
        self.timeout = timeout
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


_managers: weakref.WeakSet[AsyncLockManager] = weakref.WeakSet()
#: In a forked child: the parent's clients, kept (see after_fork_in_child).
_inherited: list[Any] = []


class AsyncLockManager:
    """Acquire exclusive, shared and limited Redis locks from asyncio code.

    The asyncio face of the same locks as :class:`~celery_redislock.LockManager`:
    a coroutine waiting here and a thread (or Celery task) waiting in a
    ``LockManager`` on the same namespace wait in one queue, first come,
    first served, and their fencing tokens come from one counter.

    Args:
        redis_url: a ``redis://``, ``rediss://`` or ``unix://`` URL
            (``valkey://`` / ``valkeys://`` too), or a ready
            :class:`redis.asyncio.Redis` client, used as it is (and left
            open by :meth:`close`). Sentinel and Cluster URLs are not
            supported yet (:class:`~celery_redislock.ConfigurationError`); a
            ``redis.asyncio`` client of a Sentinel master may be passed.
        namespace: keys live under the hash tag ``{namespace}``: a
            :class:`~celery_redislock.LockManager`, a worker and the CLI
            with the same namespace share the same locks.
        owner_ttl: as for :class:`~celery_redislock.LockManager` (and the
            same for ``heartbeat_interval``, ``queue_scan_limit``, ``name``
            and ``eviction_check``), validated by the same rules.

    The manager is bound to the event loop it is first used on: its
    client's connections and its heartbeat task belong to that loop, and
    its owner (one per manager) is alive while that task runs. Use one
    manager per event loop; ``async with AsyncLockManager(...) as mgr:``
    closes it on exit. Every acquire validates its names like the threaded
    manager and raises the same exceptions (:class:`~celery_redislock.LockTimeout`,
    :class:`~celery_redislock.InvalidResource`, :class:`~celery_redislock.RedisUnavailable`, ...).

    Cancellation (``task.cancel()``, ``asyncio.timeout``) is safe at every
    await: the request leaves the queue, and a grant that landed (even one
    whose reply was still in flight) is released by the request's own token,
    in a task the cancellation does not reach.
    """

    def __init__(
        self,
        redis_url: str | redis.asyncio.Redis = "redis://127.0.0.1:6379/0",
        namespace: str = "redislock",
        *,
        owner_ttl: float = DEFAULT_OWNER_TTL,
        heartbeat_interval: float | None = None,
        queue_scan_limit: int = DEFAULT_SCAN_LIMIT,
        name: str | None = None,
        eviction_check: str = "warn",
    ) -> None:
        made: list[tuple[redis.asyncio.Redis, str, bool]] = []

        def client_facts() -> tuple[float | None, bool]:
            made.append(_client(redis_url))
            kwargs = made[0][0].connection_pool.connection_kwargs
            timeout = kwargs.get("socket_timeout")
            return (float(timeout) if timeout else None), False

        self.options = EngineOptions.build(
            owner_ttl=owner_ttl,
            heartbeat_interval=heartbeat_interval,
            queue_scan_limit=queue_scan_limit,
            name=name,
            heartbeat=True,
            hold_connection=False,
            group=None,
            wait_replicas=0,
            wait_timeout=DEFAULT_WAIT_TIMEOUT,
            wait_policy="fail",
            eviction_check=eviction_check,
            client_facts=client_facts,
        )
        self.keys = Keyspace(namespace)
        self.namespace = namespace
        self.client, self.url, self._own_client = made[0]
        self.protocol = Protocol(self.keys, self.options)
        self.channel = AsyncChannel(self.client, self.url, self.protocol)
        self.requests = RequestCache(self.keys)
        self._reset()
        self._closed = False
        _managers.add(self)

    def _reset(self) -> None:
        """Hold nothing (a new manager, or a forked child)."""
        self._pid = os.getpid()
        self._owner: Owner | None = None
        self._leases: dict[str, AsyncLease] = {}
        #: Releases that failed on an exit path: retried by every heartbeat.
        self._deferred: dict[str, Request] = {}
        self._spilled: set[str] = set()
        #: Owners retired by their local deadline whose key may still live:
        #: the heartbeat force-cleans them.
        self._doomed: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat_task: asyncio.Task[None] | None = None
        #: Shielded releases still running (kept referenced until done).
        self._pending: set[asyncio.Future[Any]] = set()

    def after_fork_in_child(self) -> None:
        """The parent's leases, loop, task and connections are not ours."""
        for lease in self._leases.values():
            lease.mark_lost("declared-dead")
            lease.mark_released()
        pool = self.client.connection_pool
        # A new pool with the same settings. The parent's client is kept,
        # never closed nor collected here: its transports' clean-up would
        # unregister the parent's sockets from the epoll instance the two
        # processes share, and the parent would never see a reply again.
        _inherited.extend([self.client, self._loop, self._beat_task, *self._pending])
        self.client = redis.asyncio.Redis(
            connection_pool=type(pool)(
                connection_class=pool.connection_class, **pool.connection_kwargs
            )
        )
        self._own_client = True
        self.channel = AsyncChannel(self.client, self.url, self.protocol)
        self._reset()

    # -- identity, loop, heartbeat ----------------------------------------

    @property
    def owner_id(self) -> str | None:
        """This manager's current owner id (None before its first acquire)."""
        return None if self._owner is None else self._owner.owner_id

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def _check(self) -> None:
        """Refuse a closed manager or a foreign loop; reset after a fork."""
        if self._pid != os.getpid():
            self.after_fork_in_child()
        if self._closed:
            raise LockError(f"this AsyncLockManager ({self.url}) is closed: make a new one")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise LockError(
                f"this AsyncLockManager ({self.url}) is bound to another event loop: "
                "its connections and heartbeat task belong to the loop it was first used "
                "on; make one AsyncLockManager per event loop"
            )

    def _current(self) -> Owner:
        owner = self._owner
        if owner is None:
            owner = self._owner = Owner()
        if self._beat_task is None or self._beat_task.done():
            assert self._loop is not None
            self._beat_task = self._loop.create_task(self._heartbeat(), name="redislock-heartbeat")
        return owner

    async def _heartbeat(self) -> None:
        """Refresh the owner's liveness every ``heartbeat_interval``; never raises."""
        failing = 0
        while not self._closed:
            await asyncio.sleep(self.options.heartbeat_interval)
            if self._closed or self._pid != os.getpid():
                return
            try:
                await self._beat()
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

    async def _beat(self) -> None:
        """One heartbeat: extend the owner's liveness (heartbeat.lua); then the upkeep."""
        owner = self._owner
        if owner is not None and owner.registered:
            started = time.monotonic()
            if self._lapsed(owner, started):
                self._lost_now(owner, "deadline", "deadline")
            else:
                grants = (
                    [
                        (x, key)
                        for x in self._leases.values()
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
                    await self._owner_lost(owner, "heartbeat")
                elif not self._confirm(owner, started):
                    self._lost_now(owner, "deadline", "deadline")
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
        await self._upkeep()

    async def _upkeep(self) -> None:
        """Force-clean owners retired by their deadline; retry deferred releases."""
        for owner_id in list(self._doomed):
            call = self.protocol.cleanup(owner_id, force=True, closing=False, reason="dead")
            await self.channel.run(call)
            self._doomed.discard(owner_id)
            log.info("cleanup.retired-owner owner=%s", owner_id)
        for token, req in list(self._deferred.items()):
            owner_id = token.split("|", 1)[0]
            call = self.protocol.release(
                token, req, lease=False, clean=False, spilled=owner_id in self._spilled
            )
            await self.channel.run(call)
            self._deferred.pop(token, None)
            log_release.info("release.retried token=%s", token)

    # -- the deadline and loss --------------------------------------------

    def _lapsed(self, owner: Owner, now: float) -> bool:
        """Whether ``owner``'s deadline passed while it holds a lease."""
        if not owner.valid_until or now <= owner.valid_until:
            return False
        return any(x.owner is owner and x.active for x in self._leases.values())

    def _confirm(self, owner: Owner, started: float) -> bool:
        """Record a confirmed refresh sent at ``started``; False if too late
        (the deadline had passed: the owner is lost)."""
        if self._lapsed(owner, started):
            return False
        owner.valid_until = confirmed_until(
            owner.valid_until, started, self.options.owner_ttl, self.options.liveness_margin
        )
        return True

    def deadline_passed(self, owner: Owner) -> None:
        """A lease of ``owner`` found the local deadline passed (no I/O)."""
        self._lost_now(owner, "deadline", "deadline")

    async def _owner_lost(self, owner: Owner, where: str) -> None:
        """The owner's liveness key is gone: read why, then :meth:`_lost_now`."""
        if where in KEY_GONE:
            self.channel.format_pending = True
        if self._owner is not owner:
            return
        self._owner = None  # retired first: no acquire registers it again meanwhile
        fences = [x.fencing_token for x in self._leases.values() if x.owner is owner]
        try:
            tomb, counter, born = await self.channel.read_loss(owner.owner_id)
            cause = loss_code(tomb, counter, born, max(fences, default=None))
        except Exception as exc:  # the cause is a courtesy: never fail the loss on it
            log_hb.debug("heartbeat.lost-reason-error owner=%s error=%r", owner.owner_id, exc)
            cause = "expired"
        self._lost_now(owner, where, cause, retired=True)

    def _lost_now(self, owner: Owner, where: str, cause: str, *, retired: bool = False) -> None:
        """Retire ``owner`` and mark its leases lost; logs once per owner."""
        if not retired:
            if self._owner is not owner:
                return
            self._owner = None
        lost = [x for x in self._leases.values() if x.owner is owner]
        if where == "deadline" and owner.registered:
            self._doomed.add(owner.owner_id)
        reason = cause_text(cause)
        log_hb.error(
            'heartbeat.lost owner=%s leases=%d where=%s cause="%s": %s; continuing under a '
            "new identity",
            owner.owner_id,
            len(lost),
            where,
            reason,
            explain(reason, where),
        )
        for lease in lost:
            lease.mark_lost(cause)

    # -- acquire ----------------------------------------------------------

    async def acquire(
        self,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        limited: Mapping[str, int] | None = None,
        timeout: float | None = None,
    ) -> AsyncLease:
        """Wait until every resource is granted, all at once; a lease.

        ``exclusive``, ``shared``, ``limited`` and ``timeout`` as for
        :meth:`LockManager.acquire <celery_redislock.LockManager.acquire>`
        (``timeout=None`` waits as long as it takes, ``0`` tries once).
        Waiting is ``BLPOP`` on the request's wake list: a release that
        finds the request first in line hands it the locks by push.
        Raises :class:`~celery_redislock.LockTimeout`, :class:`~celery_redislock.InvalidResource`,
        :class:`~celery_redislock.RedisUnavailable` (Redis out of reach for longer than the
        outage bound), :class:`~celery_redislock.LockError` (closed, or another event loop).
        """
        req = self.requests.get(exclusive, shared, limited)
        self._check()
        timeout = _v.seconds("timeout", timeout, allow_none=True, allow_inf=True)
        if timeout is not None and math.isinf(timeout):
            timeout = None
        t = _Try(req, self._current(), timeout, self.options.owner_ttl)
        try:
            return await self._loop_until_granted(t)
        except BaseException:
            await self._abandon(t)
            raise

    async def try_acquire(
        self,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        limited: Mapping[str, int] | None = None,
    ) -> AsyncLease | None:
        """Acquire every resource at once if they are free now; else None."""
        try:
            return await self.acquire(exclusive, shared, limited=limited, timeout=0)
        except LockTimeout:
            return None

    @asynccontextmanager
    async def lock(
        self,
        exclusive: str | Iterable[str] | None = None,
        shared: str | Iterable[str] | None = None,
        *,
        limited: Mapping[str, int] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[AsyncLease]:
        """``async with mgr.lock(...) as lease:``: :meth:`acquire`, released on exit."""
        lease = await self.acquire(exclusive, shared, limited=limited, timeout=timeout)
        try:
            yield lease
        finally:
            await lease.release()

    async def _loop_until_granted(self, t: _Try) -> AsyncLease:
        while True:
            if self._closed:
                raise LockError(f"this AsyncLockManager ({self.url}) was closed")
            if t.reply is None:
                started = time.monotonic()
                t.reply = await self._riding_out(t, self._attempt(t))
                if t.reply is None:  # Redis failed; backed off: run the attempt again
                    continue
                if int(t.reply[0]) != -1 and not self._confirm(t.owner, started):
                    self._lost_now(t.owner, "deadline", "deadline")
            code = int(t.reply[0])
            if code == 1:
                t.owner.registered = True
                if self._owner is t.owner:
                    lease = AsyncLease(
                        self, t.req, t.owner, t.token, int(t.reply[1]), clean=len(t.reply) > 2
                    )
                    self._leases[t.token] = lease
                    return lease
                retired = True  # granted to an owner retired meanwhile: never returned
            else:
                retired = code == 0 and self._owner is not t.owner
            if retired:
                await self._end_request(None, t.token, t.req)
                t.renew(self._current())
                continue
            if code == -2:
                t.owner.registered = True  # the script's step 1 ran: registered
                raise mode_refusal(t.reply)
            if code == -1:
                await self._owner_lost(t.owner, "acquire")
                t.renew(self._current())
                continue
            t.owner.registered = True
            await self._wait(t)

    async def _attempt(self, t: _Try) -> Any:
        """One run of acquire.lua for ``t.token``, shielded from cancellation.

        A cancellation landing while the reply is in flight leaves the call
        running: :meth:`_abandon` waits for it before the release, so the
        release always runs after the script in Redis. Never sent with the
        'f' flag (redis-py may resend a command after a connection error:
        every send must look for an earlier grant of the token).
        """
        owner = t.owner
        call = self.protocol.acquire(
            t.token,
            t.req,
            queue=t.timeout != 0,
            liveness_ms=self.options.ttl_arg,
            register="" if owner.registered else owner_description(owner.pid, self.options.name),
            listed=owner.listed,
            spill=self._spill(owner),
        )
        t.inflight = asyncio.ensure_future(self.channel.run(call))
        reply = await asyncio.shield(t.inflight)
        t.inflight = None
        code = int(reply[0])
        if code == 1 or (code == 0 and t.timeout != 0):
            owner.listed = True
        return reply

    def _spill(self, owner: Owner) -> bool:
        """Whether the owner's registry spills into buckets (acquire.lua 's')."""
        if len(self._leases) < REGISTRY_SPILL_AT:
            return False
        self._spilled.add(owner.owner_id)
        return True

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
        got = await self.channel.blpop([self.keys.wake(token)], seconds)
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

    async def _abandon(self, t: _Try) -> None:
        """The acquire ends without a lease: end its request by its own token.

        Run in a task shielded from the cancellation that may have ended the
        acquire (it waits for an acquire call still in flight first). Cancelled
        again meanwhile, the task goes on by itself; :meth:`close` waits for it.
        """
        gone = self._leases.pop(t.token, None)
        if gone is not None:
            gone.mark_released()
        task = asyncio.ensure_future(self._end_request(t.inflight, t.token, t.req))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        await asyncio.shield(task)

    async def _end_request(
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
            token, req, lease=False, clean=False, spilled=owner_id in self._spilled
        )
        try:
            await self.channel.run(call)
        except Exception as exc:
            self._deferred[token] = req
            log_release.warning(
                "release.deferred token=%s resources=%s error=%r",
                token,
                ",".join(req.resources),
                exc,
            )

    # -- the lease's host ---------------------------------------------------

    async def release_lease(self, lease: AsyncLease) -> bool:
        """:meth:`AsyncLease.release` (shielded: a sent release completes)."""
        if lease.pid != os.getpid():
            log_release.warning(
                "release.skipped token=%s reason=inherited-across-fork", lease.token
            )
            lease.mark_released()
            return False
        if not lease.mark_released():
            return False
        self._leases.pop(lease.token, None)
        task = asyncio.ensure_future(self._release_grant(lease))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        await asyncio.shield(task)
        return True

    async def _release_grant(self, lease: AsyncLease) -> None:
        req = lease.request
        call = self.protocol.release(
            lease.token,
            req,
            lease=True,
            clean=lease.clean,
            spilled=lease.owner_id in self._spilled,
        )
        try:
            reply = await self.channel.run(call)
        except BaseException:
            self._deferred[lease.token] = req
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
        req = lease.request
        streams = [self.keys.contended(r) for r in req.resources]
        reply = await self.channel.run(
            self.protocol.contenders(lease.token, req, streams, watch=False)
        )
        return int(reply[0])

    # -- queries ------------------------------------------------------------

    async def is_locked(self, resource: str) -> bool:
        """Whether Redis records any grant on ``resource`` (one round trip).

        A grant of an owner that died counts until it is reclaimed.
        """
        key = self.keys.lock(validate_resource(resource))
        self._check()
        if self.channel.format_pending:
            await self.channel.gates()
        return int(await self.channel.command("HLEN", key)) > 0

    # -- close --------------------------------------------------------------

    async def close(self) -> None:
        """Release what this manager holds, then stop it for good.

        Waits for releases still running, releases every lease (if Redis
        cannot be reached, the rest are marked lost), stops the heartbeat
        task, retires the owner (its liveness key deleted, one
        ``cleanup_owner`` round trip) and closes the client it made from a
        URL. Later calls raise :class:`~celery_redislock.LockError`. Idempotent.
        """
        if self._closed:
            return
        if self._pid != os.getpid():
            self.after_fork_in_child()
        self._closed = True
        beat = self._beat_task
        if beat is not None and not beat.done():
            beat.cancel()
            try:
                await beat
            except BaseException:
                pass
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        unreachable: BaseException | None = None
        for lease in list(self._leases.values()):
            if unreachable is None:
                try:
                    await lease.release()
                    continue
                except Exception as exc:
                    unreachable = exc
            lease.mark_lost("expired")
        owner, self._owner = self._owner, None
        if unreachable is not None:
            log_release.warning(
                "release.close-unreachable owner=%s error=%r",
                None if owner is None else owner.owner_id,
                unreachable,
            )
        elif owner is not None and owner.registered:
            try:
                if self._deferred:
                    await self._upkeep()
                await self.channel.run(
                    self.protocol.cleanup(owner.owner_id, force=True, closing=True, reason="dead")
                )
            except Exception as exc:  # its liveness expires on its own
                log.warning("cleanup.close-error owner=%s error=%r", owner.owner_id, exc)
        if self._own_client:
            await self.channel.close()

    async def __aenter__(self) -> AsyncLockManager:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<AsyncLockManager {self.url} namespace={self.namespace!r} owner={self.owner_id}>"


def _client(redis_url: Any) -> tuple[redis.asyncio.Redis, str, bool]:
    """The client of ``redis_url``, its URL for display, and whether it was made here."""
    if isinstance(redis_url, str):
        validate_url(redis_url, setting="redis_url")
        if is_cluster_url(redis_url) or is_sentinel_url(redis_url):
            kind = "Redis Cluster" if is_cluster_url(redis_url) else "Sentinel"
            raise ConfigurationError(
                "redis_url",
                f"{kind} URLs are not supported by AsyncLockManager yet "
                f"({redact_url(redis_url)}): use a redis://, rediss:// or unix:// URL, "
                "pass a ready redis.asyncio.Redis client, or use LockManager",
            )
        try:
            client = redis.asyncio.Redis.from_url(as_redis_url(redis_url), decode_responses=True)
        except ValueError as exc:
            raise ConfigurationError("redis_url", f"{exc} ({redact_url(redis_url)})") from exc
        return client, redact_url(redis_url), True
    if isinstance(redis_url, redis.asyncio.Redis):
        return redis_url, _describe(redis_url), False
    if isinstance(redis_url, redis.asyncio.RedisCluster):
        raise ConfigurationError(
            "redis_url", "redis.asyncio.RedisCluster is not supported by AsyncLockManager yet"
        )
    if isinstance(redis_url, (redis.Redis, RedisCluster)):
        raise ConfigurationError(
            "redis_url",
            "is a synchronous redis-py client: AsyncLockManager needs a URL or a "
            "redis.asyncio.Redis (LockManager takes this one)",
        )
    raise ConfigurationError(
        "redis_url",
        f"must be a URL or a redis.asyncio.Redis client, not {type(redis_url).__name__}",
    )


def _describe(client: redis.asyncio.Redis) -> str:
    """A URL-like description of where ``client`` connects (no password)."""
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    ssl = issubclass(pool.connection_class, redis.asyncio.SSLConnection)
    return f"{'rediss' if ssl else 'redis'}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read a left-behind future's outcome (no "never retrieved" warning)."""
    if not future.cancelled():
        future.exception()


def _reset_all_after_fork() -> None:
    for manager in list(_managers):
        manager.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_all_after_fork)
