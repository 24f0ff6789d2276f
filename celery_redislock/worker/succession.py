"""Who owns a node record: claiming it, watching another's, evicting a stale one.

A worker node's record ``{ns}:node:<nodename>`` names the incarnation that
beats it. :class:`Succession` claims the record at start (``node_start``),
watches another incarnation's record from tick to tick (a record whose
heartbeat advances under the same incarnation is a live duplicate: never
evicted), and evicts a predecessor whose heartbeat stopped for two
intervals (``node_evict``: compare-and-set on the heartbeat it saw, then a
tombstone), freeing its owners' locks. docs/worker.md has the race
analysis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import redis

from ..engine.manager import LockManager
from ..exceptions import LockError
from ..protocol import calls as calls
from ..protocol.keys import group_key, node_key, text
from ..protocol.reports import CleanupReport
from .clients import NodeClients

if TYPE_CHECKING:
    from .node import TickResult

log = logging.getLogger("celery_redislock.node")
log_cleanup = logging.getLogger("celery_redislock.cleanup")


class Succession:
    """The node record's side of a :class:`~celery_redislock.worker.node.Node`.

    Args:
        manager: the worker's manager (its metrics hook counts the owners
            an eviction frees).
        clients: the node's own clients; every round trip goes through them.
        nodename: the node name whose record this is.
        record_args: the ``pid``, ``host`` and ``started`` fields a claim
            writes into the record.
        set_state: sets the node's state (``owner``, ``watching``,
            ``duplicate``) at the moment the record's fate is known.
        iv_ms, ttl_ms, record_ttl_ms: the heartbeat interval, the owner TTL
            and the record's TTL, in milliseconds.
        fast_restart_cleanup: evict a stale predecessor at once (True) or
            only once its owners would have expired (False, ``takeover``).

    Owns what it saw of another incarnation's record (``(inc, hb)``) and
    which duplicate it already reported; the node keeps its state, which
    this part sets through ``set_state``.
    """

    def __init__(
        self,
        manager: LockManager,
        clients: NodeClients,
        nodename: str,
        record_args: Callable[[], list[str]],
        set_state: Callable[[str], None],
        *,
        iv_ms: int,
        ttl_ms: int,
        record_ttl_ms: int,
        fast_restart_cleanup: bool,
    ) -> None:
        self.manager, self.clients, self.nodename = manager, clients, nodename
        self.prefix = manager.keys.prefix
        self.node_key = node_key(self.prefix, nodename)
        self.record_args, self.set_state = record_args, set_state
        #: Milliseconds: the heartbeat interval, the owner TTL, the record's TTL.
        self.iv_ms, self.ttl_ms, self.record_ttl_ms = iv_ms, ttl_ms, record_ttl_ms
        self.fast_restart_cleanup = fast_restart_cleanup
        #: (inc, hb) of the other incarnation's record we watch.
        self._seen: tuple[str, str] | None = None
        self._duplicate_logged: str | None = None

    def forget(self) -> None:
        """The record is ours (or gone with our state): stop watching."""
        self._seen = None

    def claim(self, incarnation: str) -> None:
        """Claim the record for ``incarnation`` (one round trip, no SCAN).

        The node becomes ``owner`` for a brand-new record or one already
        ours (or a predecessor whose heartbeat was already stale, evicted
        right here), else ``watching``. Raises
        :class:`~celery_redislock.exceptions.RedisUnavailable`.
        """
        reply = self.clients.run(
            calls.node_start(
                self.node_key,
                incarnation,
                self.record_args(),
                self.iv_ms,
                self.record_ttl_ms,
            )
        )
        kind = text(reply[0])
        if kind in ("new", "ours"):
            self.set_state("owner")
            log.info("node.start node=%s inc=%s predecessor=none", self.nodename, incarnation)
            return
        inc, hb, hb_ms, iv, now = (text(x) for x in reply[1:6])
        self.set_state("watching")
        self._seen = (inc, hb)
        log.info(
            "node.start node=%s inc=%s predecessor=%s last_beat_ms_ago=%d",
            self.nodename,
            incarnation,
            inc,
            int(now) - int(hb_ms),
        )
        self.decide(inc, hb, int(hb_ms), int(iv), int(now), incarnation, None)

    def decide(
        self,
        inc: str,
        hb: str,
        hb_ms: int,
        iv: int,
        now: int,
        incarnation: str,
        result: TickResult | None,
    ) -> None:
        """Given another incarnation's record, decide: wait, duplicate or evict.

        An eviction notes the predecessor and its clean-up in ``result``.
        """
        if not inc:
            # The record vanished (expired or deleted): claim it afresh.
            self._seen = None
            self.claim(incarnation)
            return
        seen = self._seen
        if seen is not None and seen != (inc, hb):
            if seen[0] == inc:
                self.set_state("duplicate")
                if self._duplicate_logged != inc:
                    self._duplicate_logged = inc
                    log.error(
                        "node.duplicate node=%s inc=%s other=%s: another live worker uses "
                        "this node name; its locks are never freed by us. Give every "
                        "worker a unique name (-n name@%%h)",
                        self.nodename,
                        incarnation,
                        inc,
                    )
            else:
                self.set_state("watching")
        self._seen = (inc, hb)
        threshold = 2 * max(iv, self.iv_ms)
        fast = self.fast_restart_cleanup
        if not fast:
            threshold = max(threshold, self.ttl_ms + self.iv_ms)
        if now - hb_ms < threshold:
            return
        self._evict(inc, hb, threshold, "evict" if fast else "takeover", incarnation, result)

    def _evict(
        self,
        inc: str,
        hb: str,
        threshold: int,
        mode: str,
        incarnation: str,
        result: TickResult | None,
    ) -> None:
        """Evict ``inc`` if its heartbeat is still ``hb`` and stale: the
        record becomes ours, then its owners are freed."""
        reply = self.clients.run(
            calls.node_evict(
                self.prefix,
                self.node_key,
                inc,
                hb,
                threshold,
                mode,
                incarnation,
                self.record_args(),
                self.iv_ms,
                self.record_ttl_ms,
                self.ttl_ms,
            )
        )
        kind = text(reply[0])
        if kind == "changed":
            log.info(
                "node.evict-refused node=%s predecessor=%s reason=heartbeat-advanced",
                self.nodename,
                inc,
            )
            return
        if kind == "not-yet":
            return
        owners = [text(o) for o in reply[1]]
        self.set_state("owner")
        self._seen = None
        if result is not None:
            result.predecessor = inc
        log.warning(
            "node.evicted-predecessor node=%s predecessor=%s owners=%d mode=%s",
            self.nodename,
            inc,
            len(owners),
            mode,
        )
        ops = self.clients.ops()
        failed = 0
        reports: list[CleanupReport] = []
        for owner in owners:
            try:
                reports.append(ops.cleanup_owner(owner, force=(mode == "evict")))
            except (redis.RedisError, LockError) as exc:
                failed += 1
                log_cleanup.error(
                    "cleanup.owner-error owner=%s predecessor=%s error=%r", owner, inc, exc
                )
        if result is not None:
            result.cleaned.extend(reports)
        freed = sum(1 for r in reports if r.status != "alive")
        if self.manager.metrics is not None and freed:
            self.manager.metrics.cleaned("startup", freed)
        if not failed and all(r.status != "alive" for r in reports):
            ops.channel.command("DEL", group_key(self.prefix, inc))
