"""The metrics hook and its Prometheus implementation, against a real Redis.

The engine tells the hook of every acquire (wait, outcome), release (hold),
lost lease, cleanup (reclaim, reconcile) and failed heartbeat; the namespace
collector reads its gauges from Redis at scrape time, bounded. Without the
hook the engine never imports prometheus_client. (The worker endpoint, its
pool children included, is tested end to end in e2e/test_metrics_e2e.py.)
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from celery_redislock import ConfigurationError, LockManager, LockTimeout, RedisUnavailable
from celery_redislock.integration.settings import load_config
from celery_redislock.ops.inspector import Inspector
from celery_redislock.ops.prometheus import NamespaceCollector, PrometheusMetrics
from celery_redislock.worker.defer import PARKED_AT_HEADER
from engine_helpers import Managers, wait_until
from redis_server import RedisServer
from test_inspect import NS, dead_owner, queued_waiter


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def managers(redis_url: str, registry: CollectorRegistry) -> Iterator[Managers]:
    made = Managers(redis_url, NS, metrics=PrometheusMetrics(registry))
    yield made
    made.close_all()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sample ``name{labels}``; fails when there is none (a misspelled
    name or label, or a series the hook does not export), never 0."""
    got = registry.get_sample_value(name, labels)
    if got is None:
        known = sorted(
            f"{s.name}{s.labels or ''}" for fam in registry.collect() for s in fam.samples
        )
        raise AssertionError(f"no sample {name}{labels or ''}; the registry has {known}")
    return got


def test_the_sample_reader_fails_on_a_sample_that_does_not_exist(
    registry: CollectorRegistry,
) -> None:
    PrometheusMetrics(registry)
    assert value(registry, "redislock_grants_total") == 0
    for name, labels in [
        ("redislock_grant_total", {}),  # misspelled
        ("redislock_acquire_wait_seconds_count", {"outcome": "timed-out"}),
        ("redislock_acquire_wait_seconds_count", {}),  # a label missing
    ]:
        with pytest.raises(AssertionError, match="no sample"):
            value(registry, name, **labels)


def test_every_label_value_is_exported_at_zero_before_its_first_event(
    registry: CollectorRegistry,
) -> None:
    PrometheusMetrics(registry)
    for outcome in ("granted", "timeout", "error"):
        assert value(registry, "redislock_acquire_wait_seconds_count", outcome=outcome) == 0
    for cause in ("expired", "redis_lost", "declared_dead", "operator", "unknown"):
        assert value(registry, "redislock_leases_lost_total", cause=cause) == 0
    for path in ("child", "startup", "reconcile", "reclaim"):
        assert value(registry, "redislock_cleanups_total", path=path) == 0
    assert value(registry, "redislock_parks_total") == 0


def test_acquires_releases_and_timeouts_are_counted_with_their_wait_and_hold(
    managers: Managers, registry: CollectorRegistry
) -> None:
    holder, other = managers(), managers()
    lease = holder.acquire("a", timeout=5)
    with pytest.raises(LockTimeout):
        other.acquire("a", timeout=0)
    with pytest.raises(LockTimeout):
        other.acquire("a", timeout=0.05)
    lease.release()
    other.acquire("a", timeout=5).release()
    assert value(registry, "redislock_grants_total") == 2
    assert value(registry, "redislock_timeouts_total") == 2
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="granted") == 2
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="timeout") == 2
    assert value(registry, "redislock_acquire_wait_seconds_sum", outcome="timeout") >= 0.05
    assert value(registry, "redislock_hold_seconds_count") == 2
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="error") == 0
    assert value(registry, "redislock_parks_total") == 0


def test_an_acquire_that_fails_because_redis_is_unavailable_counts_as_an_error(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    with RedisServer(workdir=tmp_path) as server:
        mgr = LockManager(server.url, NS, owner_ttl=1.0, metrics=PrometheusMetrics(registry))
        try:
            mgr.acquire("a", timeout=5).release()
            server.stop()  # Redis out of reach: the acquire rides it out, then gives up
            with pytest.raises(RedisUnavailable):
                mgr.acquire("b", timeout=0.5)
        finally:
            mgr.close()
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="error") == 1
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="timeout") == 0
    assert value(registry, "redislock_timeouts_total") == 0
    assert value(registry, "redislock_grants_total") == 1


def test_reclaims_and_reconcile_are_counted_by_path(
    managers: Managers, registry: CollectorRegistry, redis_url: str
) -> None:
    dead_owner(redis_url, [(["r1", "r2"], [])])
    dead_owner(redis_url, [(["z"], [])])
    mgr = managers()
    mgr.acquire(["r1", "r2"], timeout=5).release()  # two dead grants taken back
    assert value(registry, "redislock_cleanups_total", path="reclaim") == 2
    report = mgr.reconcile()
    assert report.cleaned == 2  # both dead owners (one with no lock left)
    assert value(registry, "redislock_cleanups_total", path="reconcile") == 2


def test_a_lease_lost_and_a_failed_heartbeat_are_counted(
    registry: CollectorRegistry, tmp_path: object
) -> None:
    hook = PrometheusMetrics(registry)
    with RedisServer(workdir=tmp_path) as server:  # type: ignore[arg-type]
        mgr = LockManager(server.url, NS, owner_ttl=1.0, metrics=hook)
        try:
            lease = mgr.acquire("a", timeout=5)
            server.client().flushall()
            wait_until(lambda: lease.lost, what="the lease lost")
            assert value(registry, "redislock_leases_lost_total", cause="redis_lost") == 1
            mgr.acquire("b", timeout=5)  # a registered owner again: it beats
            server.stop()
            wait_until(
                lambda: value(registry, "redislock_heartbeat_failures_total") >= 1,
                what="a failed heartbeat",
            )
        finally:
            mgr.close()


def test_namespace_gauges_come_from_redis_at_scrape_time(
    managers: Managers, redis_url: str, r: redis.Redis
) -> None:
    dead_owner(redis_url, [(["d1", "d2"], [])])
    holder = managers()
    holder.acquire("busy", timeout=5)
    waiter = queued_waiter(managers(), exclusive=["busy"])
    wait_until(lambda: r.hlen("{t}:waits:" + next(iter(_waiting_owners(r)), "-")), what="queued")
    reg = CollectorRegistry()
    reg.register(NamespaceCollector(LockManager(redis_url, NS, heartbeat=False), min_interval=0))
    assert value(reg, "redislock_namespace_up") == 1
    assert value(reg, "redislock_owners", state="alive") == 2
    assert value(reg, "redislock_owners", state="dead") == 1
    assert value(reg, "redislock_holders") == 3
    assert value(reg, "redislock_dead_owner_locks") == 2
    assert value(reg, "redislock_waiters") == 1
    assert value(reg, "redislock_namespace_truncated") == 0
    capped = CollectorRegistry()
    capped.register(NamespaceCollector(LockManager(redis_url, NS, heartbeat=False), max_owners=1))
    assert value(capped, "redislock_namespace_truncated") == 1
    assert (
        value(capped, "redislock_owners", state="alive")
        + value(capped, "redislock_owners", state="dead")
        == 1
    )
    text = generate_latest(reg).decode()
    assert "# TYPE redislock_owners gauge" in text
    holder.close()
    waiter.join(20)


def test_limited_resources_are_counted_and_labelled_for_the_watched_and_the_busiest(
    managers: Managers, redis_url: str
) -> None:
    """Totals always; per resource (label ``resource``) the watched ones,
    also while free, and the ``limited_top`` busiest of the others."""
    slots = [managers().acquire(limited={"api:a": 3}, timeout=5) for _ in range(2)]
    slots += [managers().acquire(limited={"api:b": 1}, timeout=5)]
    slots += [managers().acquire(limited={f"user:{i}": 2}, timeout=5) for i in range(3)]
    waiter = threading.Thread(
        target=lambda: managers().acquire(limited={"api:b": 1}, timeout=20).release(),
        daemon=True,
    )
    waiter.start()
    inspector = LockManager(redis_url, NS, heartbeat=False)
    try:
        wait_until(
            lambda: Inspector(inspector).status().limited_waiting == 1, what="the waiter queued"
        )
        reg = CollectorRegistry()
        reg.register(
            NamespaceCollector(
                inspector,
                min_interval=0,
                limited_resources=["api:a", "api:idle"],
                limited_top=1,
            )
        )
        assert value(reg, "redislock_limited_resources") == 5
        assert value(reg, "redislock_limited_slots") == 6
        assert value(reg, "redislock_limited_waiters") == 1
        labelled = {
            s.labels["resource"]
            for fam in reg.collect()
            if fam.name == "redislock_limited_resource_slots"
            for s in fam.samples
        }
        # watched (one of them free), then the busiest other (it has a queue)
        assert labelled == {"api:a", "api:idle", "api:b"}
        assert value(reg, "redislock_limited_resource_slots", resource="api:a") == 2
        assert value(reg, "redislock_limited_resource_limit", resource="api:a") == 3
        assert value(reg, "redislock_limited_resource_waiters", resource="api:a") == 0
        assert value(reg, "redislock_limited_resource_slots", resource="api:b") == 1
        assert value(reg, "redislock_limited_resource_waiters", resource="api:b") == 1
        assert value(reg, "redislock_limited_resource_slots", resource="api:idle") == 0
        assert (
            reg.get_sample_value("redislock_limited_resource_limit", {"resource": "api:idle"})
            is None
        )
        # The defaults: no resource watched, the 10 busiest labelled.
        default = CollectorRegistry()
        default.register(NamespaceCollector(inspector, min_interval=0))
        assert value(default, "redislock_limited_resource_slots", resource="user:2") == 1
        none = CollectorRegistry()
        none.register(NamespaceCollector(inspector, min_interval=0, limited_top=0))
        assert value(none, "redislock_limited_slots") == 6
        assert (
            none.get_sample_value("redislock_limited_resource_slots", {"resource": "api:b"}) is None
        )
        with pytest.raises(ConfigurationError):
            NamespaceCollector(inspector, limited_resources="api:a")  # type: ignore[arg-type]
    finally:
        for lease in slots:
            lease.release()
        waiter.join(20)
        inspector.close()


def _waiting_owners(r: redis.Redis) -> list[str]:
    return [k.decode().rsplit(":", 1)[1] for k in r.keys("{t}:waits:*")]


def test_an_unreachable_redis_scrapes_as_namespace_down(free_port: object) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # type: ignore[operator]
    reg = CollectorRegistry()
    reg.register(NamespaceCollector(LockManager(url, NS, heartbeat=False)))
    assert value(reg, "redislock_namespace_up") == 0
    assert reg.get_sample_value("redislock_holders") is None


def test_the_engine_never_imports_prometheus_client_without_the_hook(redis_url: str) -> None:
    code = (
        "import sys, celery_redislock, celery_redislock.integration.bootsteps, celery_redislock.cli\n"
        "from celery_redislock import LockManager\n"
        f"m = LockManager({redis_url!r}, 'noprom')\n"
        "m.acquire('x', timeout=5).release(); m.close()\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("bad", [-1, 65536, "http", 1.5, True])
def test_a_bad_metrics_port_is_refused_naming_the_setting(bad: object) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_config({"redislock_url": "redis://h:1/0", "redislock_metrics_port": bad})
    assert info.value.setting == "redislock_metrics_port" and "1..65535" in str(info.value)


def test_metrics_port_and_address_settings() -> None:
    base = {"redislock_url": "redis://h:1/0"}
    assert load_config(base).metrics_port is None
    assert load_config({**base, "redislock_metrics_port": 0}).metrics_port is None
    cfg = load_config(
        {**base, "redislock_metrics_port": "9808", "redislock_metrics_address": "127.0.0.1"}
    )
    assert (cfg.metrics_port, cfg.metrics_address) == (9808, "127.0.0.1")
    with pytest.raises(ConfigurationError, match="redislock_metrics_address"):
        load_config({**base, "redislock_metrics_address": ""})


def test_the_docs_and_the_sample_dashboard_name_only_metrics_that_exist(
    redis_url: str, managers: Managers, registry: CollectorRegistry
) -> None:
    import json
    import re
    from pathlib import Path

    managers().acquire("doc", timeout=5).release()
    registry.register(NamespaceCollector(LockManager(redis_url, NS, heartbeat=False)))
    names = {s.name for fam in registry.collect() for s in fam.samples}
    names |= {fam.name for fam in registry.collect()}
    names |= {f"{fam.name}_total" for fam in registry.collect() if fam.type == "counter"}
    docs = Path(__file__).resolve().parent.parent / "docs"
    dashboard = json.loads((docs / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"redislock_\w+", e)}
    used |= set(re.findall(r"`(redislock_\w+)`", (docs / "metrics.md").read_text()))
    used -= {"redislock_metrics_port", "redislock_metrics_address", PARKED_AT_HEADER}
    assert used and used <= names, sorted(used - names)


def test_a_parked_task_s_acquire_counts_the_dead_grants_it_reclaims(
    managers: Managers, registry: CollectorRegistry, redis_url: str
) -> None:
    from celery_redislock.worker.defer import park

    dead_owner(redis_url, [(["d1", "d2"], [])])
    mgr = managers()
    req = mgr.request(["d1", "d2"], [])
    message = {"name": "t.task", "args": [], "kwargs": {}, "options": {}}
    got = park(mgr, "t1", req, message, park_ttl=600, grant_ttl=60)
    assert got.outcome == "granted"  # the dead owner's grants were freed for it
    assert value(registry, "redislock_cleanups_total", path="reclaim") == 2
    for lease in got.leases:
        lease.release()


def _message(**extra: object) -> dict[str, object]:
    return {"name": "t.task", "args": [], "kwargs": {}, "options": {}, **extra}


def test_a_parked_task_counts_one_park_and_its_adopted_grant_waited_since_it_parked(
    managers: Managers, registry: CollectorRegistry
) -> None:
    from celery_redislock.worker.defer import adopt, park

    holder, child, adopter = managers(), managers(), managers()
    lease = holder.acquire("p", timeout=5)
    req = child.request(["p"], [])
    parked_at = time.time() - 100  # it parked 100 s before its grant is adopted
    message = _message(parked_at=parked_at)
    assert park(child, "t1", req, message, park_ttl=600, grant_ttl=60).outcome == "parked"
    assert value(registry, "redislock_parks_total") == 1
    assert value(registry, "redislock_timeouts_total") == 0  # a park is no timeout
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="timeout") == 0
    lease.release()  # handed to the parked request
    outcome, leases = adopt(adopter, "t1", 0, parked_at=parked_at)
    assert outcome == "adopted" and len(leases) == 1
    # Two grants made (the holder's, the adopted one), two counted, each with its wait.
    assert value(registry, "redislock_grants_total") == 2
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="granted") == 2
    bucket = "redislock_acquire_wait_seconds_bucket"
    assert value(registry, bucket, outcome="granted", le="60.0") == 1  # the holder's
    assert value(registry, bucket, outcome="granted", le="300.0") == 2  # + 100 s parked
    assert value(registry, "redislock_acquire_wait_seconds_sum", outcome="granted") >= 100
    leases[0].release()

    # Free when it parks: granted and adopted at once, no park.
    got = park(child, "t2", req, _message(), park_ttl=600, grant_ttl=60)
    assert got.outcome == "granted" and len(got.leases) == 1
    assert value(registry, "redislock_parks_total") == 1
    assert value(registry, "redislock_grants_total") == 3
    assert value(registry, bucket, outcome="granted", le="60.0") == 2
    got.leases[0].release()


def test_a_parked_task_whose_time_runs_out_counts_as_a_timeout(
    managers: Managers, registry: CollectorRegistry, redis_url: str
) -> None:
    from celery_redislock.worker.defer import Dispatcher, park

    holder, child = managers(), managers()
    lease = holder.acquire("p", timeout=5)
    req = child.request(["p"], [])
    parked = park(child, "t1", req, _message(park_ttl=0.3), park_ttl=0.3, grant_ttl=60)
    assert parked.outcome == "parked"
    withdrawn: list[str] = []
    dispatcher = Dispatcher(
        child,  # the worker's manager: the dispatcher reports to its hook
        "inc1",
        publish=lambda *a: None,
        on_withdrawn=lambda tid, why, msg: withdrawn.append(why),
    )
    probe = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: not probe.exists(f"{{{NS}}}:alive:defer:t1"), what="park TTL ran out")
        wait_until(lambda: dispatcher.upkeep() or withdrawn, what="the upkeep to withdraw it")
    finally:
        probe.close()
        dispatcher.manager.close()
    assert withdrawn == ["expired"]
    assert value(registry, "redislock_timeouts_total") == 1
    assert value(registry, "redislock_acquire_wait_seconds_count", outcome="timeout") == 1
    assert value(registry, "redislock_parks_total") == 1
    assert value(registry, "redislock_grants_total") == 1  # the holder's only
    lease.release()
