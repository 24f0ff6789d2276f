"""End-to-end: ``@locked(limited={"api:{partner}": 2})`` with real ``celery worker -P prefork``.

Pinned here (tasks in :mod:`e2e.proj`, ``lim_*``: each body counts itself
in and out of ``api:<partner>`` in Redis, keeping the peak):

- eight waiting tasks on one partner on a ``-c 4`` worker: at most two
  bodies at once, never three, and two at some point;
- ``on_busy="defer"``: while two hold the partner's slots, six more are
  parked (``DEFERRED``) in line without pool slots (two unrelated tasks
  hold the other two slots meanwhile), are granted in arrival order (their
  fences rise in send order) and run two at a time;
- ``raise``, ``skip`` and ``retry`` while the slots are taken: LockTimeout,
  None, and retries until a slot is free;
- a SIGKILLed pool child holding a slot: its slot goes to the next waiting
  task within a node tick (owner TTL 60 s); the worker SIGKILLed and
  started again under its name frees its predecessor's slots at start-up;
  once every holder is gone and reconcile ran, no key of the resource is
  left.

The tests that kill nothing share one worker (module fixture).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_redislock import LockTimeout
from redis_server import RedisServer

from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def shared(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One prefork worker (-c 4) for the tests that kill nothing."""
    c = Cluster(redis_server.url, tmp_path_factory.mktemp("limited"), owner_ttl=30, heartbeat=0.5)
    try:
        c.start_worker("lim-shared", concurrency=4)
        yield c
    finally:
        c.close()


def _peak(c: Cluster, partner: str) -> int:
    return int(c.data.get(f"e2e:lim-peak:{partner}") or 0)


def _log(c: Cluster, tag: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.data.lrange(f"e2e:held-log:{tag}", 0, -1)]


def _holding(c: Cluster, task: str, partner: str, tag: str) -> Any:
    """Send ``task`` (blocking) on ``partner`` as ``tag``; return once its body runs."""
    result = c.send(task, partner, tag, True)
    wait_for(lambda: _log(c, tag), 60, f"{tag} to hold a slot", on_timeout=c.report)
    return result


def _slots(c: Cluster, partner: str) -> dict[str, str]:
    return c.lock_holders(f"api:{partner}")


def test_eight_waiting_tasks_limited_to_two_run_at_most_two_at_once(shared: Cluster) -> None:
    c = shared
    results = [c.send("lim_wait", "w", f"w{i}", False, 0.3) for i in range(8)]
    infos = [r.get(timeout=90) for r in results]
    assert _peak(c, "w") == 2  # two at once, never three
    assert c.data.get("e2e:lim-in:w") == "0"
    assert all(info["limited"] == {"api:w": 2} for info in infos)
    assert sorted(c.data.lrange("e2e:order:w", 0, -1)) == sorted(f"w{i}" for i in range(8))
    wait_for(lambda: not _slots(c, "w"), 10, "the slots to be free", on_timeout=c.report)


def test_deferred_tasks_wait_for_a_slot_in_line_without_a_pool_slot(shared: Cluster) -> None:
    c = shared
    holders = [_holding(c, "lim_defer", "d", f"dh{i}") for i in range(2)]
    assert sorted(_slots(c, "d").values()) == ["l", "l"]
    parked = []
    for i in range(6):
        result = c.send("lim_defer", "d", f"dp{i}", False, 0.2)
        wait_for(lambda r=result: r.state == "DEFERRED", 60, f"dp{i} parked", on_timeout=c.report)
        parked.append(result)
    queue = [str(m) for m in c.lock_redis.zrange(c.key("q", "api:d"), 0, -1)]
    assert len(queue) == 6 and all(m.startswith("ldefer:") for m in queue), queue
    # Two slots of the -c 4 pool hold the partner's slots; the parked six
    # hold none: two unrelated tasks take the other two pool slots together.
    others = [c.send("dhold", f"free{i}", f"free{i}") for i in range(2)]
    for i in range(2):
        c.wait_logged(f"e2e:held-log:free{i}", 1, f"unrelated task free{i} running")
    assert all(r.state == "DEFERRED" for r in parked)
    assert _peak(c, "d") == 2
    for i in range(2):
        c.go(f"free{i}")
        c.go(f"dh{i}")
    infos = [r.get(timeout=90) for r in holders + parked]
    for r in others:
        r.get(timeout=30)
    assert _peak(c, "d") == 2 and c.data.get("e2e:lim-in:d") == "0"
    # Granted first come, first served: the fences rise in arrival order.
    fences = [info["fence"] for info in infos[2:]]
    assert fences == sorted(fences) and len(set(fences)) == 6, fences
    assert all(info["limited"] == {"api:d": 2} for info in infos)
    assert all(info["attempt"] == 1 for info in infos)  # each ran once
    wait_for(lambda: not _slots(c, "d"), 10, "the slots to be free", on_timeout=c.report)
    assert not c.lock_redis.exists(c.key("q", "api:d"))


def test_raise_skip_and_retry_try_once_while_the_slots_are_taken(shared: Cluster) -> None:
    c = shared
    holders = [_holding(c, "lim_wait", "m", f"mh{i}") for i in range(2)]
    with pytest.raises(LockTimeout):
        c.send("lim_raise", "m", "mr").get(timeout=60)
    assert c.send("lim_skip", "m", "ms").get(timeout=60) is None
    retried = c.send("lim_retry", "m", "mt")
    wait_for(lambda: retried.state == "RETRY", 60, "the retry", on_timeout=c.report)
    assert not _log(c, "mr") and not _log(c, "ms") and not _log(c, "mt")
    c.go("mh0")
    assert retried.get(timeout=60)["limited"] == {"api:m": 2}
    c.go("mh1")
    for r in holders:
        r.get(timeout=30)
    assert _peak(c, "m") == 2
    # With a slot free, each mode runs its body.
    assert c.send("lim_raise", "m", "mr2").get(timeout=60)["limited"] == {"api:m": 2}
    assert c.send("lim_skip", "m", "ms2").get(timeout=60)["limited"] == {"api:m": 2}
    wait_for(lambda: not _slots(c, "m"), 10, "the slots to be free", on_timeout=c.report)


def test_slots_of_a_killed_child_and_of_a_killed_worker_are_freed_long_before_their_ttl(
    cluster: Callable[..., Cluster],
) -> None:
    # owner_ttl 60 s: only the worker's own clean-ups can free the slots in time.
    c = cluster(owner_ttl=60, heartbeat=1)
    w = c.start_worker("lim-crash", concurrency=3)
    for i in range(2):
        _holding(c, "lim_wait", "k", f"k{i}")
    first = _log(c, "k0")[0]
    waiting = c.send("lim_wait", "k", "k2", True)
    wait_for(
        lambda: c.lock_redis.zcard(c.key("q", "api:k")) == 1,
        30,
        "k2 to wait for a slot",
        on_timeout=c.report,
    )

    killed_at = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    c.wait_logged("e2e:held-log:k2", 1, "k2 to get the dead child's slot", timeout=30)
    took = time.monotonic() - killed_at
    print(f"the dead child's slot went to the next task after {took:.2f}s")
    assert took < 10, f"granted after {took:.1f}s"  # a node tick (1 s), not the TTL
    assert first["owner"] not in c.owners_holding("api:k")
    assert not c.lock_redis.exists(c.key("held", first["owner"]))
    assert not waiting.ready()

    # The whole worker dies holding both slots; started again under its
    # name it frees its predecessor's slots at start-up.
    owners = c.owners_holding("api:k")
    assert len(owners) == 2
    w.destroy()
    killed_at = time.monotonic()
    w2 = c.start_worker("lim-crash", concurrency=3)
    for owner in owners:
        c.wait_freed(owner, "api:k", "the predecessor's slots to be freed at start-up", 45)
    print(f"the predecessor's slots were freed {time.monotonic() - killed_at:.2f}s after the kill")
    assert time.monotonic() - killed_at < 40  # the liveness TTL is 60 s

    # Usable again; once every holder is gone and reconcile ran, no key of
    # the resource is left.
    again = c.send("lim_wait", "k", "k3", queue=w2.queue)
    assert again.get(timeout=60)["limited"] == {"api:k": 2}
    wait_for(lambda: not _slots(c, "k"), 20, "the slots to be free", on_timeout=c.report)
    report = c.producer.send_task("celery_redislock.reconcile", queue=w2.queue).get(timeout=60)
    assert report["skipped"] is False
    left = sorted(str(k) for k in c.lock_redis.keys("*api:k*"))
    assert left == [], left
