"""The engine under eventlet: green threads queue FIFO without overlap, and
the heartbeat is a real OS thread that a blocked hub cannot starve."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Only look for it: importing eventlet here would hook fork() in the test process.
if importlib.util.find_spec("eventlet") is None:
    pytest.skip("eventlet is not installed", allow_module_level=True)

SCRIPT = Path(__file__).parent / "scripts" / "eventlet_engine.py"


def run(redis_url: str, scenario: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), redis_url, scenario],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_green_threads_are_served_in_arrival_order_without_overlap(redis_url: str) -> None:
    out = run(redis_url, "contention")
    assert out["overlaps"] == 0
    assert out["order"] == list(range(6))


def test_heartbeat_keeps_liveness_while_the_eventlet_hub_is_blocked(redis_url: str) -> None:
    out = run(redis_url, "blocked_hub")
    assert out["ticks"] >= 2
    assert out["lost"] is False
    assert out["held"] is True
