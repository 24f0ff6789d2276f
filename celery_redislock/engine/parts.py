"""The parts of one lock manager, built in order, and what they do together.

:class:`Parts` builds a manager's parts, each on the parts below it
(docs/architecture.md, "The engine: a facade over parts"), owns them, and
holds the two things that span several parts: the reset of a forked child
(every part forgets its parent's state) and the upkeep of a heartbeat pass
(:meth:`Parts.tend`). :class:`~celery_redislock.engine.manager.LockManager`
hands every public call to one of them.
"""

from __future__ import annotations

from ..protocol.calls import Protocol
from ..protocol.keys import Keyspace
from ..protocol.options import EngineOptions
from ..protocol.request import RequestCache
from ..store.channel import Channel
from ..store.connect import AnyRedis
from .acquire import Acquirer
from .cleanup import Cleaner
from .context import ContextStack
from .liveness import Liveness
from .metrics import MetricsHook, Telemetry
from .release import Releaser
from .shared import Shared
from .state import ProcessState
from .task_owner import TaskOwners
from .watcher import LostWatcher

__all__ = ["Parts"]


class Parts:
    """A manager's parts, each below the next.

    Args:
        keys: the namespace's key names.
        options: the validated options.
        client: the manager's client.
        url: the client's URL for display (passwords masked).
        metrics: the metrics hook, or None.

    Named without an underscore for the worker services built on the
    engine (node, defer): package-internal, not public API.
    """

    def __init__(
        self,
        keys: Keyspace,
        options: EngineOptions,
        client: AnyRedis,
        url: str,
        metrics: MetricsHook | None,
    ) -> None:
        self.protocol = Protocol(keys, options)
        self.channel = Channel(client, url, self.protocol)
        self.state = ProcessState()
        self.telemetry = Telemetry(metrics)
        self.core = core = Shared(options, self.channel, self.state, self.telemetry)
        #: What ``@locked`` and ``UniqueTask`` tell this thread's acquires
        #: (``celery_redislock.context``): holder record, haltable wait, request id.
        self.context = ContextStack()
        self.requests = RequestCache(keys)
        self.liveness = Liveness(core, self.after_fork_in_child)
        self.liveness.upkeep = self.tend
        self.releaser = Releaser(core, self.liveness)
        self.watcher = LostWatcher(core, self.liveness, self.tend)
        self.cleaner = Cleaner(core, self.liveness, self.releaser)
        self.acquirer = Acquirer(
            core, self.liveness, self.releaser, self.watcher, self.requests, self.context
        )
        self.tasks = TaskOwners(
            core, self.liveness, self.releaser, self.cleaner, self.acquirer, self.requests
        )

    def after_fork_in_child(self) -> None:
        """In a forked child: every part forgets what the parent held."""
        self.channel.after_fork_in_child()
        self.state.after_fork_in_child()
        self.context.reset()
        self.liveness.after_fork_in_child()
        self.watcher.after_fork_in_child()
        self.acquirer.after_fork_in_child()

    def tend(self, client: AnyRedis) -> None:
        """The work of every heartbeat after its refresh (also the lost-owner
        watcher's and the worker node's): put this process's retired owners
        to death, retry its deferred releases."""
        self.cleaner.bury_doomed(client)
        self.releaser.retry_deferred(client)
