"""End-to-end: the Prometheus endpoint of a real ``celery worker -P prefork``.

One worker (two pool children) with ``redislock_metrics_port``: while and
after tasks run, its one endpoint adds up what every process recorded (the
pool children's acquires and releases, a SIGKILLed child's counts, the main
process's cleanup of that child) and reads the namespace gauges from Redis.
The counts must match the tasks run. A stale file of an earlier run in the
worker's multiprocess directory is removed at start (it would add 100
grants).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import Cluster, Worker, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

_STALE = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from prometheus_client import Counter
Counter("redislock_grants", "stale").inc(100)
"""


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name{labels}``; fails when the endpoint has none (never 0)."""
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {name}{labels or ''} in the scrape: {sorted(samples)}"
    return samples[key]


def _after_releases(port: int, w: Worker, releases: int, what: str) -> Samples:
    """Scrape ``port`` until ``releases`` holds were counted (released)."""

    def counted() -> Samples | None:
        s = scrape(port)
        return s if get(s, "redislock_hold_seconds_count") >= releases else None

    return wait_for(counted, 60, what, on_timeout=w.tail)


def _assert_outcomes(samples: Samples, grants: int, timeouts: int) -> None:
    """``grants`` grants (each a granted wait), ``timeouts`` timeouts, no error."""
    assert get(samples, "redislock_grants_total") == grants, samples
    assert get(samples, "redislock_acquire_wait_seconds_count", outcome="granted") == grants
    assert get(samples, "redislock_timeouts_total") == timeouts
    assert get(samples, "redislock_acquire_wait_seconds_count", outcome="error") == 0


def test_one_endpoint_counts_what_every_pool_process_did_and_reads_the_namespace(
    cluster: Callable[..., Cluster], free_port: Callable[[], int], tmp_path: Path
) -> None:
    port = free_port()
    c = cluster(heartbeat=1, owner_ttl=6, metrics_port=port)
    directory = tmp_path / "celery-redislock-metrics" / "metrics@e2e"
    directory.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", _STALE, str(directory)], check=True, timeout=60)
    assert list(directory.glob("counter_*.db"))
    w = c.start_worker("metrics", concurrency=2, env={"TMPDIR": str(tmp_path)})

    writes = [c.send("write", "m", 0.001) for _ in range(6)]
    assert sorted(r.get(timeout=120) for r in writes) == [1, 2, 3, 4, 5, 6]
    hold = c.send("hold", "h", "m1", 1)  # the redelivery (attempt 2) does not block
    held = c.wait_held("m1")
    assert c.send("try_take", "res:h").get(timeout=60) is False  # a timeout

    during = scrape(port)
    assert get(during, "redislock_namespace_up") == 1
    assert get(during, "redislock_holders") == 1  # res:h
    assert get(during, "redislock_owners", state="alive") >= 1
    assert get(during, "redislock_owners", state="dead") == 0
    assert get(during, "redislock_waiters") == 0

    os.kill(held["pid"], signal.SIGKILL)  # the worker frees the dead child's lock
    c.wait_held("m1", attempt=2)
    assert hold.get(timeout=120)["attempt"] == 2

    after = _after_releases(port, w, 7, "the last release to be counted")
    # 6 writes + hold (killed) + hold (redelivered); try_take timed out
    _assert_outcomes(after, grants=8, timeouts=1)
    assert get(after, "redislock_acquire_wait_seconds_count", outcome="timeout") == 1
    # released: the 6 writes and the redelivered hold (the killed one never was)
    assert get(after, "redislock_hold_seconds_count") == 7
    assert get(after, "redislock_cleanups_total", path="child") == 1
    assert get(after, "redislock_heartbeat_failures_total") == 0
    # the gauges follow Redis (a reading is reused for up to 5 s)
    wait_for(lambda: get(scrape(port), "redislock_holders") == 0, 30, "res:h free in the gauges")
    # every pool process wrote its own file: the killed child's counts are kept
    assert len(list(directory.glob("histogram_*.db"))) >= 2
    assert w.log_lines("metrics.serving", str(port)), w.tail()

    # Deferred tasks: a park is no timeout; the grant a parked task adopts
    # is a grant; a park whose time runs out (timeout=1) is a timeout.
    assert get(after, "redislock_parks_total") == 0
    blocker = c.send("hold", "d", "m2")
    c.wait_held("m2")
    deferred = c.send("dwrite", "d", "m3")
    short = c.send("dshort1", "d", "m4")
    wait_for(lambda: short.state == "FAILURE", 60, "the short park to run out", on_timeout=w.tail)
    assert deferred.state == "DEFERRED" and not c.data.get("e2e:runs:m4")
    parked = scrape(port)
    assert get(parked, "redislock_parks_total") == 2
    assert get(parked, "redislock_timeouts_total") == 2  # try_take, and the short park
    assert get(parked, "redislock_acquire_wait_seconds_count", outcome="timeout") == 2
    c.go("m2")
    assert blocker.get(timeout=60)["attempt"] == 1
    assert deferred.get(timeout=60)["owner"]

    end = _after_releases(port, w, 9, "the deferred task's release to be counted")
    # 8 before, the blocker and the adopted grant of the deferred task
    _assert_outcomes(end, grants=10, timeouts=2)
    assert get(end, "redislock_parks_total") == 2
    # The adopted grant's wait runs from its park, which came before the short
    # task parked and ran out of its 1 s: at least that much was added.
    wait_sum = "redislock_acquire_wait_seconds_sum"
    assert get(end, wait_sum, outcome="granted") - get(after, wait_sum, outcome="granted") >= 1
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.tail()
