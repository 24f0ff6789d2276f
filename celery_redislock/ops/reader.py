"""The round trips every view of a namespace makes: one :class:`Reader`.

A :class:`Reader` holds the client, the key builder and the batch size,
checks the namespace's data format once before its first other read
(:meth:`Reader.usage`), and runs pipelines and single commands with one
error rule: Redis unreachable raises
:class:`~celery_redislock.exceptions.RedisUnavailable` (naming the URL), a
refusal by the ACL raises
:class:`~celery_redislock.exceptions.PermissionDenied` (an unreadable key
must never read as an absent one), any other error reply stays in the
list for the caller to judge. The views (:mod:`.owners`, :mod:`.locks`,
:mod:`.waiters`, :mod:`.summary`) read only through it; it never writes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from ..engine.manager import LockManager
from ..exceptions import RedisUnavailable, permission_denied
from ..protocol.keys import UNVERSIONED_FORMAT, text
from ..store.channel import REDIS_DOWN_ERRORS, format_verdict
from .records import Usage, opt_text

_T = TypeVar("_T")

#: Default number of commands per round trip (SSCAN COUNT, pipeline size).
DEFAULT_BATCH_SIZE = 500


def _command_name(queued: Any) -> str:
    """The command of a queued pipeline entry: ``(args, options)`` for a
    Redis pipeline, a ``PipelineCommand`` (``.args``) for a cluster one."""
    args = getattr(queued, "args", None)
    if args is None:
        args = queued[0]
    return str(args[0]).upper() if args else "?"


class Reader:
    """Batched, read-only round trips on one namespace of a :class:`LockManager`.

    Args:
        manager: gives the client, the key builder and the (masked) URL.
        batch_size: SSCAN COUNT and the most commands one pipeline sends
            (validated by the caller).

    Owns the namespace's :class:`Usage`, read once (:meth:`usage`).
    """

    def __init__(self, manager: LockManager, batch_size: int) -> None:
        self.manager = manager
        self.client = manager.client
        self.keys = manager.keys
        self.url = manager.url
        self.batch_size = batch_size
        self._usage: Usage | None = None

    def usage(self) -> Usage:
        """The namespace's format and whether it was ever used (one round trip).

        GET ``{ns}:format``, EXISTS ``{ns}:fence``, SCARD ``{ns}:owners``;
        read once per inspector, before its first other read. Never writes.
        Raises :class:`~celery_redislock.exceptions.FormatMismatch` when the
        namespace holds lock data of another format than this release reads.
        """
        if self._usage is None:
            pipe = self.pipe()
            pipe.get(self.keys.format)
            pipe.exists(self.keys.fence)
            pipe.scard(self.keys.owners)
            self._usage = Usage(None, False, 0)  # run below must not recurse here
            try:
                stored, fenced, owners = self.run(pipe)
            except BaseException:
                self._usage = None
                raise
            fenced = bool(fenced) and not isinstance(fenced, Exception)
            how = "stored"
            found = None if isinstance(stored, Exception) else opt_text(stored)
            if found is None and fenced:
                found, how = str(UNVERSIONED_FORMAT), "unversioned"
            try:
                version = format_verdict(self.keys.namespace, self.url, found, how)
            except BaseException:
                self._usage = None
                raise
            self._usage = Usage(
                version, fenced, 0 if isinstance(owners, Exception) else int(owners)
            )
        return self._usage

    def run(self, pipe: Any) -> list[Any]:
        """Execute a pipeline; replies that are errors stay in the list, but a
        refusal by the ACL raises :class:`PermissionDenied` (an unreadable
        key must never read as an absent one: a live owner as DEAD)."""
        if self._usage is None:
            self.usage()
        sent = [_command_name(c) for c in pipe.command_stack]
        try:
            replies = list(pipe.execute(raise_on_error=False))
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        for command, reply in zip(sent, replies):
            if isinstance(reply, Exception):
                denied = permission_denied(reply, self.url, command)
                if denied is not None:
                    raise denied from reply
        return replies

    def call(self, command: str, fn: Callable[[], Any]) -> Any:
        """One command: Redis down -> RedisUnavailable; refused -> PermissionDenied."""
        if self._usage is None:
            self.usage()
        try:
            return fn()
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            denied = permission_denied(exc, self.url, command)
            if denied is not None:
                raise denied from exc
            raise

    def pipe(self) -> Any:
        """A pipeline without MULTI (replies go to :meth:`run`)."""
        return self.client.pipeline(transaction=False)

    def batches(self, items: Sequence[_T]) -> Iterator[Sequence[_T]]:
        """``items`` in slices of at most :attr:`batch_size` (one round trip each)."""
        for i in range(0, len(items), self.batch_size):
            yield items[i : i + self.batch_size]

    def sscan(self, key: str) -> Iterator[list[str]]:
        """Members of a set, one SSCAN batch at a time (deduplicated)."""
        return self._scan("SSCAN", self.client.sscan, key)

    def hscan_keys(self, key: str) -> Iterator[list[str]]:
        """Field names of a hash, one HSCAN batch at a time (deduplicated)."""
        return self._scan("HSCAN", self.client.hscan, key)

    def _scan(self, name: str, scan: Callable[..., Any], key: str) -> Iterator[list[str]]:
        """What ``scan`` (SSCAN, HSCAN) walks of ``key``: names, one batch
        at a time, each name once (a cursor may return one twice)."""
        seen: set[str] = set()
        cursor: int = 0
        while True:
            cursor, found = self.call(
                name, functools.partial(scan, key, cursor, count=self.batch_size)
            )
            # HSCAN answers a mapping field -> value; SSCAN a list of members.
            batch = [n for n in (text(x, "replace") for x in found) if n not in seen]
            seen.update(batch)
            if batch:
                yield batch
            if int(cursor) == 0:
                return

    def owner_ids(self) -> Iterator[list[str]]:
        """Batches of the ids in the active-owners set (SSCAN, never SCAN)."""
        return self.sscan(self.keys.owners)

    def resource_of(self, lock_key: str) -> str:
        """The resource of a lock key (the key itself when it is not one)."""
        try:
            return self.keys.resource_of(lock_key)
        except ValueError:
            return lock_key
