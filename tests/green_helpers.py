"""What test_eventlet.py and test_gevent.py share: the scenario runner of a
green-thread library and the checks of the scenarios both run
(tests/scripts/green_scenarios.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest

from engine_helpers import run_scenario


def green_runner(library: str) -> Callable[[str, str], dict[str, Any]]:
    """Skip the calling module unless ``library`` is installed; else return
    ``run(redis_url, scenario)`` for ``tests/scripts/<library>_engine.py``."""
    # Only look for it: importing the library here would hook fork() in the test process.
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed", allow_module_level=True)
    return lambda redis_url, scenario: run_scenario(f"{library}_engine.py", redis_url, scenario)


def assert_served_in_arrival_order_without_overlap(out: dict[str, Any]) -> None:
    """The ``contention`` scenario: six green threads, FIFO, never two inside."""
    assert out["overlaps"] == 0
    assert out["order"] == list(range(6))


def assert_heartbeat_outlived_the_blocked_hub(out: dict[str, Any]) -> None:
    """The ``blocked_hub`` scenario: the OS-thread heartbeat kept the lease."""
    assert out["ticks"] >= 2
    assert out["lost"] is False
    assert out["held"] is True


def assert_limited_slots_kept_and_served_in_order(out: dict[str, Any]) -> None:
    """The ``limited`` scenario: never more than its 3 slots held at once,
    granted in arrival order, nothing left queued or locked after."""
    assert 1 <= out["peak"] <= 3
    assert out["fences_in_arrival_order"] is True
    assert out["queued_after"] == 0
    assert out["lock_exists"] == 0
