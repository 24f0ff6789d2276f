"""The worker bootstep: one incarnation of the node, from start to release.

See docs/worker.md for the order of Celery's start and shutdown and the
races this step handles.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from celery import bootsteps, signals
from celery.platforms import EX_UNAVAILABLE

from ..exceptions import ConfigurationError, FormatMismatch, RedisUnavailable
from ..worker.node import Node, new_incarnation
from .app import RedisLock
from .settings import EX_CONFIG

log = logging.getLogger("celery_redislock.worker")

#: Exit code of a worker that fenced itself after being evicted (EX_SOFTWARE).
EX_EVICTED = 70


#: Marks our wrapper of the billiard pool's ``on_process_down``.
_HOOK_MARK = "_celery_redislock_hook"


def _prefork_pool(w: Any) -> Any:
    """The billiard pool inside a prefork TaskPool (None for other pools)."""
    pool = getattr(w, "pool", None)
    if pool is None:
        return None
    try:
        from celery.concurrency.prefork import TaskPool as PreforkPool
    except ImportError:  # pragma: no cover - billiard missing
        return None
    if not isinstance(pool, PreforkPool):
        return None
    return getattr(pool, "_pool", None)


def pool_pids(w: Any) -> list[int]:
    """Pids of the prefork pool's child processes ([] for other pools).

    With threads, solo, gevent and eventlet pools, tasks run in the main
    process, which is always live.
    """
    procs = getattr(_prefork_pool(w), "_pool", None) or []
    return [int(p.pid) for p in list(procs) if getattr(p, "pid", None)]


def _worker_metrics(mgr: Any, nodename: str, cfg: Any) -> Any:
    """The worker's Prometheus metrics (``celery_redislock.ops.prometheus``)."""
    try:
        from ..ops.prometheus import WorkerMetrics
    except ImportError as exc:
        raise ConfigurationError(
            "redislock_metrics_port",
            f"needs prometheus_client ({exc}): pip install 'celery-redislock[prometheus]'",
        ) from exc
    return WorkerMetrics(mgr, nodename, cfg.metrics_port, cfg.metrics_address)


class _Publisher:
    """Publishes deferred tasks from the dispatcher thread, on a broker
    connection of its own (never shared with the worker's event loop)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._conn: Any = None

    def __call__(self, task_id: str, message: dict[str, Any], header: str | None) -> None:
        from ..worker.defer import HEADER, PARKED_AT_HEADER

        opts = dict(message.get("options") or {})
        headers = {HEADER: header} if header is not None else {}
        if header is not None and message.get("parked_at") is not None:
            headers[PARKED_AT_HEADER] = str(message["parked_at"])  # the grant's wait (metrics)
        if self._conn is None:
            self._conn = self.app.connection_for_write()
        try:
            self.app.send_task(
                message["name"],
                args=message.get("args") or [],
                kwargs=message.get("kwargs") or {},
                task_id=task_id,
                headers=headers,
                connection=self._conn,
                add_to_parent=False,
                **opts,
            )
        except Exception:
            conn, self._conn = self._conn, None
            try:
                conn.release()
            except Exception:
                pass
            raise


def _withdrawn_request(app: Any, task_id: str, message: dict[str, Any]) -> Any:
    """The request context of a deferred task taken out of line, rebuilt from
    its park message: what the result backend needs to call its errbacks
    (``link_error``), fail its chain and store an extended result, as for a
    task that failed or was revoked in a pool child."""
    from celery.app.task import Context

    opts = dict(message.get("options") or {})
    return Context(
        id=task_id,
        task=message.get("name"),
        args=list(message.get("args") or ()),
        kwargs=dict(message.get("kwargs") or {}),
        root_id=opts.get("root_id") or task_id,
        parent_id=opts.get("parent_id"),
        group=opts.get("group_id"),
        callbacks=opts.get("link"),
        errbacks=opts.get("link_error"),
        chain=opts.get("chain"),
        retries=int(opts.get("retries") or 0),
        delivery_info={"is_eager": False},
    )


def _record_withdrawn(app: Any, task_id: str, why: str, message: dict[str, Any]) -> None:
    """Write the result of a deferred task taken out of line, as a worker does
    for a task that is not parked: its park TTL ran out (``expired``):
    ``FAILURE`` with :class:`LockTimeout`, its ``link_error`` errbacks called
    and its chain failed; a re-attempt refused because a resource is taken
    in another kind (``refused``, limited or not): ``FAILURE`` with
    :class:`InvalidResource`, likewise; revoked, or its ``expires`` passed:
    ``REVOKED`` (reason ``revoked`` or ``expired``) and the ``task_revoked``
    signal."""
    from celery import signals

    from ..exceptions import InvalidResource, LockTimeout

    request = _withdrawn_request(app, task_id, message)
    if why in ("expired", "refused"):
        resources = tuple(message.get("resources") or ())
        exc: Exception = (
            LockTimeout(resources, message.get("park_ttl"))
            if why == "expired"
            else InvalidResource(str(message.get("refused") or "resource refused"), resources)
        )
        app.backend.mark_as_failure(task_id, exc, request=request)
        return
    expired = why == "expired-message"
    app.backend.mark_as_revoked(task_id, reason="expired" if expired else why, request=request)
    task = app.tasks.get(str(message.get("name") or ""))
    if task is not None:
        signals.task_revoked.send(
            sender=task, request=request, terminated=False, signum=None, expired=expired
        )


def _is_revoked(task_id: str) -> bool:
    from celery.worker import state

    return task_id in state.revoked


def _revoked_ids() -> list[str]:
    from celery.worker import state

    return [str(x) for x in list(state.revoked)]


class RedisLockNode(bootsteps.StartStopStep):
    """Runs this worker's incarnation: node record, heartbeat, clean-up.

    Requires the Pool (the pool's children are known when it starts) and
    starts before the Consumer. Adds to the worker:

        * redislock_node: the :class:`celery_redislock.worker.node.Node`

    ``create`` (no I/O, before the pool forks): a new incarnation, the app's
    manager switched to worker mode. ``start``: the eviction check, the
    data-format check and the node record claim (a namespace of another
    format stops the worker with EX_CONFIG), the heartbeat thread, the
    metrics endpoint (``redislock_metrics_port``; its hook and multiprocess
    directory are set up in ``create``, before the pool forks). ``stop``/``terminate`` do nothing:
    the release runs after the pool drained or was terminated, from the
    blueprint's ``on_stopped`` (``worker_shutdown`` as a fallback).
    """

    label = "RedisLock"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        w.redislock_node = None
        self.locks = RedisLock.of(w.app)
        self.node: Node | None = None
        self.dispatcher: Any = None
        self._shutdown_done = False
        self._on_shutdown: Callable[..., None] | None = None
        #: The Prometheus endpoint (``redislock_metrics_port``), or None.
        self.metrics: Any = None
        super().__init__(w, **kwargs)

    def include_if(self, w: Any) -> bool:
        return self.locks is not None

    def create(self, w: Any) -> None:
        locks = self.locks
        assert locks is not None
        inc = new_incarnation()
        try:
            cfg = locks.config
            # may refuse redislock_wait_timeout
            mgr = locks.enter_worker(inc, nodename=w.hostname)
            if cfg.metrics_port is not None:
                # Before the pool forks: the children inherit the hook and
                # write to the multiprocess directory set up here.
                self.metrics = _worker_metrics(mgr, w.hostname, cfg)
                mgr.metrics = self.metrics.hook
        except ConfigurationError as exc:  # one line and EX_CONFIG, not a traceback
            locks.refuse_to_start(exc, "the worker")
        except RedisUnavailable as exc:
            # Only a Redis Cluster client connects when it is made (it reads
            # the slot map); a redis:// or sentinel:// one connects lazily and
            # its node start is retried by the heartbeat (start() below).
            log.critical(
                "worker.start-unavailable node=%s %s (the worker refuses to start: a "
                "redis+cluster:// client reads the cluster's slot map when it is made; "
                "start it again once a seed node answers)",
                w.hostname,
                exc,
            )
            raise SystemExit(EX_UNAVAILABLE) from exc
        self.node = Node(
            mgr,
            w.hostname,
            inc,
            live_pids=lambda: pool_pids(w),
            fast_restart_cleanup=cfg.fast_restart_cleanup,
            on_evicted=lambda: self._fence(w),
            incarnation_cell=locks.incarnation_cell,
        )
        locks.node = self.node
        w.redislock_node = self.node

        blueprint = getattr(w, "blueprint", None)
        if blueprint is not None:
            previous = blueprint.on_stopped

            def on_stopped() -> None:
                try:
                    if previous is not None:
                        previous()
                finally:
                    self.release(w)

            blueprint.on_stopped = on_stopped

        def on_worker_shutdown(sender: Any = None, **_: Any) -> None:
            if sender is w:
                self.release(w)

        self._on_shutdown = on_worker_shutdown
        signals.worker_shutdown.connect(on_worker_shutdown, weak=False)

    def start(self, w: Any) -> None:
        locks, node = self.locks, self.node
        assert locks is not None and node is not None
        cfg = locks.config
        log.info(
            "worker.start node=%s inc=%s namespace=%s interval=%.3g owner_ttl=%.3g",
            node.nodename,
            node.incarnation,
            cfg.namespace,
            cfg.heartbeat_interval,
            cfg.owner_ttl,
        )
        checked = cfg.eviction_check == "ignore"
        try:
            if not checked:
                self._check_eviction(node, cfg.eviction_check)
                checked = True
            node.start()
        except FormatMismatch as exc:  # one line and EX_CONFIG, not a traceback
            # Nothing was written: nothing to release at shutdown either.
            node.state = "stopped"
            log.critical(
                "worker.format-mismatch node=%s %s (the worker refuses to start)",
                node.nodename,
                exc,
            )
            raise SystemExit(EX_CONFIG) from exc
        except RedisUnavailable as exc:
            if cfg.eviction_check == "raise":
                raise
            log.error(
                "node.start-error node=%s error=%s: retrying on every heartbeat", node.nodename, exc
            )
            if not checked:
                # Run the skipped check once the heartbeat reaches Redis.
                node.on_late_start = lambda: self._check_eviction(node, "warn")
        node.start_heartbeat()
        self._start_dispatcher(w)
        self._hook_pool(w)
        if self.metrics is not None:
            try:
                self.metrics.serve()
            except OSError as exc:  # the port is taken, or the address is not ours
                locks.refuse_to_start(
                    ConfigurationError(
                        "redislock_metrics_port",
                        f"cannot listen on {cfg.metrics_address}:{cfg.metrics_port}: {exc} "
                        "(give each worker on a host its own port)",
                    ),
                    "the worker",
                )

    def _start_dispatcher(self, w: Any) -> None:
        """Start the deferred-task dispatcher thread (docs/defer.md)."""
        from ..worker.defer import Dispatcher

        node, locks = self.node, self.locks
        assert node is not None and locks is not None
        self.dispatcher = Dispatcher(
            node.manager,
            node.incarnation,
            publish=_Publisher(w.app),
            on_withdrawn=lambda tid, why, msg: self._withdrawn(w.app, tid, why, msg),
            revoked=_is_revoked,
            revoked_ids=_revoked_ids,
        )
        w.redislock_dispatcher = self.dispatcher
        self.dispatcher.start()

    def _withdrawn(self, app: Any, task_id: str, why: str, message: dict[str, Any]) -> None:
        """A deferred task was taken out of line: its result, then its unique
        key (a parked ``UniqueTask`` keeps it while parked), on the
        dispatcher's own connections."""
        from .unique import release_withdrawn

        try:
            _record_withdrawn(app, task_id, why, message)
        finally:
            release_withdrawn(app, self.dispatcher.manager, task_id, message)

    @staticmethod
    def _check_eviction(node: Node, mode: str) -> None:
        """The start-up eviction-policy check: raise (mode 'raise') or log a warning."""
        check = node.manager.check_eviction()
        if check.may_evict:
            if mode == "raise":
                raise ConfigurationError(
                    "redislock_eviction_check",
                    f"{check.describe()} (or set redislock_eviction_check='warn')",
                )
            log.warning("startup.eviction-risk %s", check.describe())

    def register_with_event_loop(self, w: Any, hub: Any) -> None:
        # Steps register in reverse start order, so the prefork AsynPool
        # installs its own on_process_down after this: chain ours once the
        # loop runs (again after every consumer restart).
        hub.call_soon(self._hook_pool, w)

    def _hook_pool(self, w: Any) -> None:
        """Chain :meth:`Node.child_exited` to the prefork pool's ``on_process_down``.

        billiard calls it in the main process for every child it reaped
        (``Pool._join_exited_workers``; the AsynPool runs that as soon as a
        child's sentinel fd becomes readable, SIGKILL included), after the
        child left the pool's process list: the node heartbeat then beats at
        once and frees the child's locks, rather than at the next interval.
        Idempotent; no-op for other pools.
        """
        inner, node = _prefork_pool(w), self.node
        if inner is None or node is None:
            return
        previous = getattr(inner, "on_process_down", None)
        if getattr(previous, _HOOK_MARK, False):
            return

        def on_process_down(proc: Any) -> None:
            try:
                if previous is not None:
                    previous(proc)
            finally:
                try:
                    pid = getattr(proc, "pid", None)
                    if pid:
                        node.child_exited(int(pid))
                except Exception:  # never break the pool's bookkeeping
                    log.debug("worker.process-down-hook-error", exc_info=True)

        setattr(on_process_down, _HOOK_MARK, True)
        inner.on_process_down = on_process_down

    def stop(self, w: Any) -> None:
        """Warm shutdown began (before the pool drains): tasks still waiting
        for their locks leave the queue and go back to the broker."""
        log.debug("worker.stopping: locks are released once the pool has drained")
        self._halt()

    def terminate(self, w: Any) -> None:
        log.debug("worker.terminating: locks are released once the pool is terminated")
        self._halt()

    def _halt(self) -> None:
        node = self.node
        if node is not None and node.state not in ("stopped", "evicted"):
            try:
                node.halt_waiters()
            except Exception:  # never break Celery's shutdown
                log.exception("worker.halt-error node=%s", node.nodename)

    def release(self, w: Any) -> None:
        """Final step: free every owner of this incarnation (idempotent)."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        if self._on_shutdown is not None:
            signals.worker_shutdown.disconnect(self._on_shutdown)
        node, locks = self.node, self.locks
        if self.metrics is not None:
            try:
                self.metrics.close()
            except Exception:  # never break Celery's shutdown
                log.debug("worker.metrics-close-error", exc_info=True)
        if self.dispatcher is not None:
            self.dispatcher.stop()
        try:
            if node is not None:
                node.shutdown()
        except Exception:
            log.exception("worker.release-error node=%s", getattr(node, "nodename", "?"))
        finally:
            if locks is not None and locks.node is node:
                locks.leave_worker()

    def _fence(self, w: Any) -> None:
        """Evicted by a successor: kill the pool's children, cold-shut down."""
        from celery.worker import state

        for pid in pool_pids(w):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        # Cold shutdown: WorkController.terminate() keeps w.exitcode, which
        # the `celery worker` command exits with (None would mean 0).
        w.exitcode = EX_EVICTED
        state.should_terminate = EX_EVICTED
