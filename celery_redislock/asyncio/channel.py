"""Every round trip of an :class:`~celery_redislock.asyncio.AsyncLockManager`.

The asyncio twin of :class:`celery_redislock.store.channel.Channel`: it
sends each :class:`~celery_redislock.protocol.calls.ScriptCall` on a
``redis.asyncio`` client with the scripts, SHAs and NOSCRIPT handling of
:class:`~celery_redislock.store.scripts.Scripts`, maps redis-py's errors the
same way (Redis down -> :class:`~celery_redislock.RedisUnavailable`, refused by the ACL ->
:class:`~celery_redislock.PermissionDenied`), and runs the same two gates before the first
script call: the eviction-policy check and the data-format check
(``format.lua``, again after Redis may have lost its data).

It knows nothing of locks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
import redis.asyncio

from ..exceptions import ConfigurationError, RedisUnavailable, permission_denied
from ..protocol.calls import Protocol, ScriptCall, text
from ..store.channel import REDIS_DOWN_ERRORS, format_verdict, mapped_errors
from ..store.checks import EvictionCheck, eviction_verdict, primaries_infos
from ..store.scripts import Scripts

__all__ = ["AsyncChannel"]

log = logging.getLogger("celery_redislock.heartbeat")


class AsyncChannel:
    """The round trips of one asyncio manager (see the module docstring)."""

    def __init__(
        self, client: redis.asyncio.Redis | redis.asyncio.RedisCluster, url: str, protocol: Protocol
    ) -> None:
        self.client = client
        self.url = url
        self.protocol = protocol
        self.keys = protocol.keys
        self.scripts = Scripts(client)
        mode = protocol.options.eviction_check
        self._eviction_mode = mode
        self._eviction_pending = mode != "ignore"
        self._eviction_refusal: str | None = None
        #: Redis may evict keys ("warn" mode): the heartbeat also verifies
        #: that each held grant is still recorded.
        self.may_evict = False
        #: The data-format check is due before the next script call.
        self.format_pending = True
        self._gate: asyncio.Lock | None = None

    # -- round trips ------------------------------------------------------

    async def run(self, call: ScriptCall) -> Any:
        """Run one script (EVALSHA, loading it on NOSCRIPT): one round trip."""
        if self._eviction_pending or self._eviction_refusal is not None or self.format_pending:
            await self.gates()
        with mapped_errors(self.url, f"EVALSHA {call.name}"):
            try:
                return await self.scripts.run_async(self.client, call.name, call.keys, call.args)
            except redis.ConnectionError:
                # A pooled connection the server closed (a restart, CLIENT
                # KILL, an idle timeout): every script sent here is idempotent
                # on its token, so it goes once more, on a new connection.
                return await self.scripts.run_async(self.client, call.name, call.keys, call.args)

    async def run_and_wait(self, call: ScriptCall, replicas: int) -> tuple[Any, int]:
        """Run one script, then ``WAIT replicas`` in the same pipeline: one round
        trip; ``(script reply, replicas that acknowledged)``."""
        if self._eviction_pending or self._eviction_refusal is not None or self.format_pending:
            await self.gates()
        wait_ms = self.protocol.options.wait_ms
        with mapped_errors(self.url, f"EVALSHA {call.name} + WAIT"):
            return await self.scripts.run_and_wait_async(
                self.client, call.name, call.keys, call.args, replicas, wait_ms
            )

    async def wait_now(self, replicas: int) -> int:
        """``PING`` then ``WAIT replicas`` in one pipeline (a grant another client
        made: the PING moves the connection's offset to now); one round trip."""
        with mapped_errors(self.url, "WAIT"):
            pipe = self.client.pipeline(transaction=False)
            pipe.ping()
            pipe.execute_command("WAIT", replicas, self.protocol.options.wait_ms)
            return int((await pipe.execute())[1])

    async def command(self, name: str, *args: Any) -> Any:
        """One plain command (errors mapped; sent once more after a
        connection error, like :meth:`run`: only reads and BLPOP go here)."""
        with mapped_errors(self.url, name):
            try:
                return await self.client.execute_command(name, *args)
            except redis.ConnectionError:
                return await self.client.execute_command(name, *args)

    async def blpop(self, keys: list[str], seconds: float) -> Any:
        """``BLPOP keys seconds`` (errors mapped)."""
        return await self.command("BLPOP", *keys, seconds)

    async def read_loss(self, owner_id: str) -> tuple[str | None, int, int | None]:
        """What a loss's cause is read from: the owner's tombstone, whether
        the fencing counter exists, ``{ns}:born`` (one round trip)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self.keys.dead(owner_id))
            pipe.exists(self.keys.fence)
            pipe.get(self.keys.born)
            tomb, counter, born = await pipe.execute()
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        return (
            None if tomb is None else text(tomb),
            int(counter),
            None if born is None else int(born),
        )

    async def close(self) -> None:
        """Close the client's pool (every connection)."""
        await self.client.aclose()

    # -- gates ------------------------------------------------------------

    async def gates(self) -> None:
        """The checks due before the first script call (eviction, then format)."""
        if self._gate is None:
            self._gate = asyncio.Lock()
        async with self._gate:
            if self._eviction_refusal is not None:
                raise ConfigurationError("eviction_check", self._eviction_refusal)
            if self._eviction_pending:
                await self._check_eviction_once()
            if self.format_pending:
                await self.check_format()

    async def check_format(self) -> int:
        """Check (or record) the namespace's data format: ``format.lua``,
        one round trip; :class:`~celery_redislock.FormatMismatch` when it is not ours."""
        call = self.protocol.format()
        with mapped_errors(self.url, "EVALSHA format"):
            reply = await self.scripts.run_async(self.client, call.name, call.keys, call.args)
        found = format_verdict(self.keys.namespace, self.url, text(reply[0]), text(reply[1]))
        assert found is not None
        self.format_pending = False
        return found

    async def check_eviction(self) -> EvictionCheck:
        """Whether Redis may evict keys (``maxmemory_policy`` from INFO memory)."""
        try:
            if isinstance(self.client, redis.asyncio.RedisCluster):
                primaries = redis.asyncio.RedisCluster.PRIMARIES
                infos = primaries_infos(await self.client.info("memory", target_nodes=primaries))
            else:
                infos = [await self.client.info("memory")]
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            denied = permission_denied(exc, self.url, "INFO")
            return EvictionCheck(None, True, "denied" if denied is not None else None)
        return eviction_verdict(infos)

    async def _check_eviction_once(self) -> None:
        check = await self.check_eviction()
        self._eviction_pending = False
        if not check.may_evict:
            return
        self.may_evict = True
        if self._eviction_mode == "raise":
            self._eviction_refusal = f"{check.describe()} (or pass eviction_check='warn')"
            raise ConfigurationError("eviction_check", self._eviction_refusal)
        log.warning("startup.eviction-risk url=%s %s", self.url, check.describe())
