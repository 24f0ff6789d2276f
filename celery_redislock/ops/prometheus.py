"""Prometheus metrics (the ``celery-redislock[prometheus]`` extra).

Importing this module imports :mod:`prometheus_client`; nothing else in the
package does. Two parts:

* :class:`PrometheusMetrics`, the engine hook (:mod:`celery_redislock.engine.metrics`):
  counters and histograms recorded in the process that does the work.
  Pass it to a :class:`~celery_redislock.LockManager` (``metrics=``) outside
  Celery; a worker with ``redislock_metrics_port`` sets it up itself.
* :class:`NamespaceCollector`: gauges of the whole namespace (owners alive
  and dead, registered locks, queued requests, limited resources' slots)
  read from Redis at scrape
  time, with the same bounded walk as ``redislock status`` (SSCAN of the
  active-owners set in batches, never SCAN/KEYS), at most ``max_owners``
  owners per scrape.

In a prefork worker (:func:`start_worker_metrics`) the main process, before
the pool forks, points prometheus_client's multiprocess mode at a directory
of its own (``PROMETHEUS_MULTIPROC_DIR``; default
``<tmp>/celery-redislock-metrics/<nodename>``), empties it, and serves one
endpoint that adds up the files every process (pool children included,
dead ones too) writes there.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from .. import _validate as _v
from ..engine.manager import LockManager
from ..engine.metrics import CLEANUP_PATHS, LOST_CAUSE_LABELS, OUTCOMES
from ..exceptions import ConfigurationError
from ..protocol.keys import validate_resource
from ..store.connect import clone_client
from .inspector import Inspector, LimitedInfo, Status

log = logging.getLogger("celery_redislock.metrics")

#: Buckets (seconds) of both histograms: from a free lock's one round trip
#: to hour-long holds.
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
#: Most owners the namespace gauges read per scrape (batches of 500).
DEFAULT_MAX_OWNERS = 10_000
#: Scrapes within this many seconds reuse the last namespace reading.
DEFAULT_MIN_INTERVAL = 5.0
#: Most limited resources given series of their own (label ``resource``)
#: besides those the collector is told to watch: the busiest.
DEFAULT_LIMITED_TOP = 10


class PrometheusMetrics:
    """The engine hook, as Prometheus counters and histograms.

    Args:
        registry: where the metrics are registered (default: prometheus_client's
            global registry). In multiprocess mode the values live in files
            and the registry only names them.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        self.wait = Histogram(
            "redislock_acquire_wait_seconds",
            "Seconds an acquire took, by outcome (granted, timeout, error).",
            ["outcome"],
            buckets=BUCKETS,
            **kw,
        )
        self.hold = Histogram(
            "redislock_hold_seconds",
            "Seconds a lease was held, from its grant to its release.",
            buckets=BUCKETS,
            **kw,
        )
        self.grants = Counter("redislock_grants", "Acquires granted.", **kw)
        self.timeouts = Counter(
            "redislock_timeouts", "Acquires that timed out (LockTimeout).", **kw
        )
        self.lost = Counter(
            "redislock_leases_lost",
            "Leases marked lost, by where the loss was found.",
            ["cause"],
            **kw,
        )
        self.cleanups = Counter(
            "redislock_cleanups",
            "Owners freed by a cleanup path (reclaim: dead holders' grants taken back "
            "by an acquire).",
            ["path"],
            **kw,
        )
        self.heartbeat_failures = Counter(
            "redislock_heartbeat_failures", "Heartbeats that failed (Redis unreachable...).", **kw
        )
        self.parks = Counter(
            "redislock_parks",
            "Deferred tasks parked (on_busy='defer' found their resources busy).",
            **kw,
        )
        # Every known label value is exported from the start (at 0): a
        # series that appears only with its first event hides it from rate()
        # and increase(), and an alert on it cannot tell 0 from missing.
        for outcome in OUTCOMES:
            self.wait.labels(outcome)
        for cause in (*LOST_CAUSE_LABELS.values(), "unknown"):
            self.lost.labels(cause)
        for path in CLEANUP_PATHS:
            self.cleanups.labels(path)

    def acquired(self, wait_seconds: float, outcome: str) -> None:
        self.wait.labels(outcome).observe(max(0.0, wait_seconds))
        if outcome == "granted":
            self.grants.inc()
        elif outcome == "timeout":
            self.timeouts.inc()

    def held(self, seconds: float) -> None:
        self.hold.observe(max(0.0, seconds))

    def lease_lost(self, cause: str, count: int = 1) -> None:
        self.lost.labels(cause).inc(count)

    def cleaned(self, path: str, count: int = 1) -> None:
        self.cleanups.labels(path).inc(count)

    def heartbeat_failed(self) -> None:
        self.heartbeat_failures.inc()

    def parked(self, count: int = 1) -> None:
        self.parks.inc(count)


class NamespaceCollector(Collector):
    """Gauges of one namespace, read from Redis at scrape time.

    ``redislock_owners{state="alive"|"dead"}``, ``redislock_holders``
    (registered locks; a lock shared by two owners counts twice),
    ``redislock_dead_owner_locks``, ``redislock_waiters`` (queued requests),
    ``redislock_namespace_truncated`` (1 when more than ``max_owners``
    owners exist: the others are not counted) and ``redislock_namespace_up``
    (0 when Redis could not be read; the other gauges are then absent).

    Limited resources (``limited={name: N}``): ``redislock_limited_resources``,
    ``redislock_limited_slots`` and ``redislock_limited_waiters`` count them
    all; ``redislock_limited_resource_slots``, ``..._waiters`` and
    ``..._limit`` (label ``resource``) describe each of ``limited_resources``
    (always exported, at 0 while free) and the ``limited_top`` busiest of
    the others (most requests queued, then most slots held), so the number
    of series stays bounded whatever names the tasks use (docs/metrics.md).

    Cost per scrape: O(owners read + resources they hold), in pipelines of
    500 commands, never a SCAN; scrapes within ``min_interval`` seconds
    reuse the last reading.
    """

    def __init__(
        self,
        manager: LockManager,
        *,
        max_owners: int = DEFAULT_MAX_OWNERS,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        limited_resources: Sequence[str] = (),
        limited_top: int = DEFAULT_LIMITED_TOP,
    ) -> None:
        if isinstance(limited_resources, str):
            raise ConfigurationError(
                "limited_resources",
                f"must be a sequence of resource names, not the str {limited_resources!r}",
            )
        self.manager = manager
        self.max_owners = max_owners
        self.min_interval = min_interval
        self.limited_resources = tuple(
            dict.fromkeys(validate_resource(r) for r in limited_resources)
        )
        self.limited_top = _v.integer("limited_top", limited_top, minimum=0, maximum=1000)
        self._lock = threading.Lock()
        self._last: tuple[float, list[Metric]] | None = None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self.min_interval:
                self._last = (now, self._read())
            return iter(self._last[1])

    def _read(self) -> list[Metric]:
        up = GaugeMetricFamily(
            "redislock_namespace_up", "1 when the namespace gauges could be read from Redis."
        )
        try:
            summary = Inspector(self.manager).summary(max_owners=self.max_owners)
        except Exception as exc:  # a scrape must answer, Redis down or not
            log.warning(
                "metrics.namespace-error namespace=%s error=%s", self.manager.namespace, exc
            )
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        st = summary.status
        owners = GaugeMetricFamily(
            "redislock_owners", "Owners in the active-owners set, by liveness.", labels=["state"]
        )
        owners.add_metric(["alive"], st.alive_owners)
        owners.add_metric(["dead"], st.dead_owners)
        return [
            up,
            owners,
            GaugeMetricFamily(
                "redislock_holders",
                "Locks registered by owners (a shared lock counts once per holder).",
                value=st.registered_locks,
            ),
            GaugeMetricFamily(
                "redislock_dead_owner_locks",
                "Locks registered by dead owners (what reconcile would free).",
                value=st.dead_owner_locks,
            ),
            GaugeMetricFamily(
                "redislock_waiters", "Requests queued for locks.", value=st.waiting_requests
            ),
            GaugeMetricFamily(
                "redislock_namespace_truncated",
                "1 when the owners read were capped at the scrape's limit.",
                value=1 if st.truncated else 0,
            ),
            *self._limited(st, summary.limited),
        ]

    def _limited(self, st: Status, found: Sequence[LimitedInfo]) -> list[Metric]:
        """The limited resources' gauges: totals, then per resource (bounded)."""
        slots = GaugeMetricFamily(
            "redislock_limited_resource_slots",
            "Slots held of a limited resource (watched, or among the busiest).",
            labels=["resource"],
        )
        waiters = GaugeMetricFamily(
            "redislock_limited_resource_waiters",
            "Requests queued for a slot of a limited resource (watched, or among the busiest).",
            labels=["resource"],
        )
        limit = GaugeMetricFamily(
            "redislock_limited_resource_limit",
            "The limit of a limited resource: what its most recent slot's request asked for.",
            labels=["resource"],
        )
        by_name = {x.resource: x for x in found}
        shown = [
            by_name.get(name, LimitedInfo(name, 0, None, (), 0)) for name in self.limited_resources
        ]
        watched = set(self.limited_resources)
        shown += [x for x in found if x.resource not in watched][: self.limited_top]
        for x in shown:
            slots.add_metric([x.resource], x.slots)
            waiters.add_metric([x.resource], x.waiting)
            if x.limit is not None:
                limit.add_metric([x.resource], x.limit)
        return [
            GaugeMetricFamily(
                "redislock_limited_resources",
                "Limited resources held or waited for.",
                value=st.limited_resources,
            ),
            GaugeMetricFamily(
                "redislock_limited_slots",
                "Slots held of all limited resources.",
                value=st.limited_slots,
            ),
            GaugeMetricFamily(
                "redislock_limited_waiters",
                "Requests queued for a slot of a limited resource.",
                value=st.limited_waiting,
            ),
            slots,
            waiters,
            limit,
        ]


# ---------------------------------------------------------------- worker


def default_directory(nodename: str) -> Path:
    """``<tmp>/celery-redislock-metrics/<nodename>`` (unsafe characters replaced)."""
    safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", nodename)
    return Path(tempfile.gettempdir()) / "celery-redislock-metrics" / safe


def prepare_multiprocess_directory(path: Path) -> Path:
    """Create ``path``, remove the ``*.db`` files a previous run left, and
    switch prometheus_client to multiprocess mode there (this process and
    every process forked from it). Call before the pool forks."""
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.db"):
        old.unlink(missing_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    if not getattr(values.ValueClass, "_multiprocess", False):
        # prometheus_client chose its value class when first imported; metrics
        # made from now on (ours) are backed by the directory's files.
        values.ValueClass = values.MultiProcessValue()
    return path


class WorkerMetrics:
    """The metrics of one worker: the hook, its directory and the endpoint."""

    def __init__(self, manager: LockManager, nodename: str, port: int, address: str) -> None:
        self.port = port
        self.address = address
        self.directory = prepare_multiprocess_directory(default_directory(nodename))
        # A registry of its own (not the global one): in multiprocess mode the
        # values live in the directory's files, and a second worker started
        # in one process (tests) must not register the names twice.
        self.hook = PrometheusMetrics(CollectorRegistry())
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=str(self.directory))
        self._manager = LockManager(
            clone_client(manager.client),
            manager.namespace,
            owner_ttl=manager.owner_ttl,
            heartbeat=False,
            name="metrics",
            eviction_check="ignore",
        )
        self.registry.register(NamespaceCollector(self._manager))
        self._server: Any = None

    def serve(self) -> None:
        """Start the HTTP endpoint (a daemon thread of the main process)."""
        from prometheus_client import start_http_server

        started = start_http_server(self.port, self.address, registry=self.registry)
        # (server, thread) since prometheus_client 0.17; None before
        self._server = started[0] if isinstance(started, tuple) else None
        log.info(
            "metrics.serving address=%s port=%d directory=%s",
            self.address or "0.0.0.0",
            self.port,
            self.directory,
        )

    def close(self) -> None:
        """Stop the endpoint (the files stay until the next start)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._manager.close()
