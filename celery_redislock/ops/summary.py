"""One walk of a namespace's owners: the status counts and the limited resources.

:class:`SummaryView` walks the active-owners set once (liveness, registry
names and waits-hash values per owner, pipelined in batches), then reads
the mode of each resource held and the slots of each limited one. What
``redislock status`` and the metrics endpoint show.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..protocol.keys import (
    grant_limit,
    parse_grant,
    text,
)
from ..store.checks import check_eviction
from .owners import OwnersBasedView
from .records import (
    LimitedInfo,
    Status,
    Summary,
    by_length,
    is_spilled,
    limit_of_slots,
    opt_text,
    request_modes,
    waited_names,
)


def _limited_names(value: Any) -> list[str]:
    """The names a waits-hash value ``modes\nname...`` queues for a slot of."""
    parts = text(value, "replace").split("\n")
    return [n for n, (m, _) in request_modes(parts[0], parts[1:]).items() if m == "l" and n]


class SummaryView(OwnersBasedView):
    """Status and limited resources from one walk of the owners."""

    def summary(self, *, max_owners: int | None = None) -> Summary:
        """The status and the limited resources from one walk of the owners."""
        # INFO refused by the ACL raises PermissionDenied here (an unknown
        # eviction policy must not pass for an answer); the documented ACL
        # grants it.
        ev = self.reader.call("INFO", lambda: check_eviction(self.reader.client, strict=True))
        server: Any = self.reader.call("INFO", lambda: self.reader.client.info("server"))
        fence = self.reader.call("GET", lambda: self.reader.client.get(self.keys.fence))
        version = server.get("redis_version") if isinstance(server, dict) else None
        owners = alive = dead = registered = dead_locks = waiting = 0
        holding = waiting_only = 0
        per_resource: dict[str, int] = {}
        held_names: set[str] = set()
        limited_queued: set[str] = set()
        truncated = False
        for batch in self.reader.owner_ids():
            if max_owners is not None and owners + len(batch) > max_owners:
                batch = batch[: max(0, max_owners - owners)]
                truncated = True
            for is_alive, held, queued in self.owner_states(batch):
                n = len(held)
                held_names.update(held)
                w = len(queued)
                for value in queued:
                    for name in waited_names(value):
                        per_resource[name] = per_resource.get(name, 0) + 1
                    if "l" in text(value, "replace").partition("\n")[0].partition(":")[0]:
                        limited_queued.update(_limited_names(value))
                waiting += w
                holding += 1 if n else 0
                waiting_only += 1 if w and not n else 0
                owners += 1
                registered += n
                if is_alive:
                    alive += 1
                else:
                    dead += 1
                    dead_locks += n
            if truncated:
                break
        top = by_length(per_resource)[:1]
        limited = self.limited_infos(sorted(held_names), limited_queued, per_resource)
        warnings: list[str] = []
        if ev.may_evict:
            warnings.append(ev.describe())
        if dead_locks:
            warnings.append(
                f"{dead} dead owner(s) still hold {dead_locks} lock(s): the next acquirer "
                "reclaims them; `redislock reconcile` frees them now"
            )
        status = Status(
            namespace=self.keys.namespace,
            url=self.reader.url,  # already masked (LockManager.url)
            redis_version=opt_text(version),
            eviction_policy=ev.policy,
            may_evict=ev.may_evict,
            eviction_note=ev.describe(),
            fence=int(text(fence, "replace")) if fence is not None else None,
            owners=owners,
            alive_owners=alive,
            dead_owners=dead,
            registered_locks=registered,
            dead_owner_locks=dead_locks,
            warnings=warnings,
            format_version=self.reader.usage().format_version,
            waiting_requests=waiting,
            truncated=truncated,
            holding_owners=holding,
            waiting_only_owners=waiting_only,
            busiest_resource=top[0].resource if top else None,
            busiest_waiting=top[0].waiting if top else 0,
            limited_resources=len(limited),
            limited_slots=sum(x.slots for x in limited),
            limited_waiting=sum(x.waiting for x in limited),
        )
        return Summary(status, limited)

    def limited_infos(
        self, held: Sequence[str], queued: set[str], waiting: dict[str, int]
    ) -> tuple[LimitedInfo, ...]:
        """The limited resources among ``held`` (registered names: one
        ``HRANDFIELD`` each tells the mode, every holder of a lock having
        the same kind) and ``queued`` (names a request queues for a slot
        of): one ``HVALS`` each; ``waiting``: requests queued per name.
        Busiest first."""
        limited = set(queued)
        for batch in self.reader.batches(held):
            pipe = self.reader.pipe()
            for name in batch:
                pipe.hrandfield(self.keys.lock(name), 1, withvalues=True)
            for name, got in zip(batch, self.reader.run(pipe)):
                if isinstance(got, list) and len(got) == 2 and text(got[1], "replace")[:1] == "l":
                    limited.add(name)
        out: list[LimitedInfo] = []
        names = sorted(limited)
        for batch in self.reader.batches(names):
            pipe = self.reader.pipe()
            for name in batch:
                pipe.hvals(self.keys.lock(name))
            for name, got in zip(batch, self.reader.run(pipe)):
                values = [] if isinstance(got, Exception) else [text(v, "replace") for v in got]
                limit, limits = limit_of_slots(
                    (parse_grant(v)[1], grant_limit(v)) for v in values if v[:1] == "l"
                )
                out.append(LimitedInfo(name, len(values), limit, limits, waiting.get(name, 0)))
        return tuple(sorted(out, key=lambda x: (-x.waiting, -x.slots, x.resource)))

    def owner_states(self, batch: Sequence[str]) -> list[tuple[bool, list[str], list[Any]]]:
        """Per owner of ``batch``: whether it is alive, the resource names in
        its registry and its waits-hash values. One pipeline (EXISTS, HKEYS
        of the registry, HVALS of the waits hash, HLEN of the bucket index,
        each); a registry that spilled is then read."""
        if not batch:
            return []
        pipe = self.reader.pipe()
        for owner in batch:
            pipe.exists(self.keys.alive(owner))
            pipe.hkeys(self.keys.held(owner))
            pipe.hvals(self.keys.waits(owner))
            pipe.hlen(self.keys.held_index(owner))
        replies = self.reader.run(pipe)
        out: list[tuple[bool, list[str], list[Any]]] = []
        for j, owner in enumerate(batch):
            is_alive, names, queued, spilled = replies[4 * j : 4 * j + 4]
            if is_spilled(spilled):
                held = [self.reader.resource_of(k) for k in self.owners.registry(owner)]
            else:
                held = [] if isinstance(names, Exception) else [text(x, "replace") for x in names]
            queued = [] if isinstance(queued, Exception) else list(queued)
            out.append((bool(is_alive) and not isinstance(is_alive, Exception), held, queued))
        return out
