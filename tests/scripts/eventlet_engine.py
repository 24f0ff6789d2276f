"""Run the engine under eventlet monkey-patching (a subprocess of test_eventlet.py).

Usage: python eventlet_engine.py URL SCENARIO; prints one JSON line.
"""

import eventlet

eventlet.monkey_patch()

from eventlet import patcher  # noqa: E402
from green_scenarios import Green, main  # noqa: E402


def _join_all(threads: list[eventlet.greenthread.GreenThread]) -> None:
    for t in threads:
        t.wait()


# prefix, thread name, spawn, sleep, join_all, the unpatched sleep (blocks the hub)
EVENTLET = Green(
    "e", "green thread", eventlet.spawn, eventlet.sleep, _join_all, patcher.original("time").sleep
)

if __name__ == "__main__":
    main(EVENTLET)
