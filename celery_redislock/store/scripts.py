"""Loads the Lua scripts in ``lua/`` and runs them with EVALSHA.

Each script is the helpers of ``_common.lua`` it uses followed by the
script's own file: a helper is a closure Lua makes on every call of the
script, used or not, so a script gets only the helpers its code names
(and the helpers they name). Where a script has a ``-- @helpers`` line,
the helpers its fast path (above that line) does not use go there instead,
so a call that returns early makes none of them.
:meth:`Scripts.run` sends EVALSHA and, on NOSCRIPT (after a Redis restart or
SCRIPT FLUSH), loads the script and retries, so callers never see a missing
script. :meth:`Scripts.run_and_wait` sends EVALSHA and ``WAIT`` in one
pipeline (one round trip; ``WAIT`` cannot run inside Lua), with the same
NOSCRIPT handling; :meth:`Scripts.run_async` is :meth:`Scripts.run` for a
``redis.asyncio`` client (the asyncio front-end), with the same scripts,
SHAs and NOSCRIPT handling. (It calls ``evalsha`` itself rather than through redis-py's
``Script`` object: the release sits on the hand-off's critical path, and
that wrapper copies every key and argument once more on each call.)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any, TypeVar

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from ..protocol.keys import FORMAT_VERSION
from . import wire
from .connect import AnyRedis

_T = TypeVar("_T")

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
    "defer_claim",
    "defer_granted",
    "defer_done",
    "defer_withdraw",
    "defer_tick",
    "defer_guard",
    "defer_nudge",
)


#: A script's line after which the helpers its fast path does not use are
#: placed (scripts.py, :func:`source`).
HELPERS = "-- @helpers\n"

#: A top-level definition of ``_common.lua``: ``local function f(``,
#: ``local x`` (a variable, or a forward declaration) or ``f = function(``.
_DEFINITION = re.compile(
    r"^(?:local function ([A-Za-z_]\w*)|local ([A-Za-z_]\w*)|([A-Za-z_]\w*) = function\b)"
)
_COMMENT = re.compile(r"--[^\n]*")
#: A comment, a quoted string (escapes included) or a name, in Lua source.
_TOKEN = re.compile(
    r"""--[^\n]*|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"|([A-Za-z_][A-Za-z0-9_]*)"""
)


def _names(lua: str) -> set[str]:
    """The names ``lua`` uses: identifiers outside comments and strings."""
    return {m.group(1) for m in _TOKEN.finditer(lua) if m.group(1)}


@cache
def helper_units() -> tuple[tuple[str, str, frozenset[str]], ...]:
    """``_common.lua`` cut at its top-level definitions: ``(name defined,
    text, names it uses)`` in file order. Comment lines before a definition
    end the previous unit's text; they cost nothing at run time."""
    lua = resources.files("celery_redislock") / "lua"
    common = (lua / "_common.lua").read_text(encoding="utf-8")
    units: list[list[str]] = []
    for line in common.splitlines(keepends=True):
        match = _DEFINITION.match(line)
        if match:
            units.append([match.group(1) or match.group(2) or match.group(3), line])
        elif units:
            units[-1][1] += line
        elif _COMMENT.sub("", line).strip():
            raise RuntimeError(f"_common.lua: code before its first definition: {line!r}")
    defined = {name for name, _ in units}
    return tuple((name, text, frozenset(_names(text) & defined - {name})) for name, text in units)


def _needed(lua: str, units: tuple[tuple[str, str, frozenset[str]], ...]) -> set[str]:
    """The helper names ``lua`` uses, and those they use, transitively."""
    uses: dict[str, frozenset[str]] = {}
    for name, _, names in units:
        uses[name] = uses.get(name, frozenset()) | names
    todo = [n for n in _names(lua) if n in uses]
    needed: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(uses[name])
    return needed


@cache
def source(name: str) -> str:
    """Full source of script ``name``: the format constant, the helpers it
    uses, the script.

    The helpers come in ``_common.lua``'s order (each uses only those above
    it, or a forward-declared one). With a :data:`HELPERS` line in the
    script, those its code above the line does not use go at that line.

    ``FORMAT_VERSION`` (a Lua string) is this release's data format, which
    ``_common.lua``'s ``next_fence`` records when it creates the fence.
    """
    lua = resources.files("celery_redislock") / "lua"
    own = (lua / f"{name}.lua").read_text(encoding="utf-8")
    head = f"local FORMAT_VERSION = '{int(FORMAT_VERSION)}'\n"
    units = helper_units()
    before, found, after = own.partition(HELPERS)
    first = _needed(before, units)
    later = _needed(own, units) - first

    def block(names: set[str]) -> str:
        return "".join(text for unit, text, _ in units if unit in names)

    if not found:
        return head + block(first) + "\n" + own
    # The script's fast path (before its marker) runs before the closures of
    # the helpers only the rest uses are made.
    return head + block(first) + "\n" + before + block(later) + "\n" + after


class Scripts:
    """The scripts of one client; call ``scripts.run(name, keys, args)``."""

    def __init__(self, client: AnyRedis | Any, names: tuple[str, ...] = SCRIPT_NAMES) -> None:
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

    def _loading(self, name: str, client: Any, send: Callable[[bool], _T]) -> _T:
        """``send(False)``; on NOSCRIPT (a Redis restart, SCRIPT FLUSH), load
        script ``name`` with ``client`` and ``send(True)``: the one place a
        missing script is handled. A pipeline's ``send`` raises the
        NoScriptError its reply holds."""
        try:
            return send(False)
        except NoScriptError:
            client.script_load(self._source[name])
            return send(True)

    async def run_async(self, client: Any, name: str, keys: list[Any], args: list[Any]) -> Any:
        """:meth:`run` on a ``redis.asyncio`` client (the asyncio front-end).

        The same EVALSHA by the same SHA and, on NOSCRIPT, the same answer as
        :meth:`_loading`: load script ``name`` with that client, send again.
        """
        sha = self._sha[name]
        try:
            return await client.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self._source[name])
            return await client.execute_command("EVALSHA", sha, len(keys), *keys, *args)

    async def run_and_wait_async(
        self,
        client: Any,
        name: str,
        keys: list[Any],
        args: list[Any],
        replicas: int,
        timeout_ms: int,
    ) -> tuple[Any, int]:
        """:meth:`run_and_wait` on a ``redis.asyncio`` client: the script and
        ``WAIT`` in one pipeline, loaded and sent again on NOSCRIPT."""

        async def send() -> tuple[Any, int]:
            pipe = client.pipeline(transaction=False)
            pipe.evalsha(self._sha[name], len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            reply, acked = await pipe.execute(raise_on_error=False)
            for item in (reply, acked):
                if isinstance(item, Exception):
                    raise item
            return reply, int(acked)

        try:
            return await send()
        except NoScriptError:
            await client.script_load(self._source[name])
            return await send()

    def run(self, name: str, keys: list[Any], args: list[Any], client: Any = None) -> Any:
        """Run script ``name`` (EVALSHA, loading it on NOSCRIPT); one round trip.

        ``client``: another client of the same server (e.g. the heartbeat's);
        default the one given at construction.
        """
        c = self._client if client is None else client
        sha = self._sha[name]
        return self._loading(
            name, c, lambda _again: c.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        )

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

        def send(retry: bool) -> Any:
            if not retry:
                return wire.call(conn, packed, later)
            return wire.call(conn, packed if later is None else later())

        return self._loading(name, client, send)

    def run_then_read(
        self,
        name: str,
        keys: list[Any],
        args: list[Any],
        hashes: list[str],
        probe: tuple[str, str] | None = None,
        then: tuple[str, list[str]] | None = None,
        wait: tuple[int, int] | None = None,
    ) -> tuple[Any, list[Any], Any, int | None]:
        """Run script ``name`` and ``HGETALL`` each of ``hashes``: one round trip
        (on Redis Cluster, one per command: redis-py has no EVALSHA in a
        cluster pipeline).

        ``probe`` = ``(key, field)``: an ``HGET`` sent just before the script,
        in the same pipeline (what the script is about to find). ``then`` =
        ``(script, keys)``: a script (no ARGV) sent last; its reply is not
        returned. The reads go on the same connection as the script, not
        atomically with it: another client's command may run in between, so
        callers treat what they read as a hint. ``wait`` = ``(replicas,
        timeout_ms)``: ``WAIT`` sent last, on the same connection (not on
        Redis Cluster). Returns ``(script reply, [hash contents], probed
        value or None, replicas that acknowledged or None)``. NOSCRIPT of the main script
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
            return reply, read, probed, None

        def send(_again: bool) -> tuple[Any, list[Any], Any, int | None]:
            pipe = c.pipeline(transaction=False)
            if probe is not None:
                pipe.hget(*probe)
            pipe.evalsha(self._sha[name], len(keys), *keys, *args)
            for key in hashes:
                pipe.hgetall(key)
            if then is not None:
                pipe.evalsha(self._sha[then[0]], len(then[1]), *then[1])
            if wait is not None:
                pipe.execute_command("WAIT", *wait)
            out = pipe.execute(raise_on_error=False)
            probed = out.pop(0) if probe is not None else None
            acked = out.pop() if wait is not None else None
            last = out.pop() if then is not None else None
            reply, *read = out
            if isinstance(reply, NoScriptError):
                raise reply  # nothing ran: load it, send the pipeline again
            if then is not None and isinstance(last, NoScriptError):
                # The main script ran: only the last one is run again (the
                # whole pipeline again would read its own grant as earlier).
                last = self.run(then[0], then[1], [])
            for item in (reply, *read, probed, last, acked):
                if isinstance(item, Exception):
                    raise item
            return reply, read, probed, None if acked is None else int(acked)

        return self._loading(name, c, send)

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

        def send(_again: bool) -> tuple[Any, int]:
            pipe = c.pipeline(transaction=False)
            pipe.evalsha(self._sha[name], len(keys), *keys, *args)
            pipe.execute_command("WAIT", replicas, timeout_ms)
            reply, acked = pipe.execute(raise_on_error=False)
            for item in (reply, acked):
                if isinstance(item, Exception):
                    raise item  # a NoScriptError: loaded, sent again (the first WAIT dropped)
            return reply, int(acked)

        return self._loading(name, c, send)
