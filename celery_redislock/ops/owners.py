"""The owners of a namespace, read: liveness, registries, nodes.

:class:`OwnersView` reads the active-owners set ``{ns}:owners``, each
owner's liveness key ``{ns}:alive:<owner>`` and registry
``{ns}:held:<owner>`` (with its buckets once it spilled), and the Celery
node records ``{ns}:node:<name>``, ``{ns}:group:<inc>`` and
``{ns}:tomb:<inc>``. The other views ask it for liveness and registries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import redis

from ..engine.identity import pid_of_tag
from ..exceptions import ConfigurationError
from ..protocol.keys import (
    text,
    validate_node_name,
    validate_owner_id,
)
from .reader import Reader
from .records import (
    Liveness,
    NodeInfo,
    OwnerInfo,
    describe_fields,
    is_spilled,
    opt_text,
)


class OwnersView:
    """Owner records, liveness and registries (what ``redislock owners`` shows).

    Holds no state of its own: every read goes through its :class:`Reader`.
    """

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.keys = reader.keys

    def registry(self, owner_id: str) -> list[str]:
        """The lock keys of one owner's registry, its buckets' too (HSCAN in batches)."""
        validate_owner_id(owner_id)
        out: list[str] = []
        seen: set[str] = set()
        held = [self.keys.held(owner_id)]
        # An owner holding many locks keeps further names in buckets that its
        # bucket index lists (docs/design.md, "Data model").
        for batch in self.reader.hscan_keys(self.keys.held_index(owner_id)):
            held.extend(self.keys.held_bucket(owner_id, b) for b in batch)
        for key in held:
            for batch in self.reader.hscan_keys(key):
                new = [name for name in batch if name not in seen]
                seen.update(new)
                out.extend(self.keys.lock(name) for name in new)
        return out

    def registry_sizes(self, owners: Sequence[str]) -> dict[str, int]:
        """Registry size of each owner: one pipelined HLEN of its registry and
        of its bucket index per batch; a registry that spilled is then read."""
        sizes: dict[str, int] = {}
        for batch in self.reader.batches(owners):
            pipe = self.reader.pipe()
            for owner in batch:
                pipe.hlen(self.keys.held(owner))
                pipe.hlen(self.keys.held_index(owner))
            replies = self.reader.run(pipe)
            for j, owner in enumerate(batch):
                n, spilled = replies[2 * j], replies[2 * j + 1]
                if is_spilled(spilled):
                    sizes[owner] = len(self.registry(owner))
                else:
                    sizes[owner] = 0 if isinstance(n, Exception) else int(n)
        return sizes

    def registries(self, owners: Sequence[str]) -> dict[str, list[str]]:
        """The registries of many owners, as lock keys: one pipelined HSCAN per batch."""
        out: dict[str, list[str]] = {}
        for batch in self.reader.batches(owners):
            pipe = self.reader.pipe()
            for owner in batch:
                pipe.hscan(self.keys.held(owner), 0, count=self.reader.batch_size)
                pipe.hlen(self.keys.held_index(owner))
            replies = self.reader.run(pipe)
            for j, owner in enumerate(batch):
                reply, spilled = replies[2 * j], replies[2 * j + 1]
                if isinstance(reply, Exception):
                    out[owner] = []
                    continue
                cursor, fields = reply
                if int(cursor) == 0 and not is_spilled(spilled):
                    out[owner] = sorted({self.keys.lock(text(f, "replace")) for f in fields})
                else:
                    out[owner] = sorted(set(self.registry(owner)))
        return out

    def liveness(self, owners: Iterable[str]) -> dict[str, Liveness]:
        """PTTL and value of each owner's liveness key, pipelined in batches."""
        if isinstance(owners, str):
            raise ConfigurationError("owners", f"must be an iterable of owner ids, not {owners!r}")
        wanted = list(dict.fromkeys(owners))
        out: dict[str, Liveness] = {}
        for batch in self.reader.batches(wanted):
            pipe = self.reader.pipe()
            for owner in batch:
                key = self.keys.alive(owner)
                pipe.pttl(key)
                pipe.get(key)
            replies = self.reader.run(pipe)
            for i, owner in enumerate(batch):
                pttl, value = replies[2 * i], replies[2 * i + 1]
                pttl = -2 if isinstance(pttl, Exception) else int(pttl)
                alive = pttl != -2
                ttl = pttl / 1000.0 if pttl >= 0 else None
                desc = None if isinstance(value, Exception) else opt_text(value)
                out[owner] = Liveness(owner, alive, ttl, desc if alive else None)
        return out

    def node(self, name: str) -> NodeInfo | None:
        """A worker node's record and its current incarnation's group, or None."""
        validate_node_name(name, "node")
        prefix = self.keys.prefix
        try:
            raw = self.reader.call(
                "HGETALL", lambda: self.reader.client.hgetall(f"{prefix}node:{name}")
            )
        except redis.ResponseError:
            return None  # not a hash: no node record
        if not raw:
            return None
        record = {text(k, "replace"): text(v, "replace") for k, v in raw.items()}
        inc = record.get("inc")
        owners: dict[str, int] = {}
        tomb = False
        if inc:
            pipe = self.reader.pipe()
            pipe.hgetall(f"{prefix}group:{inc}")
            pipe.exists(f"{prefix}tomb:{inc}")
            group, t = self.reader.run(pipe)
            if isinstance(group, dict):
                for k, v in group.items():
                    try:
                        owners[text(k, "replace")] = pid_of_tag(text(v, "replace"))
                    except ValueError:
                        owners[text(k, "replace")] = -1
            tomb = bool(t) and not isinstance(t, Exception)
        return NodeInfo(name, inc, record, owners, tomb)

    def owner(self, owner_id: str) -> OwnerInfo:
        """One owner, in the active-owners set or not."""
        validate_owner_id(owner_id)
        return self.owner_infos([owner_id])[0]

    def owner_infos(self, owners: Sequence[str]) -> list[OwnerInfo]:
        live = self.liveness(owners)
        sizes = self.registry_sizes(owners)
        fields = {o: describe_fields(live[o].description) for o in owners}
        incs = {o: f.get("inc") or f.get("incarnation") for o, f in fields.items()}
        groups = self.group_info({o: i for o, i in incs.items() if i})
        out: list[OwnerInfo] = []
        for owner in owners:
            lv, f = live[owner], fields[owner]
            pid: int | None
            try:
                pid = int(f["pid"]) if "pid" in f else None
            except ValueError:
                pid = None
            in_group, tomb = groups.get(owner, (None, None))
            out.append(
                OwnerInfo(
                    owner_id=owner,
                    alive=lv.alive,
                    ttl=lv.ttl,
                    description=lv.description,
                    locks=sizes.get(owner, 0),
                    pid=pid,
                    host=f.get("host"),
                    node=f.get("node") or f.get("name"),
                    incarnation=incs[owner],
                    in_group=in_group,
                    tombstoned=tomb,
                )
            )
        return out

    def group_info(self, incs: dict[str, str]) -> dict[str, tuple[bool, bool]]:
        """owner -> (listed in its incarnation's group hash, incarnation tombstoned)."""
        out: dict[str, tuple[bool, bool]] = {}
        items = list(incs.items())
        prefix = self.keys.prefix
        for i in range(0, len(items), self.reader.batch_size):
            batch = items[i : i + self.reader.batch_size]
            pipe = self.reader.pipe()
            for owner, inc in batch:
                pipe.hexists(f"{prefix}group:{inc}", owner)
                pipe.exists(f"{prefix}tomb:{inc}")
            replies = self.reader.run(pipe)
            for j, (owner, _) in enumerate(batch):
                g, t = replies[2 * j], replies[2 * j + 1]
                out[owner] = (
                    bool(g) and not isinstance(g, Exception),
                    bool(t) and not isinstance(t, Exception),
                )
        return out

    def owners(self, nodes: Sequence[str] = ()) -> list[OwnerInfo]:
        """Every owner in the active-owners set, labelled with the named ``nodes``."""
        if isinstance(nodes, str):
            raise ConfigurationError("nodes", f"must be a sequence of node names, not {nodes!r}")
        nodes = [validate_node_name(n, "nodes") for n in nodes]
        labels: dict[str, tuple[str, str | None, bool]] = {}
        for name in nodes:
            info = self.node(name)
            if info is not None:
                for owner in info.owners:
                    labels[owner] = (name, info.incarnation, info.tombstoned)
        out: list[OwnerInfo] = []
        for batch in self.reader.owner_ids():
            for o in self.owner_infos(batch):
                if o.owner_id in labels:
                    node, inc, tomb = labels[o.owner_id]
                    o = replace(o, node=node, incarnation=inc, in_group=True, tombstoned=tomb)
                out.append(o)
        out.sort(key=lambda o: (o.alive, o.node or "", o.owner_id))
        return out


class OwnersBasedView:
    """Base of the views that read liveness and registries through an
    :class:`OwnersView`; like it, they hold no state of their own."""

    def __init__(self, reader: Reader, owners: OwnersView) -> None:
        self.reader = reader
        self.keys = reader.keys
        self.owners = owners
