"""The engine under eventlet: green threads queue FIFO without overlap, and
the heartbeat is a real OS thread that a blocked hub cannot starve."""

from __future__ import annotations

import importlib.util

import pytest

from engine_helpers import run_scenario

# Only look for it: importing eventlet here would hook fork() in the test process.
if importlib.util.find_spec("eventlet") is None:
    pytest.skip("eventlet is not installed", allow_module_level=True)


def run(redis_url: str, scenario: str) -> dict:
    return run_scenario("eventlet_engine.py", redis_url, scenario)


def test_green_threads_are_served_in_arrival_order_without_overlap(redis_url: str) -> None:
    out = run(redis_url, "contention")
    assert out["overlaps"] == 0
    assert out["order"] == list(range(6))


def test_heartbeat_keeps_liveness_while_the_eventlet_hub_is_blocked(redis_url: str) -> None:
    out = run(redis_url, "blocked_hub")
    assert out["ticks"] >= 2
    assert out["lost"] is False
    assert out["held"] is True
