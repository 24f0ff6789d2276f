"""The engine under eventlet: green threads queue FIFO without overlap, and
the heartbeat is a real OS thread that a blocked hub cannot starve."""

from __future__ import annotations

import green_helpers

run = green_helpers.green_runner("eventlet")


def test_green_threads_are_served_in_arrival_order_without_overlap(redis_url: str) -> None:
    green_helpers.assert_served_in_arrival_order_without_overlap(run(redis_url, "contention"))


def test_heartbeat_keeps_liveness_while_the_eventlet_hub_is_blocked(redis_url: str) -> None:
    green_helpers.assert_heartbeat_outlived_the_blocked_hub(run(redis_url, "blocked_hub"))


def test_green_threads_waiting_for_slots_of_a_limited_resource_never_exceed_it_and_go_in_order(
    redis_url: str,
) -> None:
    green_helpers.assert_limited_slots_kept_and_served_in_order(run(redis_url, "limited"))
