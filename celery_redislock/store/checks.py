"""Checks of the Redis server that the lock guarantees depend on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..exceptions import is_permission_error
from .connect import AnyRedis

#: Policies under which Redis never evicts a key to make room.
SAFE_POLICIES = frozenset({"noeviction"})


@dataclass(frozen=True)
class EvictionCheck:
    """What the server says of eviction: its policy and whether keys may go."""

    policy: str | None
    may_evict: bool
    #: Why the policy is unknown (``"denied"`` when the Redis user's ACL
    #: refused INFO), else None.
    unknown_because: str | None = None

    def describe(self) -> str:
        if self.policy is None:
            why = (
                " (INFO refused by the Redis user's ACL: grant +info, see the "
                "least-privilege ACL in docs/operations.md)"
                if self.unknown_because == "denied"
                else ""
            )
            return (
                f"could not read maxmemory_policy from INFO memory{why}; if Redis may evict "
                "keys, liveness keys can vanish and locks be freed early"
            )
        if self.may_evict:
            return (
                f"maxmemory-policy is {self.policy!r}: Redis may evict lock or liveness keys "
                "under memory pressure, freeing locks early; set maxmemory-policy noeviction"
            )
        return f"maxmemory-policy is {self.policy!r}: keys are never evicted"


def check_eviction(client: AnyRedis, *, strict: bool = False) -> EvictionCheck:
    """Read ``maxmemory_policy`` from ``INFO memory`` (works where CONFIG is disabled).

    One round trip. ``may_evict`` is True for every policy but ``noeviction``,
    and when the policy cannot be read (reported with ``policy=None``). On
    Redis Cluster every primary is asked and the first unsafe (or unreadable)
    policy wins, since any of them may own the namespace's slot.
    ``strict``: an INFO refused by the ACL raises (redis-py's
    ``NoPermissionError``) instead of reading as an unknown policy.
    """
    try:
        if isinstance(client, RedisCluster):
            infos = primaries_infos(client.info("memory", target_nodes=RedisCluster.PRIMARIES))
        else:
            infos = [client.info("memory")]
    except redis.ResponseError as exc:
        if is_permission_error(exc):
            if strict:
                raise
            return EvictionCheck(None, True, "denied")
        return EvictionCheck(None, True)
    return eviction_verdict(infos)


def primaries_infos(replies: Any) -> list[Any]:
    """The ``INFO`` replies of a cluster client's ``info(target_nodes=PRIMARIES)``
    (node -> reply; one reply as it is when a single node answered)."""
    return list(replies.values()) if "maxmemory_policy" not in replies else [replies]


def eviction_verdict(infos: list[Any]) -> EvictionCheck:
    """The :class:`EvictionCheck` of ``INFO memory`` replies (one per primary).

    No I/O: :func:`check_eviction` and the asyncio front-end read INFO
    their own way and judge it here. The first unsafe (or unreadable)
    policy wins.
    """
    found: EvictionCheck | None = None
    for info in infos:
        policy = info.get("maxmemory_policy") if isinstance(info, dict) else None
        if isinstance(policy, bytes):
            policy = policy.decode()
        if policy is None:
            return EvictionCheck(None, True)
        check = EvictionCheck(str(policy), str(policy) not in SAFE_POLICIES)
        if check.may_evict:
            return check
        found = found or check
    return found or EvictionCheck(None, True)
