"""Loads the Lua scripts in ``lua/`` and runs them with EVALSHA.

Each script is ``_common.lua`` followed by the script's own file (the part of
``_common.lua`` below its ``-- @helpers`` line goes where the script has that
line, if it has one: after the script's fast path).
:meth:`Scripts.run` sends EVALSHA and, on NOSCRIPT (after a Redis restart or
SCRIPT FLUSH), loads the script and retries, so callers never see a missing
script. :meth:`Scripts.run_and_wait` sends EVALSHA and ``WAIT`` in one
pipeline (one round trip; ``WAIT`` cannot run inside Lua), with the same
NOSCRIPT handling. (It calls ``evalsha`` itself rather than through redis-py's
``Script`` object: the release sits on the hand-off's critical path, and
that wrapper copies every key and argument once more on each call.)
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from . import wire
from .connect import AnyRedis
from .keys import FORMAT_VERSION

#: Scripts shipped in ``celery_redislock/lua``, one per operation.
SCRIPT_NAMES = (
    "acquire",
    "release",
    "heartbeat",
    "cleanup_owner",
    "contenders",
    "node_start",
    "node_heartbeat",
    "node_evict",
    "node_stop",
    "format",
    "adopt",
    "forget_idle",
    "defer_park",
    "defer_adopted",
    "defer_claim",
    "defer_granted",
    "defer_done",
    "defer_withdraw",
    "defer_tick",
)


#: The line that splits ``_common.lua`` into the helpers every script gets
#: first and those placed where a script has the same line (after its fast
#: path: creating a closure costs each call of the script, returned early or not).
HELPERS = "-- @helpers\n"


@cache
def source(name: str) -> str:
    """Full source of script ``name``: the format constant, the shared helpers, the script.

    The helpers below ``_common.lua``'s :data:`HELPERS` line go where the
    script has that line, if it has one (after its fast path), else before it.

    ``FORMAT_VERSION`` (a Lua string) is this release's data format, which
    ``_common.lua``'s ``next_fence`` records when it creates the fence.
    """
    lua = resources.files("celery_redislock") / "lua"
    common = (lua / "_common.lua").read_text(encoding="utf-8")
    own = (lua / f"{name}.lua").read_text(encoding="utf-8")
    head = f"local FORMAT_VERSION = '{int(FORMAT_VERSION)}'\n"
    core, found, rest = common.partition(HELPERS)
    if not found:
        raise RuntimeError(f"_common.lua has no {HELPERS.strip()!r} line")
    before, found, after = own.partition(HELPERS)
    if not found:
        return head + common + "\n" + own
    # The script's fast path (before its marker) runs before the closures of
    # the helpers below _common.lua's marker are made.
    return head + core + "\n" + before + rest + "\n" + after


class Scripts:
    """The scripts of one client; call ``scripts.run(name, keys, args)``."""

    def __init__(self, client: AnyRedis, names: tuple[str, ...] = SCRIPT_NAMES) -> None:
        self._client = client
        self._source = {name: source(name) for name in names}
        self._sha = {
            name: hashlib.sha1(text.encode("utf-8")).hexdigest()
            for name, text in self._source.items()
        }
        #: Encoded ``EVALSHA <sha>`` of each script, for :meth:`run_direct`.
        self._head = {
            name: wire.bulk("EVALSHA") + wire.bulk(sha) for name, sha in self._sha.items()
        }

    @property
    def shas(self) -> dict[str, str]:
        """Script name -> SHA1 that EVALSHA runs it by."""
        return dict(self._sha)

    def run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Run script ``name`` (EVALSHA, loading it on NOSCRIPT); one round trip.

        ``client``: another client of the same server (e.g. the heartbeat's);
        default the one given at construction.
        """
        c = self._client if client is None else client
        try:
            return c.execute_command("EVALSHA", self._sha[name], len(keys), *keys, *args)
        except NoScriptError:
            c.script_load(self._source[name])
            return c.execute_command("EVALSHA", self._sha[name], len(keys), *keys, *args)

    def run_direct(
        self,
        conn: Any,
        client: Any,
        name: str,
        keys: list[str],
        args: list[Any],
        again: list[Any] | None = None,
    ) -> Any:
        """:meth:`run` sent straight on ``conn``, the connection ``client``
        holds (:mod:`celery_redislock.wire`: no redis-py command wrapper).

        ``again``: the arguments of every send but the first (a retry after
        a failed attempt, the send after a NOSCRIPT); default ``args``.
        """
        head = self._head[name]
        packed = wire.pack(conn, head, (len(keys), *keys, *args), 2)
        later = None
        if again is not None:

            def later() -> bytes:
                return wire.pack(conn, head, (len(keys), *keys, *again), 2)

        try:
            return wire.call(conn, packed, later)
        except NoScriptError:
            client.script_load(self._source[name])
            return wire.call(conn, packed if later is None else later())

    def run_then_read(
        self,
        name: str,
        keys: list[str],
        args: list[Any],
        hashes: list[str],
        probe: tuple[str, str] | None = None,
        then: tuple[str, list[str]] | None = None,
    ) -> tuple[Any, list[Any], Any]:
        """Run script ``name`` and ``HGETALL`` each of ``hashes``: one round trip
        (on Redis Cluster, one per command: redis-py has no EVALSHA in a
        cluster pipeline).

        ``probe`` = ``(key, field)``: an ``HGET`` sent just before the script,
        in the same pipeline (what the script is about to find). ``then`` =
        ``(script, keys)``: a script (no ARGV) sent last; its reply is not
        returned. The reads go on the same connection as the script, not
        atomically with it: another client's command may run in between, so
        callers treat what they read as a hint. Returns ``(script reply,
        [hash contents], probed value or None)``. NOSCRIPT of the main script
        loads it and sends the pipeline again; of ``then`` alone, runs that
        script again (loading it). A script error is raised as it is.
        """
        c = self._client
        if isinstance(c, RedisCluster):
            # redis-py refuses EVALSHA in a cluster pipeline: the same
            # commands one after the other (every key is in one slot).
            probed = c.hget(*probe) if probe is not None else None
            reply = self.run(name, keys, args)
            read = [c.hgetall(key) for key in hashes]
            if then is not None:
                self.run(then[0], then[1], [])
            return reply, read, probed
        for attempt in (1, 2):
            pipe = c.pipeline(transaction=False)
            if probe is not None:
                pipe.hget(*probe)
            pipe.evalsha(self._sha[name], len(keys), *keys, *args)
            for key in hashes:
                pipe.hgetall(key)
            if then is not None:
                pipe.evalsha(self._sha[then[0]], len(then[1]), *then[1])
            out = pipe.execute(raise_on_error=False)
            probed = out.pop(0) if probe is not None else None
            last = out.pop() if then is not None else None
            reply, *read = out
            if isinstance(reply, NoScriptError) and attempt == 1:
                c.script_load(self._source[name])
                continue
            if then is not None and isinstance(last, NoScriptError):
                # The main script ran: only the last one is run again (the
                # whole pipeline again would read its own grant as earlier).
                last = self.run(then[0], then[1], [])
            for item in (reply, *read, probed, last):
                if isinstance(item, Exception):
                    raise item
            return reply, read, probed
        raise AssertionError("unreachable")  # pragma: no cover

    def run_and_wait(
        self, name: str, keys: list[str], args: list[Any], replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        """Run script ``name``, then ``WAIT replicas timeout_ms``: one round trip.

        Both go in one pipeline, so ``WAIT`` runs on the connection that ran
        the script and counts the replicas that have its writes. Returns
        ``(script reply, replicas that acknowledged)``. On NOSCRIPT the
        script is loaded and the pipeline sent again (the first ``WAIT`` is
        then discarded). A script error is raised as it is. Not for Redis
        Cluster (``WAIT`` has no key there to route it by).
        """
        c = self._client
        for attempt in (1, 2):
            pipe = c.pipeline(transaction=False)
            pipe.evalsha(self._sha[name], len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            reply, acked = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and attempt == 1:
                c.script_load(self._source[name])
                continue
            for item in (reply, acked):
                if isinstance(item, Exception):
                    raise item
            return reply, int(acked)
        raise AssertionError("unreachable")  # pragma: no cover
