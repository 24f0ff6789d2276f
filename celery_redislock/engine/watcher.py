"""The lost-owner watcher: a thread for a process without its own heartbeat.

A Celery pool child's liveness is refreshed by the worker's main process;
without a thread of its own it would learn that it was declared dead only at
its next acquire or release. The watcher blocks on ``{ns}:lost:<owner>``,
which every cleanup of the owner pushes to, marks the owner's leases lost
the moment it is told, and does the heartbeat's upkeep (deferred releases,
retired owners). While the owner holds a lease, each pass first reads the
liveness key's PTTL: that feeds the leases' local deadline (the refreshes
are made by another process) and reports a key that vanished (Redis lost
its data, or evicted it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from .._threads import real_sleep, start_os_thread
from ..protocol.calls import text
from ..store.channel import REDIS_DOWN_ERRORS
from ..store.connect import AnyRedis
from .identity import OwnerIdentity
from .liveness import Liveness
from .shared import Part, Shared

__all__ = ["LostWatcher"]

log = logging.getLogger("celery_redislock.heartbeat")

#: What close() pushes to its own ``{ns}:lost:<owner>`` to wake its watcher
#: (not a loss notice: cleanups push "dead", "operator" and the like).
WATCH_STOP = "closing"
#: Seconds an idle lost-owner watcher sleeps between looks at its process's
#: state (no Redis traffic): a lease granted meanwhile is watched this late
#: (at most half the heartbeat interval, like the watcher's BLPOP).
WATCH_IDLE_SLICE = 0.05


class LostWatcher(Part):
    """One watcher thread per process (started on the first acquire).

    ``upkeep(client)``: what each pass does after its wait (the manager's
    upkeep). The thread ends once the manager is closed.
    """

    def __init__(
        self, core: Shared, liveness: Liveness, upkeep: Callable[[AnyRedis], None]
    ) -> None:
        super().__init__(core)
        self._liveness = liveness
        self._upkeep = upkeep
        self._pid = 0
        self.running = False
        #: Passes the watcher made (idle ones included).
        self.passes = 0
        #: A process whose owners something else watches (the Celery worker's
        #: main process: its node heartbeat marks that owner's leases lost):
        #: no watcher thread there. Pool children still get one.
        self.exempt_pid = 0

    def after_fork_in_child(self) -> None:
        """A forked child has no watcher until its first acquire."""
        self._pid = 0
        self.running = False
        self.passes = 0

    @property
    def started_here(self) -> bool:
        """Whether the watcher was started in this process."""
        return self._pid == os.getpid()

    def ensure(self) -> None:
        """Start this process's watcher unless it already runs here.

        Cost: one blocked connection per process, re-blocking every
        ``min(block_cap, heartbeat_interval / 2)`` seconds, plus one PTTL
        per pass while holding.
        """
        if self._pid == os.getpid() or self._core.closed:
            return
        if os.getpid() == self.exempt_pid:
            return
        with self._state.lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
        start_os_thread(self._loop, "redislock-lost-watch")

    def _loop(self) -> None:
        self.running = True
        try:
            self._passes()
        finally:
            self.running = False

    def _passes(self) -> None:
        pid = os.getpid()
        outage = False
        block = max(0.01, min(self._options.block_cap, self._options.heartbeat_interval / 2))
        idle = min(WATCH_IDLE_SLICE, block)  # a tiny owner_ttl watches sooner
        while not self._core.closed and self._pid == pid:
            self.passes += 1
            try:
                ident = self._liveness.identity.peek()
                if ident is None or not ident.registered or not self._state.busy():
                    real_sleep(idle)
                    continue
                client = self._liveness.heartbeat_client()
                if self._state.holds(ident) and not self._watch_liveness(ident, client):
                    continue
                got = client.blpop([self.keys.lost(ident.owner_id)], timeout=block)
                if outage:
                    outage = False
                    log.info("heartbeat.watch-resumed url=%s", self._channel.url)
                if got is not None and text(got[1]) == WATCH_STOP:
                    continue  # close() woke us: the loop condition ends it
                if got is not None:
                    reason = text(got[1])
                    self._liveness.owner_lost(
                        ident, "declared-dead", "operator" if reason == "operator" else "dead"
                    )
                self._upkeep(client)
            except REDIS_DOWN_ERRORS as exc:  # an outage: one line, not a traceback a second
                if self._core.closed:
                    return
                self._liveness.heartbeat_failed()
                if not outage and not self._core.closed:
                    outage = True
                    log.warning(
                        "heartbeat.watch-unavailable url=%s error=%s: retrying every second",
                        self._channel.url,
                        exc,
                    )
                real_sleep(1.0)
            except Exception:  # the watcher must outlive anything else too
                if self._core.closed:
                    return
                log.exception("heartbeat.watch-error")
                real_sleep(1.0)

    def _watch_liveness(self, ident: OwnerIdentity, client: AnyRedis) -> bool:
        """Watcher side of the deadline (no own heartbeat); False once lost."""
        started = time.monotonic()
        if self._liveness.lapsed(ident, started):
            self._liveness.owner_lost(ident, "deadline")
            return False
        ms = int(client.pttl(self.keys.alive(ident.owner_id)))
        if ms == -2:
            self._liveness.owner_lost(ident, "watch")
            return False
        if ms > 0 and not self._liveness.confirm(ident, started, ms / 1000.0):
            self._liveness.owner_lost(ident, "deadline")
            return False
        return True

    def stop(self, ident: OwnerIdentity) -> None:
        """Wake this process's watcher out of its BLPOP and let it end.

        Without this a closed manager's watcher would keep a connection
        blocked on the server for up to ``block_cap`` seconds (and redis-py
        would reconnect a socket merely closed under it). One pipelined
        LPUSH + PEXPIRE of a value the watcher knows is not a loss notice;
        then up to one second for the thread to leave. Best effort: if Redis
        cannot be reached, the BLPOP times out on its own.
        """
        if not self.running:
            return
        lost = self.keys.lost(ident.owner_id)
        try:
            pipe = self._channel.pipeline()
            pipe.lpush(lost, WATCH_STOP)
            pipe.pexpire(lost, self._options.req_ttl_ms)
            pipe.execute()
        except Exception as exc:
            log.debug("heartbeat.watch-stop-unsent error=%r", exc)
            return
        deadline = time.monotonic() + 1.0
        while self.running and time.monotonic() < deadline:
            real_sleep(0.005)
