"""The wait queues of a namespace, read: queued requests and their state.

:class:`WaitersView` reads a resource's queue ``{ns}:queue:<resource>`` in
serving order, each request's record ``{ns}:req:<token>`` and the park
records of deferred tasks, and counts queued requests per resource from
the owners' waits hashes (never from the keyspace).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from .. import _validate as _v
from ..protocol.keys import (
    MODE_NAMES,
    holder_info_of,
    owner_of_token,
    text,
    validate_resource,
)
from .owners import OwnersBasedView
from .records import (
    QueueLength,
    Waiter,
    by_length,
    holder_fields,
    opt_text,
    request_modes,
    waited_names,
)

#: Most waiters ``waiters()`` lists by default, and at most.
DEFAULT_WAITER_LIMIT = 1000
MAX_WAITER_LIMIT = 100_000


def _task_name(raw: str | None) -> str | None:
    """The task name in a park record's message (JSON), or None."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    name = value.get("name") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


class WaitersView(OwnersBasedView):
    """Queued requests (what ``redislock waiters`` and ``queues`` show)."""

    def waiters(self, resource: str, *, limit: int = DEFAULT_WAITER_LIMIT) -> list[Waiter]:
        """At most ``limit`` queued requests of ``resource``, in serving order."""
        validate_resource(resource)
        limit = _v.integer("limit", limit, minimum=1, maximum=MAX_WAITER_LIMIT)
        try:
            entries: Any = self.reader.call(
                "ZRANGE",
                lambda: self.reader.client.zrange(
                    self.keys.queue(resource), 0, limit - 1, withscores=True
                ),
            )
        except redis.ResponseError:
            return []  # not a zset: nothing the engine queued
        parsed = [(text(m, "replace"), float(score)) for m, score in entries]
        tokens = [m[1:] for m, _ in parsed]
        live = self.owners.liveness(owner_of_token(t) for t in tokens)
        states, tasks, asked = self.request_records(tokens, resource)
        parked = self.parked_tasks(tokens)
        out: list[Waiter] = []
        for pos, ((member, score), token) in enumerate(zip(parsed, tokens), start=1):
            owner = owner_of_token(token)
            lv = live[owner]
            st = states.get(token)
            is_parked = token in parked
            out.append(
                Waiter(
                    resource=resource,
                    position=pos,
                    token=token,
                    owner_id=owner,
                    mode=MODE_NAMES.get(member[:1], member[:1]),
                    alive=lv.alive,
                    ttl=lv.ttl,
                    description=lv.description,
                    nested=score < 0,
                    state=(
                        "expired"
                        if st not in ("q", "g")
                        else "parked"
                        if is_parked and st == "q"
                        else {"q": "queued", "g": "granted"}[st or "q"]
                    ),
                    task_id=(
                        token.split("|task:", 1)[1]
                        if is_parked
                        else tasks.get(token, (None, None))[1]
                    ),
                    task_name=parked.get(token) if is_parked else tasks.get(token, (None,))[0],
                    limit=asked.get(token),
                )
            )
        return out

    def request_records(
        self, tokens: Sequence[str], resource: str
    ) -> tuple[
        dict[str, str | None], dict[str, tuple[str | None, str | None]], dict[str, int | None]
    ]:
        """Each queued request's state (``q``, ``g``; None when its record
        is gone), for a request a Celery task made, that task's name and
        id (from the holder record it carries), and for a request of a slot
        of ``resource``, the limit it asked for (from its modes spec): one
        HMGET per request, pipelined in batches."""
        states: dict[str, str | None] = {}
        tasks: dict[str, tuple[str | None, str | None]] = {}
        asked: dict[str, int | None] = {}
        for batch in self.reader.batches(tokens):
            pipe = self.reader.pipe()
            for token in batch:
                pipe.hmget(self.keys.req(token), "state", "holder", "modes", "res")
            for token, got in zip(batch, self.reader.run(pipe)):
                if isinstance(got, Exception):
                    states[token] = None
                    continue
                states[token] = opt_text(got[0])
                record = opt_text(got[1])
                info = holder_info_of(record, token) if record else None
                if info is not None:
                    name, task_id, _node = holder_fields(info)
                    tasks[token] = (name, task_id)
                spec, res = opt_text(got[2]), opt_text(got[3])
                if spec and res and "l" in spec.partition(":")[0]:
                    asked[token] = request_modes(spec, res.split("\n")).get(resource, ("", None))[1]
        return states, tasks, asked

    def parked_tasks(self, tokens: Sequence[str]) -> dict[str, str | None]:
        """token -> task name of each request a parked deferred task made
        (its park record names the token): one HMGET per task owner's
        request, pipelined in batches."""
        parked: dict[str, str | None] = {}
        deferred = [t for t in tokens if "|task:" in t]
        for batch in self.reader.batches(deferred):
            pipe = self.reader.pipe()
            for token in batch:
                pipe.hmget(
                    self.keys.prefix + "defer:" + token.split("|task:", 1)[1], "token", "msg"
                )
            for token, got in zip(batch, self.reader.run(pipe)):
                if isinstance(got, Exception) or opt_text(got[0]) != token:
                    continue
                parked[token] = _task_name(opt_text(got[1]))
        return parked

    def queue_lengths(self) -> list[QueueLength]:
        """Every resource somebody waits for, longest queue first."""
        counts: dict[str, int] = {}
        for batch in self.reader.owner_ids():
            pipe = self.reader.pipe()
            for owner in batch:
                pipe.hvals(self.keys.waits(owner))
            for values in self.reader.run(pipe):
                if isinstance(values, Exception):
                    continue
                for value in values:
                    for name in waited_names(value):
                        counts[name] = counts.get(name, 0) + 1
        return by_length(counts)
