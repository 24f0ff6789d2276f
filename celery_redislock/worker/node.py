"""A worker node's incarnation: node record, node heartbeat, restart clean-up.

Engine-side and Celery-free (the Celery bootstep in ``bootsteps.py`` drives
it), so it is usable and testable without a worker. See docs/worker.md for
the design and its race analysis.

- :func:`new_incarnation` makes the id of one worker start; every process of
  the worker builds its :class:`LockManager` with ``heartbeat=False`` and
  ``group=lambda: group_key(prefix, inc)`` so its owners join the group.
- :class:`Node` claims ``{ns}:node:<nodename>`` at start, runs the node
  heartbeat (one round trip per tick refreshes every owner of the group),
  frees dead children's locks, evicts a same-name predecessor whose
  heartbeat stopped (compare-and-set + tombstone, in :mod:`.succession`),
  fences itself if it was evicted, and releases everything at shutdown.
  Its Redis calls go through its own clients (:mod:`.clients`).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from .._threads import os_lock
from ..engine.heartbeat import Heartbeat
from ..engine.identity import pid_of_tag, read_proc_stat
from ..engine.manager import LockManager
from ..exceptions import LockError
from ..protocol import calls as calls
from ..protocol.keys import group_key, halt_key, node_key, text, tomb_key, validate_node_name
from ..protocol.reports import CleanupReport
from .clients import NodeClients
from .succession import Succession

log = logging.getLogger("celery_redislock.node")
log_cleanup = logging.getLogger("celery_redislock.cleanup")

#: TTL of a tombstone, and of node records and group hashes (refreshed by
#: every beat): a node gone for longer leaves nothing behind.
RECORD_TTL = 86400.0


def new_incarnation() -> str:
    """A fresh incarnation id (one worker start): 16 hex characters."""
    return secrets.token_hex(8)


#: Seconds between two ``node.heartbeat-error`` lines while ticks keep failing.
_ERROR_REMINDER_S = 60.0
#: Longest :meth:`Node.shutdown` waits for the heartbeat thread to end (a beat
#: in progress: each of its round trips is bounded by the socket timeout).
HEARTBEAT_JOIN_S = 5.0


class IncarnationCell:
    """The worker's current incarnation id, shared with its forked pool children.

    An anonymous shared memory page made in the main process before the pool
    forks: the main process writes a new id when it must continue as a fresh
    incarnation (Redis lost its state, see :meth:`Node.tick`), and every
    child reads the current one when it registers an owner (the manager's
    ``group`` callable), so a child never re-creates a lost incarnation's
    group. A sequence counter around the write lets a reader retry a torn
    read. Where anonymous shared memory is unavailable, or in a process that
    was not forked from the writer, it holds the id it was made with.
    """

    _SIZE = 64

    def __init__(self, incarnation: str) -> None:
        self._value = incarnation
        self._map: mmap.mmap | None
        try:
            self._map = mmap.mmap(-1, self._SIZE)
        except (OSError, ValueError):  # pragma: no cover - no shared memory
            self._map = None
        self._write_lock = threading.Lock()
        self.set(incarnation)

    def set(self, incarnation: str) -> None:
        """Publish ``incarnation`` (main process)."""
        data = incarnation.encode()
        if len(data) > self._SIZE - 9:
            raise ValueError(f"incarnation id too long: {incarnation!r}")
        with self._write_lock:
            self._value = incarnation
            m = self._map
            if m is None:
                return
            seq = int.from_bytes(m[0:8], "little")
            m[0:8] = (seq + 1).to_bytes(8, "little")  # odd: being written
            m[8 : self._SIZE] = data.ljust(self._SIZE - 8, b"\0")
            m[0:8] = (seq + 2).to_bytes(8, "little")

    def get(self) -> str:
        """The current incarnation id."""
        m = self._map
        if m is None:
            return self._value
        while True:
            before = m[0:8]
            data = m[8 : self._SIZE]
            if before == m[0:8] and int.from_bytes(before, "little") % 2 == 0:
                return data.rstrip(b"\0").decode()


def _pid(tag: str) -> int:
    try:
        return pid_of_tag(tag)
    except ValueError:
        return -1


def _pairs(values: Iterable[Any]) -> list[tuple[str, str]]:
    """``(owner, process tag)`` pairs of a flat reply."""
    flat = [text(v) for v in values]
    return list(zip(flat[::2], flat[1::2]))


def _proc_status(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid`` from /proc, None if no such process.

    Raises OSError where /proc is not available.
    """
    st = read_proc_stat(pid)
    return None if st is None else (st[0], st[1])


def live_tag(pid: int) -> str | None:
    """The process tag of ``pid`` if it is a running process, else None.

    ``"<pid>.<starttime>"`` from ``/proc/<pid>/stat`` (a pid whose stat
    cannot be read, or a zombie, is not live); where /proc is unavailable,
    ``"<pid>"`` if the pid exists.
    """
    if pid <= 0:
        return None
    try:
        st = read_proc_stat(pid)
    except OSError:
        return str(pid) if pid_alive(pid) else None
    if st is None or st[0] in ("Z", "X"):
        return None
    return f"{pid}.{st[2]}"


def _same_process(recorded: str, current: str | None) -> bool:
    """Whether a group value names the live process tagged ``current``.

    A bare pid (older registration, or no /proc) compares by pid only.
    """
    if current is None:
        return False
    if "." not in recorded or "." not in current:
        return _pid(recorded) == _pid(current)
    return recorded == current


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as dead)."""
    if pid <= 0:
        return False
    if sys.platform.startswith("linux"):
        try:
            st = _proc_status(pid)
        except OSError:
            st = ("R", 0)
        return st is not None and st[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_live_child(pid: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        st = _proc_status(pid)
    except OSError:
        return False
    return st is not None and st[0] not in ("Z", "X") and st[1] == os.getpid()


def free_dead_member(manager: LockManager, owner_id: str) -> CleanupReport | None:
    """Free ``owner_id``'s locks if it is a process of this worker that died.

    For a pool child that meets a lock held by a sibling before the node's
    heartbeat has cleaned the sibling up (a redelivered task whose first run
    was SIGKILLed). The owner counts as dead only when this worker's group
    records it and the process its tag names no longer runs (pid and start
    time: a reused pid is not mistaken for it; a zombie is dead); it is then
    cleaned up exactly as the node would (``cleanup_owner`` with force).
    Anything else (another worker's owner, a live one, no group: not a
    worker process) is left to the usual paths and gives None. One HGET,
    plus the clean-up when it applies: O(locks of the dead owner).
    """
    make_group = manager.liveness.group
    group = make_group() if make_group is not None else None
    if group is None:
        return None
    tag = manager.channel.command("HGET", group, owner_id)
    if tag is None:
        return None
    tag = text(tag)
    pid = _pid(tag)
    if pid <= 0 or _same_process(tag, live_tag(pid)):
        return None
    report = manager.cleanup_owner(owner_id, force=True)
    log_cleanup.info(
        "cleanup.dead-member owner=%s pid=%d locks=%d: a process of this worker found it dead",
        owner_id,
        pid,
        report.released,
    )
    return report


@dataclass
class TickResult:
    """What one node heartbeat did."""

    #: The node's state after the tick (see :attr:`Node.state`).
    state: str
    #: True when this tick found our tombstone: we were evicted.
    evicted: bool = False
    #: Whether the node record is ours.
    owned: bool = False
    #: Owners of dead processes whose locks were freed this tick.
    dead: list[str] = field(default_factory=list)
    #: Owners whose liveness key was gone although their process lives.
    lost: list[str] = field(default_factory=list)
    #: Cleanup reports of ``dead`` and ``lost`` owners (and of an evicted
    #: predecessor's owners).
    cleaned: list[CleanupReport] = field(default_factory=list)
    #: Incarnation of a predecessor evicted by this tick, if any.
    predecessor: str | None = None
    #: True when this tick found that Redis lost our node record or group:
    #: the node fenced itself and continues as a fresh incarnation.
    state_lost: bool = False


class Node:
    """One incarnation of a worker node (main process side).

    Args:
        manager: the main process's :class:`LockManager` (worker mode:
            ``heartbeat=False``, ``group`` = this incarnation's group key).
            The node uses its namespace, TTLs and interval; its Redis calls
            go through private clients of their own (the heartbeat runs in a
            real OS thread).
        nodename: the stable node name (``celery@host``).
        incarnation: the id from :func:`new_incarnation` the manager's group
            callable uses.
        live_pids: returns the pids of the live pool children (the main
            process is always live); called every tick.
        fast_restart_cleanup: evict a same-name predecessor whose heartbeat
            stopped for two intervals; False leaves its owners to expire.
        on_evicted: called (from the heartbeat thread) when the tick finds
            this incarnation tombstoned, after its leases were marked lost:
            stop the pool.
        incarnation_cell: where the pool children read the current
            incarnation (:class:`IncarnationCell`); the node writes a fresh
            id there when Redis lost its state. None: children keep the
            id they were forked with.

    States: ``init`` (start not done yet), ``owner`` (the node record is
    ours), ``watching`` (another incarnation's record, deciding),
    ``duplicate`` (that incarnation is beating: a live duplicate),
    ``evicted`` (a successor evicted us), ``stopped``.

    The node keeps its state and the tick lock; the node record's
    succession (claim, watch, evict a predecessor) is a
    :class:`~celery_redislock.worker.succession.Succession` that sets the
    state through the node, and every round trip goes through the node's
    own clients (:class:`~celery_redislock.worker.clients.NodeClients`).
    """

    def __init__(
        self,
        manager: LockManager,
        nodename: str,
        incarnation: str,
        *,
        live_pids: Callable[[], Iterable[int]] = tuple,
        fast_restart_cleanup: bool = True,
        on_evicted: Callable[[], None] | None = None,
        record_ttl: float = RECORD_TTL,
        incarnation_cell: IncarnationCell | None = None,
    ) -> None:
        validate_node_name(nodename)
        self.manager = manager
        self.nodename = nodename
        self.incarnation = incarnation
        prefix = manager.keys.prefix
        self.prefix = prefix
        self.node_key = node_key(prefix, nodename)
        self.group_key = group_key(prefix, incarnation)
        self.tomb_key = tomb_key(prefix, incarnation)
        #: The halt list of the incarnation the pool children were forked
        #: with: kept when the node moves on to a fresh incarnation (their
        #: managers watch this one).
        self.halt_key = halt_key(prefix, incarnation)
        self._cell = incarnation_cell
        #: Incarnations this node gave up because Redis lost their state.
        self.lost_incarnations: list[str] = []
        #: (group key of the incarnation given up, monotonic time until which
        #: its late registrations are adopted by each tick).
        self._adopt: tuple[str, float] | None = None
        self._live_pids = live_pids
        self._on_evicted = on_evicted
        self._record_ttl_ms = int(record_ttl * 1000)
        self._iv_ms = int(manager.heartbeat_interval * 1000)
        self._ttl_ms = int(manager.owner_ttl * 1000)
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.started = int(time.time())
        self.state = "init"
        #: Called once, in the heartbeat thread, when a retried ``node_start``
        #: succeeds after :meth:`start` failed (Redis unreachable at start-up):
        #: the bootstep runs the start-up checks it had to skip. Errors are
        #: logged, never raised into the heartbeat.
        self.on_late_start: Callable[[], None] | None = None
        self._tick_lock = os_lock()
        #: The node's own managers, one per OS thread (its scripts and clean-ups).
        self.clients = NodeClients(manager)
        self._succession = Succession(
            manager,
            self.clients,
            nodename,
            self._record_args,
            self._set_state,
            iv_ms=self._iv_ms,
            ttl_ms=self._ttl_ms,
            record_ttl_ms=self._record_ttl_ms,
            fast_restart_cleanup=fast_restart_cleanup,
        )
        self._heartbeat = Heartbeat(manager.heartbeat_interval, self._safe_tick, "redislock-node")
        #: Failed ticks in the current run of failures, and when the last
        #: ``node.heartbeat-error`` line was logged (monotonic seconds).
        self.failed_ticks = 0
        self._error_logged_at = 0.0

    # -- plumbing ---------------------------------------------------------

    def _record_args(self) -> list[str]:
        return [str(self.pid), self.host, str(self.started)]

    @property
    def fast_restart_cleanup(self) -> bool:
        """Whether a stale same-name predecessor is evicted at once (see Args)."""
        return self._succession.fast_restart_cleanup

    @fast_restart_cleanup.setter
    def fast_restart_cleanup(self, value: bool) -> None:
        self._succession.fast_restart_cleanup = value

    @property
    def threshold_ms(self) -> int:
        """How long a record's heartbeat must have stopped before eviction."""
        return 2 * self._iv_ms

    # -- start ------------------------------------------------------------

    def start(self) -> str:
        """Claim the node record (one round trip, constant cost, no SCAN).

        Returns the state: ``owner`` for a brand-new node (or a predecessor
        whose heartbeat was already stale, evicted right here), ``watching``
        when another incarnation's record must be watched by the heartbeat.
        Raises :class:`RedisUnavailable`; the heartbeat retries the start.
        """
        with self._tick_lock:
            return self._start_locked()

    def _start_locked(self) -> str:
        self._succession.claim(self.incarnation)
        return self.state

    def _set_state(self, state: str) -> None:
        self.state = state

    # -- heartbeat --------------------------------------------------------

    def _pids(self) -> set[int]:
        try:
            pids = {int(p) for p in self._live_pids()}
        except Exception:  # a pool mid-shutdown: treat as "no children"
            log.debug("node.pids-error", exc_info=True)
            pids = set()
        return pids

    def tick(self) -> TickResult:
        """One node heartbeat (one round trip, plus clean-up work when due).

        Refreshes every live owner of the group, frees dead and lost owners'
        locks, beats or watches the node record, and fences this worker if
        it finds its tombstone.
        """
        with self._tick_lock:
            if self.state in ("evicted", "stopped"):
                return TickResult(self.state, evicted=self.state == "evicted")
            if self.state == "init":
                self._start_locked()
                self._late_start()
            return self._tick_locked()

    def _late_start(self) -> None:
        hook, self.on_late_start = self.on_late_start, None
        if hook is None:
            return
        try:
            hook()
        except Exception:
            log.exception("node.late-start-error node=%s", self.nodename)

    def _tick_locked(self) -> TickResult:
        me = os.getpid()
        # Live processes by tag (pid + start time: a reused pid does not
        # match a dead owner's tag, race R6), and by bare pid for group
        # values registered without a start time.
        live: set[str] = {str(me)}
        for pid in self._pids() | {me}:
            tag = live_tag(pid)
            if tag is not None:
                live.add(tag)
                live.add(str(pid))
        mgr = self.manager
        ident = mgr.liveness.identity.peek()
        if ident is not None and not ident.registered:
            ident = None
        started = time.monotonic()
        keys = [self.node_key, self.group_key, self.tomb_key]
        if self._adopt is not None:
            if started < self._adopt[1]:
                keys.append(self._adopt[0])
            else:
                self._adopt = None
        reply = self.clients.run(
            calls.node_heartbeat(
                self.prefix,
                keys,
                self.incarnation,
                self._ttl_ms,
                self._record_ttl_ms,
                self.state == "owner",
                self._iv_ms,
                ident.owner_id if ident is not None else "",
                sorted(live),
            )
        )
        kind = text(reply[0])
        if kind == "evicted":
            self._fence()
            return TickResult(self.state, evicted=True)
        if kind == "gone":
            return self._state_lost(text(reply[1]))
        owned = int(reply[1]) == 1
        inc, hb, hb_ms, iv, now = (text(x) for x in reply[2:7])
        result = TickResult(self.state, owned=owned)
        dead = _pairs(reply[7])
        lost = _pairs(reply[8])
        if dead:
            fresh = self._pids()
            for owner, tag in dead:
                pid = _pid(tag)
                if _same_process(tag, live_tag(pid)) and (pid in fresh or _our_live_child(pid)):
                    continue  # forked after we read the pool's pids (race R5)
                self._free(owner, pid, "dead", result)
                result.dead.append(owner)
        for owner, tag in lost:
            self._free(owner, _pid(tag), "lost", result)
            result.lost.append(owner)
        # This process's owner, if still current, was refreshed by this tick
        # (it is in the group, its process lives, it was not reported lost):
        # that feeds its leases' local deadline, as a heartbeat would.
        current = ident is not None and mgr.liveness.identity.peek() is ident
        if (
            current
            and ident is not None
            and not mgr.liveness.confirm(ident, started, mgr.owner_ttl)
        ):
            mgr.liveness.owner_lost(ident, "deadline")
        mgr.cleaner.bury_doomed(self.clients.ops().client)
        if owned:
            self.state = "owner"
            self._succession.forget()
        else:
            self._succession.decide(
                inc, hb, int(hb_ms or 0), int(iv or 0), int(now), self.incarnation, result
            )
        result.state = self.state
        return result

    def _state_lost(self, what: str) -> TickResult:
        """Redis lost our node record or group: fence, then start afresh.

        Every lease of this process is marked lost and its identity retired;
        pool children learn it from their lost-owner watcher (their liveness
        keys are gone, or no longer refreshed under the lost group). The old
        incarnation is never re-created: the node continues as a fresh one,
        published to the children through the incarnation cell, and claims
        the node record again (node_start.lua).
        """
        old = self.incarnation
        mgr = self.manager
        # Redis lost data: the namespace's format key too, perhaps. Every
        # manager of this process checks (and re-creates) it on its next call.
        mgr.channel.format_pending = True
        self.clients.check_format_again()
        with mgr.state.lock:
            leases = [x for x in mgr.state.leases.values() if not x.grant_released]
        for lease in leases:
            lease.mark_lost("node-state-lost")
        ident = mgr.liveness.identity.peek()
        if ident is not None:
            mgr.liveness.identity.retire(ident)
        new = new_incarnation()
        self.incarnation = new
        self.group_key = group_key(self.prefix, new)
        self.tomb_key = tomb_key(self.prefix, new)
        if self._cell is not None:
            self._cell.set(new)
        self.lost_incarnations.append(old)
        # A child that read the old id just before the switch registers there:
        # the next ticks move such owners into the new group (within owner_ttl,
        # after which an unrefreshed registration has expired anyway).
        self._adopt = (group_key(self.prefix, old), time.monotonic() + self.manager.owner_ttl)
        self._succession.forget()
        log.error(
            "node.state-lost node=%s inc=%s missing=%s leases_lost=%d: Redis lost this "
            "worker's %s (restart without persistence, FLUSHALL, a failover to a replica that "
            "missed it, or eviction); every lock of this incarnation is lost (pool children "
            "learn it from their watcher); continuing as a new incarnation %s",
            self.nodename,
            old,
            what,
            len(leases),
            "node record" if what == "record" else "owner group",
            new,
        )
        self.state = "init"
        self._start_locked()
        return TickResult(self.state, state_lost=True)

    def _free(self, owner: str, pid: int, why: str, result: TickResult) -> None:
        ident = self.manager.liveness.identity.peek()
        if ident is not None and ident.owner_id == owner:
            self.manager.liveness.owner_lost(ident, "node-heartbeat")
        ops = self.clients.ops()
        try:
            report = ops.cleanup_owner(owner, force=True)
        except (redis.RedisError, LockError) as exc:
            log_cleanup.error("cleanup.owner-error owner=%s pid=%d error=%r", owner, pid, exc)
            return  # still in the group: retried next tick
        result.cleaned.append(report)
        if self.manager.metrics is not None and report.status != "alive":
            self.manager.metrics.cleaned("child")
        try:
            ops.channel.command("HDEL", self.group_key, owner)
        except LockError as exc:
            # The owner is freed; its group entry stays and the next tick
            # frees it again (idempotent) and retries the HDEL.
            log_cleanup.error("cleanup.group-error owner=%s pid=%d error=%s", owner, pid, exc)
        level = logging.INFO if why == "dead" else logging.ERROR
        log_cleanup.log(
            level,
            "cleanup.%s-owner owner=%s pid=%d locks=%d node=%s",
            why,
            owner,
            pid,
            report.released,
            self.nodename,
        )

    def _fence(self) -> None:
        self.state = "evicted"
        ident = self.manager.liveness.identity.peek()
        leases = 0
        with self.manager.state.lock:
            for lease in self.manager.state.leases.values():
                lease.mark_lost("declared-dead")
                leases += 1
        if ident is not None:
            self.manager.liveness.identity.retire(ident)
        log.critical(
            "node.evicted node=%s inc=%s leases_lost=%d: a successor with this node name "
            "declared this worker dead (it stalled for two heartbeat intervals or more) and "
            "freed its locks; stopping the pool",
            self.nodename,
            self.incarnation,
            leases,
        )
        self._heartbeat.stop()
        if self._on_evicted is not None:
            try:
                self._on_evicted()
            except Exception:
                log.exception("node.fence-error node=%s", self.nodename)

    def _safe_tick(self) -> None:
        try:
            self.tick()
        except LockError as exc:
            self.manager.liveness.heartbeat_failed()
            self._tick_failed(exc)
        else:
            if self.failed_ticks:
                log.info(
                    "node.heartbeat-resumed node=%s failed_ticks=%d",
                    self.nodename,
                    self.failed_ticks,
                )
                self.failed_ticks = 0
        if self.state not in ("evicted", "stopped"):
            # Releases deferred in this process (tasks of a threads, solo,
            # gevent or eventlet pool run here): nothing else retries them.
            # Never raises; backs off and logs once per release.
            self.manager.releaser.retry_deferred(self.clients.ops().client)

    def _tick_failed(self, exc: LockError) -> None:
        """Log a failed tick: the first of a run, then one reminder a minute.

        An outage fails every tick; one ERROR line per tick would bury the
        log. The count goes on and ``node.heartbeat-resumed`` ends the run.
        """
        self.failed_ticks += 1
        now = time.monotonic()
        if self.failed_ticks == 1 or now - self._error_logged_at >= _ERROR_REMINDER_S:
            self._error_logged_at = now
            log.error(
                "node.heartbeat-error node=%s failed_ticks=%d error=%s",
                self.nodename,
                self.failed_ticks,
                exc,
            )

    def child_exited(self, pid: int) -> bool:
        """A pool child with ``pid`` exited: beat now to free its locks.

        Called by the pool's process-down hook (main process, after the
        child was reaped). Makes no Redis call in the caller's thread: it
        wakes the node heartbeat, whose tick reports the owners of pids that
        are no longer live and re-checks each against the pool before
        freeing it (race R5), so a live owner is never freed. Returns False,
        and wakes nothing, when ``pid`` is still a running process.
        """
        if pid_alive(pid):
            return False
        log.debug("node.child-exited node=%s pid=%d: beating now", self.nodename, pid)
        self._heartbeat.wake()
        return True

    def start_heartbeat(self) -> None:
        """Start the node heartbeat in a real OS thread of this process."""
        self._heartbeat.ensure_started()

    @property
    def ticks(self) -> int:
        """Heartbeat ticks done by the thread."""
        return self._heartbeat.ticks

    # -- shutdown ---------------------------------------------------------

    def halt_waiters(self) -> None:
        """Shutdown began: make every waiter of this worker leave its queue.

        Marks this process's manager halted (a waiter here stops before its
        next wait) and pushes ``{ns}:halt:<inc>`` once: every waiter of the
        worker (pool children included) blocks on it next to its wake list,
        raises ShuttingDown and pushes the entry back for the next. One
        round trip; a Redis error is logged and waiters keep waiting.
        Idempotent.
        """
        self.manager.acquirer.halted = True
        try:
            pipe = self.clients.ops().client.pipeline(transaction=False)
            pipe.delete(self.halt_key)
            pipe.rpush(self.halt_key, "halt")
            pipe.pexpire(self.halt_key, self._record_ttl_ms)
            pipe.execute()
        except redis.RedisError as exc:
            log.error(
                "node.halt-error node=%s error=%s: waiting tasks keep waiting", self.nodename, exc
            )
            return
        log.info(
            "node.halt node=%s inc=%s: waiters leave their queues", self.nodename, self.incarnation
        )

    def shutdown(self) -> list[CleanupReport]:
        """Stop the heartbeat and free every owner of this incarnation.

        Call only once the pool has drained (warm) or been terminated
        (cold): children still running lose their locks. Deletes the node
        record if it is still ours. Idempotent. Cost: O(owners + their locks).

        The heartbeat thread is stopped and waited for (at most
        :data:`HEARTBEAT_JOIN_S`) first: no beat of it runs on, on the
        clients closed here, while the interpreter exits.
        """
        self._heartbeat.stop()
        if not self._heartbeat.join(HEARTBEAT_JOIN_S):
            log.warning(
                "node.heartbeat-stop-timeout node=%s seconds=%.3g: a beat is still in "
                "progress; shutting down beside it",
                self.nodename,
                HEARTBEAT_JOIN_S,
            )
        with self._tick_lock:
            if self.state == "stopped":
                return []
            evicted = self.state == "evicted"
            self.state = "stopped"
        with self.manager.state.lock:
            for lease in self.manager.state.leases.values():
                lease.mark_lost("declared-dead")
        ident = self.manager.liveness.identity.peek()
        if ident is not None:
            self.manager.liveness.identity.retire(ident)
        ops = self.clients.ops()
        reply = ops.channel.run(calls.node_stop(self.node_key, self.group_key, self.incarnation))
        owners = [text(o) for o in reply[1]]
        reports: list[CleanupReport] = []
        failed = 0
        for owner in owners:
            try:
                reports.append(ops.cleanup_owner(owner, force=True))
            except (redis.RedisError, LockError) as exc:
                failed += 1
                log_cleanup.error("cleanup.owner-error owner=%s error=%r", owner, exc)
        if not failed:
            ops.channel.command("DEL", self.group_key, self.halt_key)
        log.info(
            "node.stop node=%s inc=%s owners=%d released=%d record_deleted=%s evicted=%s",
            self.nodename,
            self.incarnation,
            len(owners),
            sum(r.released for r in reports),
            bool(int(reply[0])),
            evicted,
        )
        self.clients.close()
        return reports
