"""Owner identities: one per process, fresh after every fork.

An owner is one OS process that holds or waits for locks. Its id is made
from the pid and random bits, so a forked child can never keep its parent's
id: :func:`os.register_at_fork` resets every live :class:`OwnerIdentity`
source in the child, and :meth:`IdentitySource.current` also compares the
pid on every call (a fork that bypassed the hooks is still caught).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field


def new_owner_id() -> str:
    """A fresh owner id: ``<pid>-<16 hex>``; never contains ``|``."""
    return f"{os.getpid()}-{secrets.token_hex(8)}"


@dataclass
class OwnerIdentity:
    """One owner: its id, the pid it belongs to, and whether Redis knows it."""

    owner_id: str = field(default_factory=new_owner_id)
    pid: int = field(default_factory=os.getpid)
    #: True once an acquire registered the liveness key (SET NX).
    registered: bool = False

    def describe(self, name: str | None) -> str:
        """Value of the liveness key: who this owner is, for operators."""
        label = f" name={name}" if name else ""
        return f"pid={self.pid} host={socket.gethostname()}{label}"


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

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._identity = None
        if self._on_fork is not None:
            self._on_fork()


def _reset_all_after_fork() -> None:
    for source in list(_sources):
        source._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_all_after_fork)
