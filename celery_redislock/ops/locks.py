"""The locks of a namespace, read: each lock hash's grants and who took them.

:class:`LocksView` reads lock hashes ``{ns}:lock:<resource>`` (each grant's
token, mode, fencing token and limit), queue lengths, and the holder
records (the Celery task that took a grant) from the owners' registries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..exceptions import ConfigurationError
from ..protocol.keys import (
    MODE_NAMES,
    grant_limit,
    holder_info_of,
    owner_of_token,
    parse_grant,
    registry_bucket,
    text,
    validate_resource,
)
from .owners import OwnersBasedView
from .records import (
    Holder,
    LockInfo,
    describe_fields,
    holder_fields,
    limit_of_slots,
)


class LocksView(OwnersBasedView):
    """Holders of resources (what ``redislock locks`` shows)."""

    def holders(self, resource: str) -> list[Holder]:
        """Every grant on ``resource``, exclusive first, then by owner."""
        return list(self.lock_info(resource).holders)

    def lock_info(self, resource: str) -> LockInfo:
        """The holders and wait-queue length of one resource."""
        validate_resource(resource)
        return self.lock_infos([self.keys.lock(resource)])[0]

    def lock_infos(self, lock_keys: Sequence[str]) -> list[LockInfo]:
        """A :class:`LockInfo` per lock key, in order: its hash and queue
        length pipelined per batch, then the type of any key that is not a
        hash, the grants' owners' liveness and their holder records."""
        raw: list[tuple[str, Any, Any]] = []
        for batch in self.reader.batches(lock_keys):
            pipe = self.reader.pipe()
            for key in batch:
                pipe.hgetall(key)
                pipe.zcard(self.keys.queue(self.reader.resource_of(key)))
            replies = self.reader.run(pipe)
            for i, key in enumerate(batch):
                raw.append((key, replies[2 * i], replies[2 * i + 1]))
        # odd types: ask what they are (rare; one round trip per batch)
        odd = [key for key, h, _ in raw if isinstance(h, Exception)]
        types: dict[str, str] = {}
        for batch in self.reader.batches(odd):
            pipe = self.reader.pipe()
            for key in batch:
                pipe.type(key)
            for key, t in zip(batch, self.reader.run(pipe)):
                types[key] = text(t, "replace")
        grants: list[tuple[str, str, str, int | None]] = []  # key, token, mode, fence
        limits: dict[tuple[str, str], int] = {}  # (key, token) -> limit of a slot
        for key, h, _ in raw:
            if isinstance(h, dict):
                for token, value in h.items():
                    grant = text(value, "replace")
                    grants.append((key, text(token, "replace"), *parse_grant(grant)))
                    limit = grant_limit(grant)
                    if limit is not None:
                        limits[key, grants[-1][1]] = limit
        live = self.owners.liveness(owner_of_token(t) for _, t, _, _ in grants)
        tasks = self.holder_infos([(self.reader.resource_of(k), t) for k, t, _, _ in grants])
        holders: dict[str, list[Holder]] = {}
        for key, token, mode, fence in grants:
            owner = owner_of_token(token)
            lv = live[owner]
            task_name, task_id, node = tasks.get(token, (None, None, None))
            holders.setdefault(key, []).append(
                Holder(
                    resource=self.reader.resource_of(key),
                    token=token,
                    owner_id=owner,
                    mode=MODE_NAMES.get(mode, mode),
                    alive=lv.alive,
                    ttl=lv.ttl,
                    description=lv.description,
                    fence=fence,
                    task_name=task_name,
                    task_id=task_id,
                    node=node or describe_fields(lv.description).get("name"),
                    limit=limits.get((key, token)),
                )
            )
        out: list[LockInfo] = []
        for key, _h, waiting in raw:
            hs = sorted(holders.get(key, []), key=lambda x: (x.mode != "exclusive", x.owner_id))
            limit, all_limits = limit_of_slots((h.fence, h.limit) for h in hs)
            out.append(
                LockInfo(
                    resource=self.reader.resource_of(key),
                    key=key,
                    holders=tuple(hs),
                    waiting=0 if isinstance(waiting, Exception) else int(waiting),
                    odd_type=types.get(key),
                    limit=limit,
                    limits=all_limits,
                )
            )
        return out

    def holder_infos(
        self, grants: Sequence[tuple[str, str]]
    ) -> dict[str, tuple[str | None, str | None, str | None]]:
        """Task name, id and node of each ``(resource, token)`` grant taken by
        a task, by token.

        The holder record is the resource's value in the owner's registry
        (its main hash, or the name's bucket when the registry spilled),
        when it names the token's request; an earlier release kept it in
        ``{ns}:holder:<token>``, read last. Three reads per grant, pipelined
        in batches.
        """
        out: dict[str, tuple[str | None, str | None, str | None]] = {}
        wanted = list(dict.fromkeys(grants))
        for batch in self.reader.batches(wanted):
            pipe = self.reader.pipe()
            for resource, token in batch:
                owner = owner_of_token(token)
                pipe.hget(self.keys.held(owner), resource)
                pipe.hget(self.keys.held_bucket(owner, registry_bucket(resource)), resource)
                pipe.get(self.keys.holder(token))
            replies = self.reader.run(pipe)
            for i, (_resource, token) in enumerate(batch):
                info = None
                for record in replies[3 * i : 3 * i + 2]:
                    if info is None and isinstance(record, (str, bytes)):
                        info = holder_info_of(text(record, "replace"), token)
                legacy = replies[3 * i + 2]
                if info is None and isinstance(legacy, (str, bytes)):
                    info = text(legacy, "replace")
                out[token] = holder_fields(info)
        return out

    def locks(self, resources: Sequence[str] | None = None) -> list[LockInfo]:
        """The locks of the named ``resources``, or every lock in any registry."""
        if isinstance(resources, str):
            raise ConfigurationError(
                "resources", f"must be a sequence of resource names, not the str {resources!r}"
            )
        if resources:
            keys = [self.keys.lock(validate_resource(r)) for r in dict.fromkeys(resources)]
        else:
            found: set[str] = set()
            for batch in self.reader.owner_ids():
                for regs in self.owners.registries(batch).values():
                    found.update(regs)
            keys = sorted(found)
        infos = self.lock_infos(keys)
        if not resources:
            infos = [i for i in infos if i.holders or i.odd_type]
        return sorted(infos, key=lambda i: i.resource)
