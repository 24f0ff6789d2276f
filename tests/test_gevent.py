"""The engine under gevent: greenlets are waiters of their own, a killed
greenlet leaves the queue, and the heartbeat is a real OS thread."""

from __future__ import annotations

import green_helpers

run = green_helpers.green_runner("gevent")


def test_greenlets_are_served_in_arrival_order_without_overlap(redis_url: str) -> None:
    green_helpers.assert_served_in_arrival_order_without_overlap(run(redis_url, "contention"))


def test_killed_waiting_greenlet_leaves_no_queue_entry(redis_url: str) -> None:
    out = run(redis_url, "kill_waiter")
    assert out["errors"] == []
    assert out["queued_after_kill"] == 0
    assert out["lock_exists"] == 0


def test_heartbeat_keeps_liveness_while_the_hub_is_blocked(redis_url: str) -> None:
    # The hub is blocked for 2.5x owner_ttl: a greenlet heartbeat would starve
    # and the lease would be lost; a real OS thread keeps it.
    green_helpers.assert_heartbeat_outlived_the_blocked_hub(run(redis_url, "blocked_hub"))


def test_reentrancy_is_per_greenlet_and_a_kill_inside_the_inner_block_is_safe(
    redis_url: str,
) -> None:
    out = run(redis_url, "reentrant")
    assert out["same_fence"] is True
    assert out["sibling"] == "timeout"  # another greenlet queues, it does not re-enter
    assert out["g4_held"] == 1
    assert out["g4_after"] == 0
    assert out["g5_after_kill"] == 0


def test_greenlets_waiting_for_slots_of_a_limited_resource_never_exceed_it_and_go_in_order(
    redis_url: str,
) -> None:
    green_helpers.assert_limited_slots_kept_and_served_in_order(run(redis_url, "limited"))
