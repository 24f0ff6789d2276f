"""The asyncio front-end: :class:`AsyncLockManager` on ``redis.asyncio``.

The same protocol as the threaded :class:`~celery_redislock.LockManager`:
every script call is built by :class:`~celery_redislock.protocol.calls.Protocol`
(same keys, same ARGV, same Lua), so async and threaded owners share one
queue, one fencing counter and one loss model. What is its own is the
transport (:mod:`.channel`) and the loop: the acquire loop (:mod:`.acquire`)
awaits the wake list's ``BLPOP``, the heartbeat (:mod:`.liveness`) is a
task of the manager's event loop, and every exit of an acquire
(cancellation included) ends its request by its own token in a task
shielded from the cancellation (:mod:`.release`).

Identity: one owner per manager. A ``redis.asyncio`` client and the
heartbeat task belong to one event loop, and the owner's liveness is only
as alive as that task: a manager is bound to the loop it is first used on,
and its owner lives and dies with it (``close()`` retires it). A forked
child gets a fresh owner id, a fresh client and no lease of its parent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import redis.asyncio

from ..exceptions import LockError, LockTimeout
from ..protocol.calls import Protocol
from ..protocol.keys import Keyspace, validate_resource
from ..protocol.options import (
    DEFAULT_OWNER_TTL,
    DEFAULT_SCAN_LIMIT,
    DEFAULT_WAIT_TIMEOUT,
    EngineOptions,
)
from ..protocol.owner import Owner
from ..protocol.reports import LockHolder, lock_holders
from ..protocol.request import Limits, RequestCache, ResourceNames
from .acquire import AsyncAcquirer
from .channel import AsyncChannel
from .connect import Made, client_of
from .lease import AsyncLease
from .liveness import AsyncLiveness
from .release import AsyncReleaser
from .state import AsyncState

__all__ = ["AsyncLockManager", "Owner"]

log = logging.getLogger("celery_redislock.acquire")
log_release = logging.getLogger("celery_redislock.release")

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
        redis_url: every URL :class:`~celery_redislock.LockManager` takes
            (``redis://``, ``rediss://``, ``unix://``, ``valkey://``,
            ``sentinel://``, ``redis+cluster://`` and their TLS forms, the
            same options), made into a ``redis.asyncio`` client (Sentinel:
            the master the Sentinels name, asked again after a failover;
            Cluster: ``redis.asyncio.RedisCluster``), or a ready
            :class:`redis.asyncio.Redis` client (a Sentinel master's too),
            used as it is and left open by :meth:`close`.
        namespace: keys live under the hash tag ``{namespace}``: a
            :class:`~celery_redislock.LockManager`, a worker and the CLI
            with the same namespace share the same locks.
        owner_ttl: as for :class:`~celery_redislock.LockManager` (and the
            same for ``heartbeat_interval``, ``queue_scan_limit``, ``name``,
            ``wait_replicas``, ``wait_timeout``, ``wait_policy`` and
            ``eviction_check``), validated by the same rules. With
            ``wait_replicas``, ``WAIT`` goes in the acquire script's
            pipeline (a grant handed over while waiting costs one more
            round trip), and a grant too few replicas acknowledged is
            released, then :class:`~celery_redislock.ReplicationTimeout`
            (``"fail"``) or asked again (``"retry"``).

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
        wait_replicas: int = 0,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        wait_policy: str = "fail",
        eviction_check: str = "warn",
    ) -> None:
        made: list[Made] = []

        def client_facts() -> tuple[float | None, bool]:
            made.append(client_of(redis_url))
            return made[0].socket_timeout, isinstance(made[0].client, redis.asyncio.RedisCluster)

        self.options = EngineOptions.build(
            owner_ttl=owner_ttl,
            heartbeat_interval=heartbeat_interval,
            queue_scan_limit=queue_scan_limit,
            name=name,
            heartbeat=True,
            hold_connection=False,
            group=None,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            wait_policy=wait_policy,
            eviction_check=eviction_check,
            client_facts=client_facts,
        )
        self.keys = Keyspace(namespace)
        self.namespace = namespace
        self.client, self.url, self._own_client = made[0].client, made[0].url, made[0].own
        self._remake = made[0].remake
        self.protocol = Protocol(self.keys, self.options)
        self.requests = RequestCache(self.keys)
        self.state = AsyncState()
        self._build_parts()
        _managers.add(self)

    def _build_parts(self) -> None:
        """The channel and the parts on it (a new manager, or a forked child)."""
        self.channel = AsyncChannel(self.client, self.url, self.protocol)
        self.liveness = AsyncLiveness(self.state, self.channel, self.protocol)
        self.releaser = AsyncReleaser(self.state, self.channel, self.protocol, self.liveness)
        self.acquirer = AsyncAcquirer(
            self.state, self.channel, self.protocol, self.requests, self.liveness, self.releaser
        )

    def after_fork_in_child(self) -> None:
        """The parent's leases, loop, task and connections are not ours."""
        state = self.state
        for lease in state.leases.values():
            lease.mark_lost("declared-dead")
            lease.forget()
        # A new client with the same settings. The parent's client is kept,
        # never closed nor collected here: its transports' clean-up would
        # unregister the parent's sockets from the epoll instance the two
        # processes share, and the parent would never see a reply again.
        _inherited.extend([self.client, state.loop, state.beat_task, *state.pending])
        self.client = self._remake()
        self._own_client = True
        state.reset()
        self._build_parts()

    # -- identity and loop --------------------------------------------------

    @property
    def owner_id(self) -> str | None:
        """This manager's current owner id (None before its first acquire)."""
        owner = self.state.owner
        return None if owner is None else owner.owner_id

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.state.closed

    def _check(self) -> None:
        """Refuse a closed manager or a foreign loop; reset after a fork."""
        state = self.state
        if state.pid != os.getpid():
            self.after_fork_in_child()
        if state.closed:
            raise LockError(f"this AsyncLockManager ({self.url}) is closed: make a new one")
        loop = asyncio.get_running_loop()
        if state.loop is None:
            state.loop = loop
        elif state.loop is not loop:
            raise LockError(
                f"this AsyncLockManager ({self.url}) is bound to another event loop: "
                "its connections and heartbeat task belong to the loop it was first used "
                "on; make one AsyncLockManager per event loop"
            )

    # -- acquire ----------------------------------------------------------

    async def acquire(
        self,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
        *,
        limited: Limits = None,
        timeout: float | None = None,
        nested: bool | None = None,
    ) -> AsyncLease:
        """Wait until every resource is granted, all at once; a lease.

        ``exclusive``, ``shared``, ``limited``, ``timeout`` and ``nested``
        as for :meth:`LockManager.acquire <celery_redislock.LockManager.acquire>`
        (``timeout=None`` waits as long as it takes, ``0`` tries once), with
        the asyncio task in the place of the thread. Waiting is ``BLPOP`` on
        the request's wake list: a release that finds the request first in
        line hands it the locks by push.

        Reentrancy: resources the calling asyncio task already holds
        (through a lease of this manager not yet released) are granted again
        at once, without a round trip, and counted like ``threading.RLock``:
        the lease returned counts on the outer one, whose fencing token it
        carries, and the locks are released in Redis when the last of them
        is released. An exclusive hold covers a shared request. A request
        made while the task holds a lock is *nested*: it waits only for
        holders, never behind queued requests, and needs a finite timeout
        (``nested=False`` makes it an ordinary request, reentrancy off).
        Another task is not the holder, even one the holder started
        (``asyncio.create_task``, ``gather``, a ``TaskGroup``): it queues
        like everyone else.

        Raises :class:`~celery_redislock.LockTimeout`, :class:`~celery_redislock.InvalidResource`,
        :class:`~celery_redislock.LockUpgradeError` (an exclusive request
        for a resource the task holds only shared), ``ValueError`` (a nested
        request without a finite timeout),
        :class:`~celery_redislock.RedisUnavailable` (Redis out of reach for longer than the
        outage bound), :class:`~celery_redislock.LockError` (closed, or another event loop).
        """
        self.requests.get(exclusive, shared, limited)  # bad names refused before anything else
        self._check()
        return await self.acquirer.acquire(exclusive, shared, limited, timeout, nested)

    async def try_acquire(
        self,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
        *,
        limited: Limits = None,
        nested: bool | None = None,
    ) -> AsyncLease | None:
        """Acquire every resource at once if they are free now; else None."""
        try:
            return await self.acquire(exclusive, shared, limited=limited, timeout=0, nested=nested)
        except LockTimeout:
            return None

    @asynccontextmanager
    async def lock(
        self,
        exclusive: ResourceNames = None,
        shared: ResourceNames = None,
        *,
        limited: Limits = None,
        timeout: float | None = None,
        nested: bool | None = None,
    ) -> AsyncIterator[AsyncLease]:
        """``async with mgr.lock(...) as lease:``: :meth:`acquire`, released on exit."""
        lease = await self.acquire(
            exclusive, shared, limited=limited, timeout=timeout, nested=nested
        )
        try:
            yield lease
        finally:
            await lease.release()

    # -- queries ------------------------------------------------------------

    async def holders(self, resource: str) -> list[LockHolder]:
        """Who holds ``resource`` now: one :class:`~celery_redislock.LockHolder` per grant.

        One round trip, no liveness check, exclusive first, then by owner:
        as :meth:`LockManager.holders <celery_redislock.LockManager.holders>`.
        """
        key = self.keys.lock(validate_resource(resource))
        self._check()
        if self.channel.format_pending:
            await self.channel.gates()
        return lock_holders(resource, await self.channel.command("HGETALL", key))

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
        state = self.state
        if state.closed:
            return
        if state.pid != os.getpid():
            self.after_fork_in_child()
        state.closed = True
        await self.liveness.stop()
        if state.pending:
            await asyncio.gather(*list(state.pending), return_exceptions=True)
        unreachable: BaseException | None = None
        for lease in list(state.leases.values()):
            lease.mark_released()
            if unreachable is None:
                try:
                    await self.releaser.drop_hold(lease, force=True)
                    continue
                except Exception as exc:
                    unreachable = exc
            lease.mark_lost("expired")
        owner, state.owner = state.owner, None
        if unreachable is not None:
            log_release.warning(
                "release.close-unreachable owner=%s error=%r",
                None if owner is None else owner.owner_id,
                unreachable,
            )
        elif owner is not None and owner.registered:
            try:
                if state.deferred:
                    await self.liveness.upkeep()
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


def _reset_all_after_fork() -> None:
    for manager in list(_managers):
        manager.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_all_after_fork)
