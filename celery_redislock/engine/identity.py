"""Owner identities: one per process, fresh after every fork.

An owner is one OS process that holds or waits for locks. Its id is made
from the pid and random bits, so a forked child can never keep its parent's
id: :func:`os.register_at_fork` resets every live :class:`OwnerIdentity`
source in the child, and :meth:`IdentitySource.current` also compares the
pid on every call (a fork that bypassed the hooks is still caught).

A process is recorded in a worker incarnation's group hash by its *process
tag* (:func:`process_tag`), ``"<pid>.<starttime>"``, which a new process
that reuses the pid cannot match (docs/worker.md, race R6).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable

from ..protocol.keys import new_owner_id, new_request_id, owner_description
from ..protocol.owner import Owner

__all__ = [
    "IdentitySource",
    "OwnerIdentity",
    "new_owner_id",
    "new_request_id",
    "parse_proc_stat",
    "pid_of_tag",
    "process_tag",
    "read_proc_stat",
]


@functools.lru_cache(maxsize=1)
def _proc_mounted() -> bool:
    return os.path.exists("/proc/self/stat")


def parse_proc_stat(data: str) -> tuple[str, int, int]:
    """``(state, ppid, starttime)`` from the text of a ``/proc/<pid>/stat``.

    ``starttime`` is field 22: clock ticks since boot. The command name
    (field 2) is in parentheses and may itself contain spaces and ``)``, so
    the fields are split after the *last* ``)``. Raises ValueError when the
    text is not a stat line.
    """
    end = data.rfind(")")
    rest = data[end + 1 :].split() if end >= 0 else []
    if len(rest) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {data[:80]!r}")
    return rest[0], int(rest[1]), int(rest[19])


def read_proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, starttime)`` of ``pid`` (see :func:`parse_proc_stat`).

    None when there is no such process or its stat cannot be read or
    parsed. Raises OSError where /proc is not available (not Linux).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        if _proc_mounted():
            return None
        raise
    except PermissionError:
        return None
    try:
        return parse_proc_stat(data)
    except ValueError:
        return None


def process_tag(pid: int) -> str:
    """The identity of process ``pid`` that survives pid reuse.

    ``"<pid>.<starttime>"`` (starttime: field 22 of ``/proc/<pid>/stat``),
    or plain ``"<pid>"`` where /proc is unavailable or the stat cannot be
    read. Reads one /proc file, no other I/O.
    """
    try:
        st = read_proc_stat(pid)
    except OSError:
        st = None
    return f"{pid}.{st[2]}" if st is not None else str(pid)


def pid_of_tag(tag: str | bytes) -> int:
    """The pid of a process tag; a bare pid (older registrations) as is.

    Raises ValueError when ``tag`` is neither.
    """
    text = tag.decode() if isinstance(tag, bytes) else tag
    return int(text.split(".", 1)[0])


class OwnerIdentity(Owner):
    """One owner of this process (:class:`~celery_redislock.protocol.owner.Owner`),
    with its process tag."""

    @functools.cached_property
    def tag(self) -> str:
        """This owner's process tag (:func:`process_tag`), read once."""
        return process_tag(self.pid)

    def describe(self, name: str | None) -> str:
        """Value of the liveness key: who this owner is, for operators."""
        return owner_description(self.pid, name)


_sources: weakref.WeakSet[IdentitySource] = weakref.WeakSet()


class IdentitySource:
    """Hands out the current process's identity; resets itself after fork."""

    def __init__(self, on_fork: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._identity: OwnerIdentity | None = None
        self._on_fork = on_fork
        _sources.add(self)

    def current(self) -> OwnerIdentity:
        """This process's identity, created on first use or after a fork/loss."""
        ident = self._identity
        if ident is not None and ident.pid == os.getpid():
            return ident
        with self._lock:
            ident = self._identity
            if ident is None or ident.pid != os.getpid():
                ident = self._identity = OwnerIdentity()
            return ident

    def peek(self) -> OwnerIdentity | None:
        """The identity if one exists for this process, without creating one."""
        ident = self._identity
        if ident is not None and ident.pid == os.getpid():
            return ident
        return None

    def retire(self, ident: OwnerIdentity) -> bool:
        """Drop ``ident`` (its liveness is gone); the next call makes a new one."""
        with self._lock:
            if self._identity is ident:
                self._identity = None
                return True
            return False

    def after_fork_in_child(self) -> None:
        """In a forked child: no identity yet; the fork callback runs."""
        self._lock = threading.Lock()
        self._identity = None
        if self._on_fork is not None:
            self._on_fork()


def _reset_all_after_fork() -> None:
    for source in list(_sources):
        source.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_all_after_fork)
