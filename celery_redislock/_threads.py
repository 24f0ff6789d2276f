"""Background threads that stay real OS threads under gevent and eventlet.

A heartbeat must keep running while the main loop blocks: under gevent's or
eventlet's monkey-patching a ``threading.Thread`` is a greenlet that a busy
or blocked hub starves, so we start the thread with the unpatched
primitives and sleep with the unpatched ``time.sleep``.
"""

from __future__ import annotations

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


def start_os_thread(target: Callable[[], Any], name: str) -> None:
    """Start ``target`` in a daemon OS thread (a real one under gevent/eventlet)."""
    if _gevent_patched("thread") or _gevent_patched("threading"):
        from gevent import monkey

        start_new = monkey.get_original("_thread", "start_new_thread")
        start_new(target, ())
        return
    if _eventlet_patched("thread"):
        from eventlet import patcher

        patcher.original("_thread").start_new_thread(target, ())
        return
    threading.Thread(target=target, name=name, daemon=True).start()
