"""The node's own Redis clients: one private manager per OS thread.

The node's scripts and clean-ups never go through the worker's manager:
its heartbeat runs in a real OS thread, and a gevent- or eventlet-patched
socket must not be shared between OS threads. :class:`NodeClients` makes a
:class:`LockManager` on a cloned connection pool for each OS thread that
asks, never registering an owner with it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ..engine.manager import LockManager
from ..protocol.calls import ScriptCall
from ..store.connect import clone_client


class NodeClients:
    """Managers on private connection pools, one per OS thread, for one node.

    Args:
        manager: the worker's manager; each private one copies its client
            (cloned), namespace, TTLs, interval and queue scan limit.

    Owns :attr:`by_thread`. Closed by :meth:`close` at the node's shutdown.
    """

    def __init__(self, manager: LockManager) -> None:
        self.manager = manager
        #: OS thread id -> the manager made for that thread.
        self.by_thread: dict[int, LockManager] = {}

    def ops(self) -> LockManager:
        """A manager on a private connection pool for the calling OS thread.

        Never registers an owner: used for the node scripts and for
        ``cleanup_owner``. One per thread, because a gevent-patched socket
        must not be shared between OS threads.
        """
        key = threading.get_ident() if not _gevent_patched() else _real_ident()
        ops = self.by_thread.get(key)
        if ops is None:
            ops = LockManager(
                clone_client(self.manager.client),
                self.manager.namespace,
                owner_ttl=self.manager.owner_ttl,
                heartbeat_interval=self.manager.heartbeat_interval,
                queue_scan_limit=self.manager.queue_scan_limit,
                heartbeat=False,
                eviction_check="ignore",  # the bootstep checks at start-up
            )
            self.by_thread[key] = ops
        return ops

    def run(self, call: ScriptCall) -> Any:
        """Run one script call on the calling thread's manager."""
        return self.ops().channel.run(call)

    def check_format_again(self) -> None:
        """Make every private manager check (and re-create) the format key on
        its next call: Redis lost data, perhaps that key too."""
        for ops in list(self.by_thread.values()):
            ops.channel.format_pending = True

    def close(self) -> None:
        """Close every private manager's client and forget them."""
        for ops_mgr in list(self.by_thread.values()):
            try:
                ops_mgr.client.close()
            except Exception:
                pass
        self.by_thread.clear()


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("thread"))


def _real_ident() -> int:
    from gevent import monkey

    return int(monkey.get_original("_thread", "get_ident")())
