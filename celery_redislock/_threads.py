"""Background threads that stay real OS threads under gevent and eventlet.

A heartbeat must keep running while the main loop blocks: under gevent's or
eventlet's monkey-patching a ``threading.Thread`` is a greenlet that a busy
or blocked hub starves, so we start the thread with the unpatched
primitives and sleep with the unpatched ``time.sleep``.
"""

from __future__ import annotations

import _thread
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def _gevent_patched(module: str) -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched(module))


def _eventlet_patched(module: str) -> bool:
    patcher = sys.modules.get("eventlet.patcher")
    return bool(patcher is not None and patcher.is_monkey_patched(module))


def real_sleep(seconds: float) -> None:
    """Sleep the OS thread, even when ``time`` is monkey-patched."""
    if _gevent_patched("time"):
        from gevent import monkey

        monkey.get_original("time", "sleep")(seconds)
    elif _eventlet_patched("time"):
        from eventlet import patcher

        patcher.original("time").sleep(seconds)
    else:
        time.sleep(seconds)


def os_lock() -> Any:
    """A lock of the OS threads (``_thread.allocate_lock``), even when
    ``thread`` is monkey-patched: acquiring it blocks the calling OS thread,
    never only a greenlet."""
    if _gevent_patched("thread"):
        from gevent import monkey

        return monkey.get_original("_thread", "allocate_lock")()
    if _eventlet_patched("thread"):
        from eventlet import patcher

        return patcher.original("_thread").allocate_lock()
    return _thread.allocate_lock()


class ThreadHandle:
    """A thread started by :func:`start_os_thread`: :meth:`join` waits, with a
    bound, until its target returned."""

    def __init__(self) -> None:
        self._running = os_lock()
        self._running.acquire()  # released by the thread when its target returns

    def ended(self) -> None:
        """Called by the thread as its last step."""
        self._running.release()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; True once it has.

        Blocks the calling OS thread (the whole hub under gevent or eventlet),
        so only for short bounded waits, such as a worker's shutdown.
        """
        if not self._running.acquire(True, max(0.0, timeout)):
            return False
        self._running.release()
        return True


def start_os_thread(target: Callable[[], Any], name: str) -> ThreadHandle:
    """Start ``target`` in a daemon OS thread (a real one under gevent/eventlet).

    Returns its handle, whose :meth:`ThreadHandle.join` waits for its end.
    """
    handle = ThreadHandle()

    def run() -> None:
        try:
            target()
        finally:
            handle.ended()

    if _gevent_patched("thread") or _gevent_patched("threading"):
        from gevent import monkey

        start_new = monkey.get_original("_thread", "start_new_thread")
        start_new(run, ())
        return handle
    if _eventlet_patched("thread"):
        from eventlet import patcher

        patcher.original("_thread").start_new_thread(run, ())
        return handle
    threading.Thread(target=run, name=name, daemon=True).start()
    return handle


def green() -> bool:
    """Whether gevent or eventlet monkey-patched sockets or threads here."""
    return any(
        _gevent_patched(m) or _eventlet_patched(m) for m in ("socket", "thread", "threading")
    )
