"""The acquire loop: one request from its first script run to a lease.

:class:`Acquirer` runs acquire.lua for a request (:meth:`Acquirer.attempt`,
one round trip), then, while the request is queued, blocks on its wake list
until a release hands it the locks (``g<fence>``) or it must look again,
riding out short Redis outages (:mod:`.outage`) and giving way to a worker's
shutdown when its context is haltable (:mod:`.context`). With
``wait_replicas`` every grant is confirmed by ``WAIT``. Whatever ends the
call, the request's grant or queue entries are released by its own token
before the exception leaves (:meth:`Acquirer.acquire`).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from .. import _validate as _v
from ..exceptions import (
    LockError,
    LockTimeout,
    RedisUnavailable,
    ShuttingDown,
)
from ..protocol.calls import acquire_reclaimed, acquire_transit, mode_refusal, resend, text
from ..protocol.options import MIN_BLOCK
from ..protocol.reentry import check_nested
from ..protocol.replicas import replication_short
from ..protocol.request import Limits, Request, RequestCache, ResourceNames
from ..store.channel import REDIS_DOWN_ERRORS
from .context import AcquireContext, ContextStack
from .identity import OwnerIdentity, new_request_id
from .lease import Lease
from .liveness import Liveness
from .outage import Outage, riding_out
from .reentry import Reentry, plan
from .release import Releaser
from .shared import Part, Shared
from .state import Depth
from .watcher import LostWatcher

__all__ = ["TRANSIT_WAKE", "Acquirer", "RequestMoved"]

log = logging.getLogger("celery_redislock.acquire")

#: What :meth:`Acquirer.block` returns for a ``t`` on the wake list
#: (``defer_nudge.lua``): a grant in transit to a parked task waits for a
#: pool slot ahead of this request (docs/defer.md, "Waiting tasks behind a
#: grant in transit").
TRANSIT_WAKE = -2


class RequestMoved(Exception):
    """Raised by :meth:`LockManager.acquire` when the thread's
    ``take_over`` hook (set by ``@locked`` around a task's own wait) took the
    queued request over: it waits on as a parked task's request, in its
    place (docs/defer.md, "Waiting tasks behind a grant in transit").
    Nothing of the acquire's own token is left to release. ``behind``: the
    task id of the grant in transit named by the script's reply ('' when a
    nudge told it)."""

    def __init__(self, resources: Iterable[str], behind: str) -> None:
        self.resources = tuple(resources)
        self.behind = behind
        super().__init__(self.resources, behind)


class _Try:
    """The state of one acquire call while it loops (see :meth:`Acquirer.acquire`)."""

    __slots__ = (
        "answered",
        "began",
        "deadline",
        "depth",
        "first",
        "ident",
        "in_flight",
        "nested",
        "outage",
        "reply",
        "req",
        "request_id",
        "take_over",
        "timeout",
        "token",
        "told_transit",
    )

    def __init__(
        self,
        req: Request,
        depth: Depth,
        ident: OwnerIdentity,
        request_id: str | None,
        timeout: float | None,
        nested: bool,
        take_over: Callable[[str, Request], bool] | None,
        owner_ttl: float,
    ) -> None:
        self.req = req
        self.depth = depth
        self.timeout = timeout
        self.nested = nested
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.take_over = take_over
        self.told_transit = False  # woken by defer_nudge.lua since the last script run
        # A request id made here gives a token never sent before: its first
        # script run may skip the look for an earlier grant or queue entry
        # (acquire.lua flag 'f'; a resend never carries it).
        self.first = request_id is None
        self.request_id = request_id or new_request_id()
        self.began = time.monotonic()
        self.ident = ident
        self.token = f"{ident.owner_id}|{self.request_id}"
        self.outage = Outage(self.deadline, owner_ttl)
        # Whether Redis ever answered this request's script: until it has, the
        # request is at most possibly there (a script sent as the connection
        # broke), and its clean-up after a failure is not worth a warning.
        self.answered = False
        # A script call of this request was sent and its reply never read
        # (cut short by an interrupt): it may still reach Redis later.
        self.in_flight = False
        self.reply: Any = None

    def renew(self, ident: OwnerIdentity, request_id: str | None = None) -> None:
        """Ask again as ``ident`` (and, if given, under a new request id)."""
        self.ident = ident
        if request_id is not None:
            self.request_id = request_id
        self.token = f"{ident.owner_id}|{self.request_id}"
        self.reply = None


class Acquirer(Part):
    """Acquire requests of this process (the engine's ``acquire``)."""

    def __init__(
        self,
        core: Shared,
        liveness: Liveness,
        releaser: Releaser,
        watcher: LostWatcher,
        requests: RequestCache,
        context: ContextStack,
    ) -> None:
        super().__init__(core)
        self._liveness = liveness
        self._releaser = releaser
        self._watcher = watcher
        self._requests = requests
        self._context = context
        #: Worker mode: ``{ns}:halt:<inc>``, the list the worker's main
        #: process pushes to when it begins shutting down. Waiters block on
        #: it next to their wake list (same BLPOP) and give up with
        #: ShuttingDown. ``halted``: this process has seen it. Only acquires
        #: made in a ``haltable`` context (``@locked``'s wait) are halted.
        self.halt_key: str | None = None
        self.halted = False

    def after_fork_in_child(self) -> None:
        """A forked child has not seen the halt list."""
        self.halted = False

    def closed_error(self, closed_now: bool = False) -> LockError:
        """The error of a call on a closed manager."""
        if closed_now:
            return LockError(f"this LockManager ({self._channel.url}) was closed")
        return LockError(f"this LockManager ({self._channel.url}) is closed: make a new one")

    def start_liveness(self) -> OwnerIdentity:
        """The current identity, with its heartbeat or lost-owner watcher running."""
        ident = self._liveness.identity.current()
        if self._liveness.own_heartbeat:
            self._liveness.heartbeat.ensure_started()
        else:
            self._watcher.ensure()
        return ident

    # -- acquire ----------------------------------------------------------

    def acquire(
        self,
        exclusive: ResourceNames,
        shared: ResourceNames,
        timeout: float | None,
        nested: bool | None,
        limited: Limits = None,
    ) -> Lease:
        """``LockManager.acquire`` (see its docstring for the contract)."""
        req = self._requests.get(exclusive, shared, limited)
        if self._core.closed:
            raise self.closed_error()
        timeout = _v.seconds("timeout", timeout, allow_none=True, allow_inf=True)
        if timeout is not None and math.isinf(timeout):
            timeout = None
        nested = _v.optional_flag("nested", nested)
        depth = self._state.depth()
        if depth.leases and nested is not False:
            reentry = plan(self._state, depth, req)
            if reentry is not None:
                return self._reenter(depth, req, reentry, timeout, nested)
        if nested is None:
            nested = depth.count > 0
        check_nested(nested, timeout)
        ctx = self._context.current()
        # A @locked task's own wait may turn into a park in its place when a
        # grant in transit waits ahead of it (docs/defer.md, T3): the hook
        # takes the queued request over and returns True, or returns False
        # (the request is left as it was: keep waiting).
        take_over = None if nested else ctx.take_over
        # A task's own request id (``task:<id>``, set by UniqueTask around
        # the call) makes the grant name its task, like acquire_for_task's.
        ident = self.start_liveness()
        t = _Try(
            req, depth, ident, ctx.request_id, timeout, nested, take_over, self._options.owner_ttl
        )
        try:
            return self._loop(t, ctx)
        except RequestMoved:
            raise  # the request is a task owner's now: nothing of this token is left
        except BaseException as exc:
            self._abandon(t, ctx, exc)
            raise

    def _loop(self, t: _Try, ctx: AcquireContext) -> Lease:
        """Run the script until granted; wait while queued."""
        # Only a task's own lock wait (@locked, before its body) gives way to a
        # worker shutdown; a body's later or nested acquire is never cut short.
        haltable = not t.nested and ctx.haltable
        block_call = functools.partial(self.block, halt=True) if haltable else self.block
        # Who holds it, only when a Celery task acquires (@locked sets it).
        holder = ctx.holder or ""
        while True:
            if self._core.closed:
                raise self.closed_error(closed_now=True)
            if t.reply is None:
                started = time.monotonic()
                t.in_flight = True
                t.reply = riding_out(
                    t.outage,
                    t.token,
                    self.attempt,
                    t.ident,
                    t.token,
                    t.req,
                    t.timeout != 0,
                    t.nested,
                    holder,
                    t.first,
                )
                t.first = False
                t.in_flight = False
                if t.reply is None:  # Redis failed; backed off: run the attempt again
                    continue
                t.answered = True
                # Past step 1 the script refreshed our liveness: a confirmed
                # refresh, unless our local deadline had already passed.
                if int(t.reply[0]) != -1 and not self._liveness.confirm(
                    t.ident, started, self._options.owner_ttl
                ):
                    self._liveness.owner_lost(t.ident, "deadline")
            code = int(t.reply[0])
            if code == 1:
                lease = self._granted(t, haltable, block_call)
                if lease is not None:
                    return lease
                if t.reply is None:
                    continue  # asked again (replicas short, or a ridden-out failure)
                retired = True
            else:
                retired = code == 0 and self._liveness.identity.peek() is not t.ident
            if retired:
                self._re_request(t)
                continue
            if code == -2:
                t.ident.registered = True  # the script's step 1 ran: registered
                raise mode_refusal(t.reply)
            if code == -1:
                self._liveness.owner_lost(t.ident, "acquire")
                t.renew(self._liveness.identity.current())
                continue
            t.ident.registered = True
            self._wait(t, haltable, block_call)

    def _granted(
        self, t: _Try, haltable: bool, block_call: Callable[..., int | None]
    ) -> Lease | None:
        """The script granted the request: the lease, or None when the grant
        is not returned (``t.reply`` None: ask again; else: retired)."""
        t.ident.registered = True
        if self._options.wait_replicas:
            acked = self._replicas_acked(t.outage, t.token, t.reply)
            if acked is None:  # Redis failed; backed off: run the attempt again
                t.reply = None
                return None
            if acked < self._options.wait_replicas:
                t.renew(t.ident, self._replication_short(t, acked))
                # Never granted, never blocked: look at the halt list
                # here, or a warm shutdown would wait for the replicas.
                if haltable and (
                    self.halted or riding_out(t.outage, t.token, block_call, t.token, 0.0) == -1
                ):
                    raise ShuttingDown(t.req.resources)
                return None
        # Granted by the script call that replied (not a hand-off, not a retry
        # finding an earlier grant): its release has no request keys to delete
        # (a holder record is a registry value).
        lease = Lease(
            self._releaser,
            t.req,
            t.ident,
            t.token,
            int(t.reply[1]),
            t.depth,
            clean=len(t.reply) > 2 and not self._options.wait_replicas,
        )
        # Kept only while its identity is current (checked under the lock that
        # owner_lost takes to mark leases lost): a grant made to a retired
        # identity, e.g. handed off just as a cleanup declared the owner dead,
        # is never returned.
        with self._state.lock:
            current = self._liveness.identity.peek() is t.ident and not self._core.closed
            if current:
                # Counted last: an interrupt before this must not leave
                # the thread looking nested (it would skip the queue).
                self._state.leases[t.token] = lease
                lease.count_in(t.depth)
        if not current:
            return None
        hook = self._telemetry.hook
        if hook is not None:
            hook.acquired(time.monotonic() - t.began, "granted")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "acquire.granted owner=%s resources=%s fence=%s",
                t.ident.owner_id,
                ",".join(t.req.resources),
                lease.fencing_token,
            )
        return lease

    def _re_request(self, t: _Try) -> None:
        """Granted or queued under an identity that was retired meanwhile (or
        the manager was closed): end that request, ask again as the current
        identity."""
        self._releaser.end_request(t.ident.owner_id, t.token, t.req)
        if self._core.closed:
            raise self.closed_error(closed_now=True)
        t.renew(self._liveness.identity.current())
        log.warning(
            "acquire.re-request resources=%s owner=%s: granted or queued under "
            "an identity declared dead meanwhile; released and asked again",
            ",".join(t.req.resources),
            t.ident.owner_id,
        )

    def _wait(self, t: _Try, haltable: bool, block_call: Callable[..., int | None]) -> None:
        """Queued: block until handed the locks (``t.reply`` set) or told to look again."""
        req, timeout = t.req, t.timeout
        if timeout == 0:
            raise LockTimeout(req.resources, timeout)
        remaining = math.inf if t.deadline is None else t.deadline - time.monotonic()
        if remaining <= 0:
            raise LockTimeout(req.resources, timeout)
        if haltable and self.halted:
            raise ShuttingDown(req.resources)
        transit = acquire_transit(t.reply)
        if t.take_over is not None and (transit or t.told_transit):
            # Blocked behind a grant in transit: give the slot up.
            if t.take_over(t.token, req):
                raise RequestMoved(req.resources, transit)
            t.take_over = None  # not taken over: wait as before
        t.told_transit = False
        # The blocking owner's PTTL, the caps, and a third of owner_ttl kept
        # before the local deadline (a pool child's watcher confirms within
        # owner_ttl / 4): EngineOptions.wait_bound.
        block = self._options.wait_bound(
            remaining, int(t.reply[1]), t.ident.valid_until - time.monotonic()
        )
        # A release that finds us at the head hands us the locks and pushes
        # 'g<fence>': granted without another round trip. Anything else (a
        # plain wake, a timeout) re-runs the script, which re-checks the state
        # in Redis.
        self._state.waiting.add(t.token)  # the lost-owner watcher watches while we wait
        try:
            fence = riding_out(t.outage, t.token, block_call, t.token, block)
        finally:
            self._state.waiting.discard(t.token)
        if fence == -1:
            raise ShuttingDown(req.resources)
        t.told_transit = fence == TRANSIT_WAKE
        t.reply = None if fence is None or t.told_transit else (1, fence)

    def _abandon(self, t: _Try, ctx: AcquireContext, exc: BaseException) -> None:
        """The call ends without a lease: release or dequeue its request."""
        with self._state.lock:
            gone = self._state.leases.pop(t.token, None)
            if gone is not None:  # interrupted at the return
                t.depth.count = max(0, t.depth.count - 1)
                gone.uncount()
        # Read before the release below sends on this thread's connection.
        cut_short = t.in_flight and self._channel.cut_short()
        self._releaser.end_request(t.ident.owner_id, t.token, t.req, quiet=not t.answered)
        if cut_short:
            # The cut-short script may reach Redis after that release.
            self._releaser.release_again(t.token, t.req)
        hook = self._telemetry.hook
        if hook is not None and isinstance(exc, Exception):
            outcome = "timeout" if isinstance(exc, LockTimeout) else "error"
            # A deferred task's first try (``parking``): busy is not a
            # timeout; the park that follows tells its outcome.
            if outcome != "timeout" or not ctx.parking:
                hook.acquired(time.monotonic() - t.began, outcome)
        if self._core.closed and isinstance(exc, Exception) and not isinstance(exc, LockError):
            # close() shut the connection under a waiting thread
            raise self.closed_error(closed_now=True) from exc

    def _reenter(
        self,
        depth: Depth,
        req: Request,
        reentry: Reentry,
        timeout: float | None,
        nested: bool | None,
    ) -> Lease:
        """A nested acquire re-entering outer leases (see ``LockManager.acquire``)."""
        parents, rest_ex, rest_sh, rest_lim = reentry
        if rest_ex or rest_sh or rest_lim:
            # The resources not held yet: a nested acquire of their own
            # (waits only for holders; a finite timeout is required).
            lease = self.acquire(rest_ex, rest_sh, timeout, nested, rest_lim or None)
            try:
                with self._state.lock:
                    lease.share(parents)
                lease.exclusive = req.exclusive
                lease.shared = req.shared
                lease.limited = req.limit_map
            except BaseException:
                lease.release()
                raise
            return lease
        first = parents[0]
        lease = Lease(
            self._releaser,
            req,
            first.ident,
            first.token,
            max(p.fencing_token for p in parents),
            depth,
            own=False,
        )
        with self._state.lock:
            lease.share(parents)
            depth.count += 1
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "acquire.reentrant owner=%s resources=%s fence=%s",
                lease.owner_id,
                ",".join(req.resources),
                lease.fencing_token,
            )
        return lease

    # -- one round trip ---------------------------------------------------

    def attempt(
        self,
        ident: OwnerIdentity,
        token: str,
        req: Request,
        queue: bool,
        nested: bool,
        holder: str | None = None,
        first: bool = False,
    ) -> Any:
        """One run of acquire.lua for ``token``; ``holder``: the holder record
        (None: the thread's context's); ``first``: the token was never sent
        (flag 'f', on the first send only)."""
        # WAIT goes in a pipeline that redis-py may resend as it is: never 'f'.
        first = first and not self._options.wait_replicas
        group = None
        if not ident.registered:
            make_group = self._liveness.group
            group = make_group() if make_group is not None else None
        if holder is None:
            holder = self._context.current().holder or ""
        call = self._protocol.acquire(
            token,
            req,
            queue=queue,
            nested=nested,
            liveness_ms=self._options.ttl_arg,  # every attempt refreshes the liveness (step 1)
            # Registering (non-empty) or not; not built on every attempt.
            register="" if ident.registered else ident.describe(self._options.name),
            group=group,
            tag=ident.tag if group is not None else "",
            holder=holder,
            listed=ident.listed,
            spill=self._state.spill(ident.owner_id),
            first=first,
        )
        if self._options.wait_replicas:
            reply = self._call_and_wait(call.keys, call.args)
        else:
            # Any resend (a retry after the reply was lost) must look.
            again = resend(call) if first else None
            reply = self._channel.call("acquire", call.keys, call.args, again=again)
            if self._telemetry.hook is not None:
                self.note_reclaimed(reply)
        code = int(reply[0])
        if code == 1 or (code == 0 and queue):
            ident.listed = True  # the script added it to {ns}:owners
        return reply

    def note_reclaimed(self, reply: Any) -> None:
        """Count the dead holders' grants an acquire reply says it freed."""
        hook = self._telemetry.hook
        if hook is not None:
            freed = acquire_reclaimed(reply)
            if freed:
                hook.cleaned("reclaim", freed)

    def block(self, token: str, seconds: float, halt: bool = False) -> int | None:
        """Wait for a push to the request's wake list; the fence of a hand-off.

        With ``halt`` (``@locked``'s wait in a worker), the same BLPOP also
        watches the worker's halt list: popped, its entry is pushed back for
        the next waiter and -1 is returned (shutting down). A ``t`` (a grant
        in transit waits ahead, ``defer_nudge.lua``) returns :data:`TRANSIT_WAKE`.
        ``seconds`` below :data:`MIN_BLOCK` wait that long.
        """
        seconds = max(seconds, MIN_BLOCK)
        keys = [self.keys.wake(token)]
        halt_key = self.halt_key if halt else None
        if halt_key is not None:
            keys.append(halt_key)
        got = self._channel.blpop(keys, seconds)
        if got is not None and halt_key is not None and text(got[0]) == halt_key:
            self.halted = True
            with self._channel.errors("BLPOP"):
                pipe = self._channel.pipeline()
                pipe.rpush(halt_key, got[1])
                pipe.pexpire(halt_key, self._options.req_ttl_ms)
                pipe.execute()
            return -1
        if got is None:
            return None
        msg = text(got[1])
        if msg == "t":
            return TRANSIT_WAKE
        return int(msg[1:]) if msg.startswith("g") else None

    # -- replica acknowledgement (wait_replicas) --------------------------

    def _call_and_wait(self, keys: list[Any], args: list[Any]) -> Any:
        """Run acquire.lua and ``WAIT`` in one round trip; a grant's reply gains the count.

        ``{1, fence, ...}`` becomes ``[1, fence, replicas that acknowledged]``;
        any other reply is returned as it is.
        """
        reply, acked = self._channel.call("acquire", keys, args, wait=self._options.wait_replicas)
        self.note_reclaimed(reply)
        if int(reply[0]) == 1:
            return [reply[0], reply[1], acked]
        return reply

    def _wait_now(self) -> int:
        """``WAIT`` for a grant made by another client (a hand-off); one round trip.

        ``WAIT`` counts the replicas that have every write made before the
        *connection's* last command; the grant was written before the push
        this waiter popped, but a pooled connection (or one whose BLPOP was
        served while blocked, Redis 6.2) may have an older offset: the PING
        sent first in the same pipeline moves it to now.
        """
        try:
            pipe = self._channel.pipeline()
            pipe.ping()
            pipe.execute_command("WAIT", self._options.wait_replicas, self._options.wait_ms)
            return int(pipe.execute()[1])
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self._channel.url, exc) from exc

    def _replicas_acked(self, outage: Outage, token: str, reply: Any) -> int | None:
        """How many replicas acknowledged a grant; None after a ridden-out failure."""
        if len(reply) > 2:  # counted in the script's round trip
            return int(reply[2])
        acked: int | None = riding_out(outage, token, self._wait_now)
        return acked

    def _replication_short(self, t: _Try, acked: int) -> str:
        """Too few replicas acknowledged the grant of ``t.token``: release it.

        ``wait_policy="fail"`` (or no time left) raises ReplicationTimeout
        (the acquire's exit path releases the grant); ``"retry"`` releases it
        here and returns a new request id to ask again with.
        """
        replication_short(self._options, t.token, t.req, t.timeout, t.deadline, acked)
        self._releaser.end_request(t.ident.owner_id, t.token, t.req)
        return new_request_id()
