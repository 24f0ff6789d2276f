"""``RedisLock(app)``: the Celery extension object.

It reads the ``redislock_*`` settings lazily (at worker start or first use,
so ``app.conf`` may be filled in after construction), adds the worker
bootstep, connects the pool-child hook, registers the reconcile task and
merges its beat entry into ``beat_schedule`` (never replacing the user's).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NoReturn

from .. import _validate as _v
from ..engine.lease import Lease
from ..engine.manager import LockManager
from ..exceptions import ConfigurationError, LockTimeout, ReplicationTimeout
from .settings import EX_CONFIG as EX_CONFIG  # importable from here, as before
from .settings import Config, config_error_line, hide_url_password, load_config

log = logging.getLogger("celery_redislock.app")
log_reconcile = logging.getLogger("celery_redislock.reconcile")

#: Name of the reconcile task, and of its beat_schedule entry.
RECONCILE_TASK = "celery_redislock.reconcile"
#: Engine resource that lets one reconcile run at a time, fleet-wide.
RECONCILE_RESOURCE = "celery_redislock:reconcile"
#: The worker bootstep, by the dotted name Celery's blueprint loads it by.
WORKER_STEP = "celery_redislock.integration.bootsteps:RedisLockNode"

_ATTR = "_celery_redislock"
_instances: weakref.WeakSet[RedisLock] = weakref.WeakSet()
_signals_connected = False
_signals_lock = threading.Lock()


def _connect_signals() -> None:
    """Connect the process-wide signal handlers once."""
    global _signals_connected
    with _signals_lock:
        if _signals_connected:
            return
        from celery import signals

        signals.worker_process_init.connect(_on_worker_process_init, weak=False)
        signals.beat_init.connect(_on_beat_init, weak=False)
        _signals_connected = True


def _on_worker_process_init(**_: Any) -> None:
    # No Redis round trip here: the pool kills a child not ready in ~4 s.
    for locks in list(_instances):
        locks.process_init()


def _on_beat_init(sender: Any = None, **_: Any) -> None:
    scheduler = getattr(sender, "scheduler", None)
    app = getattr(sender, "app", None)
    locks = RedisLock.of(app) if app is not None else None
    if scheduler is None or locks is None:
        return
    try:
        entry = locks.beat_entry()
    except ConfigurationError as exc:
        # Beat without its reconcile entry would run silently degraded.
        locks.refuse_to_start(exc, "celery beat")
    if entry is not None and RECONCILE_TASK not in scheduler.schedule:
        scheduler.update_from_dict({RECONCILE_TASK: entry})


class RedisLock:
    """Celery extension: locks for tasks, a worker bootstep, and reconcile.

    ``RedisLock(app)`` or ``RedisLock().init_app(app)`` for a
    :class:`celery.Celery` app. Then use
    :func:`celery_redislock.locked` on tasks, ``locks.lock(...)`` in other
    code, and ``locks.manager`` for the engine itself.

    Settings are read from ``app.conf`` on first use (see
    :mod:`celery_redislock.integration.settings`); bad values raise
    :class:`ConfigurationError` naming the setting.
    """

    def __init__(self, app: Any = None) -> None:
        self.app: Any = None
        self._config: Config | None = None
        self._manager: LockManager | None = None
        self._manager_pid = 0
        self._lock = threading.RLock()
        #: Set by the worker bootstep (main process) before the pool forks:
        #: the incarnation id whose group every owner of this worker joins.
        self.incarnation: str | None = None
        #: The running :class:`celery_redislock.worker.node.Node`, main process only.
        self.node: Any = None
        #: The incarnation id shared with the pool children
        #: (:class:`celery_redislock.worker.node.IncarnationCell`), in a worker.
        self.incarnation_cell: Any = None
        self._config_error_reported = False
        #: Processes of the worker in which the manager runs in worker mode:
        #: the main process (set before the pool forks) and, in a pool
        #: child, that child (set by worker_process_init). Any other process
        #: (a helper forked by a task) is standalone.
        self._worker_pids: frozenset[int] = frozenset()
        #: The pid of this process when it is a prefork pool child (set by
        #: worker_process_init): ``@locked(on_lost="terminate")`` may kill it.
        #: Read by the worker integration (``@locked``); 0 elsewhere.
        self.pool_child_pid = 0
        #: The worker's node name (``celery@host``), in a worker.
        self.nodename: str | None = None
        if app is not None:
            self.init_app(app)

    # -- wiring -----------------------------------------------------------

    def init_app(self, app: Any) -> RedisLock:
        """Attach to ``app``: bootstep, signals, reconcile task, beat entry."""
        self.app = app
        setattr(app, _ATTR, self)
        _instances.add(self)
        _connect_signals()
        # By name: Celery's worker blueprint loads it (symbol_by_name) when
        # a worker starts, so this module never imports the bootstep's.
        app.steps["worker"].add(WORKER_STEP)
        self._register_reconcile_task(app)
        from . import guard

        guard.register(app, self)  # parked deferred tasks' guards (docs/defer.md, D12)
        if getattr(app, "configured", False):
            self._merge_beat_schedule_or_report(app.conf)
        else:
            app.on_after_configure.connect(self._on_after_configure, weak=False)
        return self

    @classmethod
    def of(cls, app: Any) -> RedisLock | None:
        """The RedisLock attached to ``app``, or None."""
        found = getattr(app, _ATTR, None)
        return found if isinstance(found, RedisLock) else None

    @classmethod
    def for_task(cls, task: Any) -> RedisLock:
        """The RedisLock of ``task``'s app (Celery's current app when
        ``task`` is None or has no app).

        Raises :class:`ConfigurationError` when that app has none: the
        ``@locked`` and ``UniqueTask`` code asks for it at each call.
        """
        app = getattr(task, "app", None) if task is not None else None
        if app is None:
            from celery import current_app

            app = current_app
        locks = cls.of(app)
        if locks is None:
            raise ConfigurationError(
                "RedisLock",
                f"app {getattr(app, 'main', app)!r} has no RedisLock: call RedisLock(app) "
                "where the app is created, before @locked tasks run",
            )
        return locks

    def _on_after_configure(self, sender: Any = None, source: Any = None, **_: Any) -> None:
        if sender is not None and sender is not self.app:
            return
        self._merge_beat_schedule_or_report(source if source is not None else self.app.conf)

    def _merge_beat_schedule_or_report(self, conf: Any) -> None:
        # Before anything prints the settings (celery inspect conf, report).
        hide_url_password(conf)
        try:
            self._merge_beat_schedule(conf)
        except ConfigurationError as exc:
            # Every process that loads the app says it once, in one line; the
            # worker and beat then refuse to start (refuse_to_start).
            self.report_config_error(exc)
        except Exception:  # never break the app's configuration
            log.exception("app.beat-merge-error")

    def report_config_error(self, exc: ConfigurationError) -> None:
        """Log the one-line error of a refused setting (ERROR, once per process)."""
        if not self._config_error_reported:
            self._config_error_reported = True
            log.error("%s", config_error_line(exc))

    def refuse_to_start(self, exc: ConfigurationError, process: str) -> NoReturn:
        """Log the refused setting in one line, then exit with status 78 (``EX_CONFIG``)."""
        log.critical("%s (%s refuses to start)", config_error_line(exc), process)
        raise SystemExit(EX_CONFIG)

    def beat_entry(self, conf: Any = None) -> dict[str, Any] | None:
        """The reconcile task's ``beat_schedule`` entry (None: reconcile is
        off), from ``conf`` or the app's settings. For the integration (the
        ``beat_init`` handler), not public API."""
        cfg = load_config(conf) if conf is not None else self.config
        if cfg.reconcile_interval is None:
            return None
        return {
            "task": RECONCILE_TASK,
            "schedule": cfg.reconcile_interval,
            # Runs that could not start within one period are dropped, so a
            # busy pool never piles them up.
            "options": {"expires": cfg.reconcile_interval},
        }

    def _merge_beat_schedule(self, conf: Any) -> None:
        entry = self.beat_entry(conf)
        if entry is None:
            return
        schedule = conf.get("beat_schedule")
        if schedule is None:
            conf["beat_schedule"] = {RECONCILE_TASK: entry}
        elif RECONCILE_TASK not in schedule:
            schedule[RECONCILE_TASK] = entry

    def _register_reconcile_task(self, app: Any) -> None:
        locks = self

        @app.task(name=RECONCILE_TASK, shared=False, ignore_result=False)
        def reconcile() -> dict[str, Any]:
            """Free the locks of every dead owner (one runner at a time)."""
            return locks.reconcile()

    # -- configuration and engine -----------------------------------------

    @property
    def config(self) -> Config:
        """The validated settings, read from ``app.conf`` on first use."""
        if self._config is None:
            if self.app is None:
                raise RuntimeError("RedisLock is not attached to an app: call init_app(app)")
            hide_url_password(self.app.conf)
            self._config = load_config(self.app.conf)
        return self._config

    @property
    def manager(self) -> LockManager:
        """This process's :class:`LockManager` (created on first use).

        In a worker (main process and pool children) its owners' liveness is
        refreshed by the worker's node heartbeat; elsewhere, including in a
        process that a task forks (a helper), it runs its own heartbeat
        thread (see :class:`LockManager` on member processes).
        """
        mgr = self._manager
        if mgr is not None:
            return mgr
        with self._lock:
            if self._manager is None:
                worker = self.incarnation is not None and os.getpid() in self._worker_pids
                self._manager = self._make_manager(worker=worker)
            return self._manager

    def _make_manager(self, *, worker: bool) -> LockManager:
        try:
            return self._build_manager(worker=worker)
        except ConfigurationError as exc:
            if exc.setting.startswith("wait_"):  # checked against the client: name the setting
                raise ConfigurationError(f"redislock_{exc.setting}", exc.message) from exc
            raise

    def _build_manager(self, *, worker: bool) -> LockManager:
        cfg = self.config
        name = self.nodename if worker else None
        if name is not None and (len(name) > _v.MAX_LABEL or not name.isprintable()):
            name = None  # only a label for operators: never refuse a worker over it
        if worker:
            from ..worker.node import group_key, halt_key

            cell = self.incarnation_cell
            prefix = "{" + cfg.namespace + "}:"
            inc = self.incarnation

            def group() -> str | None:
                # Read at each registration: the node may have moved on to a
                # fresh incarnation (Redis lost its state) since the fork.
                return group_key(prefix, cell.get()) if cell is not None else None

            mgr = LockManager(
                cfg.url,
                cfg.namespace,
                owner_ttl=cfg.owner_ttl,
                heartbeat_interval=cfg.heartbeat_interval,
                heartbeat=False,
                group=group,
                # Shown by `redislock owners` as each owner's node.
                name=name,
                eviction_check="ignore",  # the worker bootstep checks at start-up
                **self._wait_kwargs(cfg),
            )
            mgr.set_halt_key(halt_key(prefix, inc) if inc else None)
            return mgr
        return LockManager(
            cfg.url,
            cfg.namespace,
            owner_ttl=cfg.owner_ttl,
            heartbeat_interval=cfg.heartbeat_interval,
            eviction_check=cfg.eviction_check,
            **self._wait_kwargs(cfg),
        )

    @staticmethod
    def _wait_kwargs(cfg: Config) -> dict[str, Any]:
        """The replica-acknowledgement options (``redislock_wait_*``) of the manager.

        The manager checks ``wait_timeout`` against its client's socket
        timeout too; ``_make_manager`` reports a refusal under the setting's name.
        """
        return {
            "wait_replicas": cfg.wait_replicas,
            "wait_timeout": cfg.wait_timeout,
            "wait_policy": cfg.wait_policy,
        }

    def enter_worker(self, incarnation: str, nodename: str | None = None) -> LockManager:
        """Main process, before the pool forks: switch to worker mode.

        Called by the worker bootstep (the integration), not public API."""
        from ..worker.node import IncarnationCell

        with self._lock:
            self.incarnation = incarnation
            self.nodename = nodename
            self._worker_pids = frozenset({os.getpid()})
            self.incarnation_cell = IncarnationCell(incarnation)
            self._manager = self._make_manager(worker=True)
            # The node heartbeat covers this process's owner (it marks its
            # leases lost); a watcher thread here would only be one more real
            # thread blocked in Redis at interpreter exit (under eventlet that
            # crashed the worker at shutdown). Forked children still watch.
            self._manager.exempt_from_lost_watch()
            return self._manager

    def leave_worker(self) -> None:
        """After worker shutdown: later use gets a standalone manager.

        Called by the worker bootstep (the integration), not public API."""
        with self._lock:
            self.incarnation = None
            self.incarnation_cell = None
            self.node = None
            self.nodename = None
            self._manager = None
            self._worker_pids = frozenset()
            self.pool_child_pid = 0

    def process_init(self) -> None:
        """Pool child start: a fresh owner id, and the worker's group again.

        Called by the ``worker_process_init`` handler (the integration), not
        public API.

        After a fork the engine makes the child a standalone owner (its own
        heartbeat, no group): right for a helper process a task forks, which
        the node does not know. Only real pool children send
        ``worker_process_init``; here the child becomes a member of the
        incarnation's group again, its liveness refreshed by the main
        process. Idempotent per pid; no Redis round trip, no thread started
        (the pool kills a child that is not ready within seconds).
        """
        pid = os.getpid()
        if self.incarnation is None or pid in self._worker_pids:
            return
        # No self._lock here: a thread of the parent may have held it when
        # the pool forked, and this child would wait for ever.
        self._worker_pids = frozenset({pid})
        self.pool_child_pid = pid
        self.node = None  # the main process's; never used from a child
        mgr = self._manager
        if mgr is not None:
            mgr.become_member()
            _ = mgr.owner_id  # the identity source compares the pid: a fresh id

    def close(self) -> None:
        """Close this process's standalone manager (:meth:`LockManager.close`).

        Its held leases are released (or marked lost if Redis cannot be
        reached) and its owner is removed; the next use of :attr:`manager`
        makes a new one. In a worker's main process or pool child, the
        bootstep releases everything at shutdown and this does nothing; in a
        helper process a task forked, the manager is the helper's own and is
        closed here.
        """
        with self._lock:
            mgr, self._manager = self._manager, None
        standalone = self.incarnation is None or os.getpid() not in self._worker_pids
        if mgr is not None and standalone:
            mgr.close()

    # -- public helpers ---------------------------------------------------

    @property
    def lock(self) -> Callable[..., AbstractContextManager[Lease]]:
        """``with locks.lock("repo:1"):`` — the engine's lock, for code outside tasks.

        :meth:`LockManager.lock` of this app's manager: the same arguments
        (``exclusive``, ``shared``, ``timeout``, ``nested``) and errors as
        :meth:`LockManager.acquire`.
        """
        return self.manager.lock

    def reconcile(self) -> dict[str, Any]:
        """Free every dead owner's locks; one runner at a time fleet-wide.

        Returns the report as a dict (``skipped: True`` if another run holds
        the reconcile lock). Per-owner failures are isolated and retried on
        the next pass.
        """
        mgr = self.manager
        try:
            lease = mgr.acquire(RECONCILE_RESOURCE, timeout=0)
        except ReplicationTimeout as exc:
            log_reconcile.warning("reconcile.skipped reason=replicas-behind: %s", exc)
            return {"skipped": True}
        except LockTimeout:
            log_reconcile.info("reconcile.skipped reason=another-run-in-progress")
            return {"skipped": True}
        try:
            report = mgr.reconcile()
        finally:
            lease.release()
        result = report.as_dict()
        result["skipped"] = False
        return result
