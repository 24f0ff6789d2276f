"""The engine under gevent: greenlets are waiters of their own, a killed
greenlet leaves the queue, and the heartbeat is a real OS thread."""

from __future__ import annotations

import importlib.util

import pytest

from engine_helpers import run_scenario

# Only look for it: importing gevent here would hook fork() in the test process.
if importlib.util.find_spec("gevent") is None:
    pytest.skip("gevent is not installed", allow_module_level=True)


def run(redis_url: str, scenario: str) -> dict:
    return run_scenario("gevent_engine.py", redis_url, scenario)


def test_greenlets_are_served_in_arrival_order_without_overlap(redis_url: str) -> None:
    out = run(redis_url, "contention")
    assert out["overlaps"] == 0
    assert out["order"] == list(range(6))


def test_killed_waiting_greenlet_leaves_no_queue_entry(redis_url: str) -> None:
    out = run(redis_url, "kill_waiter")
    assert out["errors"] == []
    assert out["queued_after_kill"] == 0
    assert out["lock_exists"] == 0


def test_heartbeat_keeps_liveness_while_the_hub_is_blocked(redis_url: str) -> None:
    # The hub is blocked for 2.5x owner_ttl: a greenlet heartbeat would starve
    # and the lease would be lost; a real OS thread keeps it.
    out = run(redis_url, "blocked_hub")
    assert out["ticks"] >= 2
    assert out["lost"] is False
    assert out["held"] is True


def test_reentrancy_is_per_greenlet_and_a_kill_inside_the_inner_block_is_safe(
    redis_url: str,
) -> None:
    out = run(redis_url, "reentrant")
    assert out["same_fence"] is True
    assert out["sibling"] == "timeout"  # another greenlet queues, it does not re-enter
    assert out["g4_held"] == 1
    assert out["g4_after"] == 0
    assert out["g5_after_kill"] == 0
