"""What every part of the lock engine shares: options, channel, state, metrics.

One :class:`Shared` per manager, built first and handed to each part
(liveness, release, watcher, cleanup, acquire, task owners): the parts
then take only the other parts they call.
"""

from __future__ import annotations

from ..protocol.calls import Protocol
from ..protocol.keys import Keyspace
from ..protocol.options import EngineOptions
from ..store.channel import Channel
from .metrics import Telemetry
from .state import ProcessState

__all__ = ["Shared", "Part"]


class Shared:
    """The shared ground of one manager's parts.

    Attributes:
        options: the validated options.
        channel: every round trip.
        protocol: the script calls (``channel.protocol``).
        keys: the namespace's key names.
        state: what this process holds and owes.
        telemetry: the metrics hook.
        closed: the manager was closed (set by ``LockManager.close``; a
            forked child of a closed manager is closed too).
    """

    def __init__(
        self,
        options: EngineOptions,
        channel: Channel,
        state: ProcessState,
        telemetry: Telemetry,
    ) -> None:
        self.options = options
        self.channel = channel
        self.protocol: Protocol = channel.protocol
        self.keys: Keyspace = channel.keys
        self.state = state
        self.telemetry = telemetry
        self.closed = False


class Part:
    """Base of the engine's parts: each keeps the shared ground at hand.

    ``_core`` is the :class:`Shared`; ``_options``, ``_channel``,
    ``_protocol``, ``_state``, ``_telemetry`` and ``keys`` are its fields,
    read once here (the acquire path reads them on every call).
    """

    def __init__(self, core: Shared) -> None:
        self._core = core
        self._options = core.options
        self._channel = core.channel
        self._protocol = core.protocol
        self._state = core.state
        self._telemetry = core.telemetry
        self.keys = core.keys
