"""The per-process heartbeat thread that keeps an owner's liveness.

One daemon OS thread per process (a real thread under gevent), started on
first use and again in a forked child (the pid is checked on every start).
Each tick calls ``beat()``, which makes one Redis round trip for every
owner it refreshes. The thread sleeps in short slices so ``stop()`` is
prompt, and it never lets an exception end it: a failed beat is retried on
the next tick. A library error (Redis unreachable) is logged in one line
when it starts (``heartbeat.unavailable``) and when it ends
(``heartbeat.resumed``), not once per tick; anything else is logged with
its traceback.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from .._threads import ThreadHandle, real_sleep, start_os_thread
from ..exceptions import LockError

logger = logging.getLogger("celery_redislock.heartbeat")

_SLICE = 0.05


class Heartbeat:
    """Calls ``beat`` every ``interval`` seconds from a background OS thread."""

    def __init__(
        self,
        interval: float,
        beat: Callable[[], None],
        name: str,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.interval = interval
        self._beat = beat
        #: Called (never raising into the loop) for every beat that raised.
        self._on_failure = on_failure
        self._name = name
        self._pid: int | None = None
        self._stopped = False
        self._wake = False
        self._lock = threading.Lock()
        self._thread: ThreadHandle | None = None
        #: Ticks completed by this process's thread (tests wait on it).
        self.ticks = 0

    @property
    def running(self) -> bool:
        return self._pid == os.getpid() and not self._stopped

    def ensure_started(self) -> None:
        """Start the thread in this process unless it already runs here."""
        if self._pid == os.getpid() or self._stopped:
            return
        with self._lock:
            if self._pid == os.getpid() or self._stopped:
                return
            self._pid = os.getpid()
            self.ticks = 0
            self._thread = start_os_thread(self._run, self._name)

    def stop(self) -> None:
        """Ask the thread to end; it exits within a fraction of a second
        (at the end of the beat in progress, if one is)."""
        self._stopped = True

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for this process's thread to end
        (after :meth:`stop`); True once none runs here."""
        handle = self._thread
        if handle is None or self._pid != os.getpid():
            return True
        return handle.join(timeout)

    def wake(self) -> None:
        """Beat now (within one sleep slice) rather than at the next interval.

        Only sets a flag, so it is safe from any thread or signal context;
        wakes arriving before the thread picks the flag up make one beat.
        """
        self._wake = True

    def after_fork_in_child(self) -> None:
        """The parent's thread does not exist here; the next use starts one."""
        self._lock = threading.Lock()
        self._pid = None
        self._thread = None
        self.ticks = 0

    def _run(self) -> None:
        pid = os.getpid()
        next_at = time.monotonic() + self.interval
        failing = 0
        while not self._stopped and self._pid == pid:
            now = time.monotonic()
            if now < next_at and not self._wake:
                real_sleep(min(_SLICE, next_at - now))
                continue
            self._wake = False
            next_at = now + self.interval
            try:
                self._beat()
            except LockError as exc:  # an outage: one line, not one per tick
                failing += 1
                self._failed()
                if failing == 1:
                    logger.warning(
                        "heartbeat.unavailable thread=%s error=%s: retrying every tick",
                        self._name,
                        exc,
                    )
            except Exception:  # a failed beat must not end the heartbeat
                logger.exception("heartbeat.error thread=%s", self._name)
                self._failed()
            else:
                if failing:
                    logger.info("heartbeat.resumed thread=%s failed_beats=%d", self._name, failing)
                    failing = 0
            self.ticks += 1

    def _failed(self) -> None:
        if self._on_failure is not None:
            try:
                self._on_failure()
            except Exception:  # a metrics hook must not end the heartbeat
                logger.debug("heartbeat.on-failure-error", exc_info=True)
