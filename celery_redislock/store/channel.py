"""Every round trip the engine makes: held connections, scripts, errors, gates.

A :class:`Channel` is the one way a manager's commands reach Redis. It

- gives each thread (greenlet, forked process) a client holding one
  connection of the pool (skipping the pool's checkout per command) and
  sends the scripts straight on it (:mod:`.wire`);
- maps redis-py's errors: Redis down -> :class:`RedisUnavailable`, refused
  by the ACL -> :class:`PermissionDenied` naming the command;
- runs the two gates of the first call: the eviction-policy check
  (``eviction_check``) and the data-format check (``format.lua``), again
  after Redis may have lost its data.

It knows nothing of locks: which script to run with which keys is the
caller's business.
"""

from __future__ import annotations

import inspect
import logging
import os
import select
import threading
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.sentinel import SentinelConnectionPool

from ..exceptions import (
    ConfigurationError,
    FormatMismatch,
    RedisUnavailable,
    permission_denied,
)
from ..protocol.calls import Protocol, ScriptCall, text
from ..protocol.keys import FORMAT_VERSION
from . import wire
from .checks import EvictionCheck, check_eviction
from .connect import AnyRedis, reset_locks_after_fork
from .scripts import Scripts

__all__ = ["REDIS_DOWN_ERRORS", "Channel", "format_verdict", "socket_timeout", "text"]

log = logging.getLogger("celery_redislock.heartbeat")

#: Errors that mean Redis cannot be reached or cannot serve (reported as
#: RedisUnavailable): a dropped or refused connection, a timeout, and a Redis
#: Cluster that marked itself down (CLUSTERDOWN, e.g. a master lost).
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
)
#: select.poll where the platform has it (not on Windows); see _stale.
_POLL: Any = getattr(select, "poll", None)
#: Encoded ``BLPOP``, the command name of a waiter's wait (:mod:`.wire`).
_BLPOP = wire.bulk("BLPOP")


def _stale(conn: Any) -> bool:
    """Whether a held connection has something to read between two commands
    (a reply nobody read, or the end of a socket the server closed).

    One ``poll`` with no wait on its socket: redis-py's own ``can_read``
    costs three system calls and an exception here. Without ``poll``, or
    without the socket redis-py keeps in ``_sock``, its ``can_read``.
    """
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False  # not connected: the command connects
    if _POLL is None:
        try:
            return bool(conn.can_read())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return True
    try:
        p = _POLL()
        p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True  # an unusable socket: reconnect


def _can_hold(client: Any) -> bool:
    """Whether a thread may hold a connection of ``client``'s pool."""
    return (
        isinstance(client, redis.Redis)
        and not getattr(client, "_single_connection_client", False)
        and not isinstance(
            client.connection_pool, (redis.BlockingConnectionPool, SentinelConnectionPool)
        )
    )


def socket_timeout(client: AnyRedis) -> float | None:
    """The socket timeout the client's connections use (None: no timeout).

    ``Redis.from_url`` leaves ``socket_timeout`` out of the pool's kwargs when
    the URL does not set it, and the connection class's default (5 s in
    redis-py 5+) applies: read that default rather than assume none.
    """
    if isinstance(client, RedisCluster):  # its node pools share these kwargs
        cluster_value = client.nodes_manager.connection_kwargs.get("socket_timeout", 5.0)
        return float(cluster_value) if cluster_value else None
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if "socket_timeout" in kwargs:
        value = kwargs["socket_timeout"]
    else:
        # The first class in the MRO whose __init__ names socket_timeout
        # (Connection and SentinelManagedConnection take **kwargs).
        value = 5.0
        for cls in pool.connection_class.__mro__:
            init = cls.__dict__.get("__init__")
            param = inspect.signature(init).parameters.get("socket_timeout") if init else None
            if param is not None:
                if param.default is not inspect.Parameter.empty:
                    value = param.default
                break
    return float(value) if value else None


@contextmanager
def mapped_errors(url: str, sent: str) -> Iterator[None]:
    """Map redis-py's errors of the block (sync or async): Redis down ->
    :class:`RedisUnavailable`; refused by the ACL -> :class:`PermissionDenied`
    naming ``sent``; any other error as it is."""
    try:
        yield
    except REDIS_DOWN_ERRORS as exc:
        raise RedisUnavailable(url, exc) from exc
    except redis.ResponseError as exc:
        denied = permission_denied(exc, url, sent)
        if denied is None:
            raise
        raise denied from exc


def format_verdict(namespace: str, url: str, found: str | None, how: str) -> int | None:
    """The namespace's data format, or :class:`FormatMismatch` if not ours.

    ``found``: the format read (None: the namespace holds no lock data);
    ``how``: ``'stored'`` (read from ``{ns}:format``), ``'created'`` (just
    written) or ``'unversioned'`` (inferred from data of a release from
    before format versioning).
    """
    if found is None:
        return None
    try:
        version = int(found)
    except ValueError:
        version = -1  # not a number: no release of ours wrote it
    if version != FORMAT_VERSION:
        raise FormatMismatch(namespace, url, version, FORMAT_VERSION, how == "unversioned")
    return version


class Channel:
    """The round trips of one manager (see the module docstring).

    The options it reads (``protocol.options``): ``hold_connection``,
    whether threads may hold a connection of the client's pool (ignored for
    Redis Cluster, Sentinel and ``BlockingConnectionPool`` clients);
    ``eviction_check``, ``"warn"``, ``"raise"`` or ``"ignore"``;
    ``wait_timeout``, for ``WAIT``.
    """

    def __init__(
        self,
        client: AnyRedis,
        url: str,
        protocol: Protocol,
    ) -> None:
        options = protocol.options
        self.client = client
        self.url = url
        self.protocol = protocol
        self.keys = protocol.keys
        self.scripts = Scripts(client)
        self._hold_ok = options.hold_connection and _can_hold(client)
        self._wait_ms = options.wait_ms
        eviction_check = options.eviction_check
        self._eviction_mode = eviction_check
        #: The eviction check is still due (it runs before the first script).
        self._eviction_pending = eviction_check != "ignore"
        #: Set in "raise" mode when Redis may evict: every call is refused.
        self._eviction_refusal: str | None = None
        #: The eviction check found that Redis may evict keys ("warn" mode):
        #: the heartbeat then also verifies that Redis still records each
        #: held grant (a lock hash may be evicted while the liveness stays).
        self.may_evict = False
        #: The data-format check is due: the first script call runs
        #: format.lua first (once; again after Redis lost this owner's data,
        #: which may have taken ``{ns}:format`` with it). See check_format().
        self.format_pending = True
        self._format_lock = threading.Lock()
        #: Per-thread clients holding one connection of the client's pool
        #: (see conn), and every one made, for close().
        self._conn_local = threading.local()
        self._conns: weakref.WeakSet[redis.Redis] = weakref.WeakSet()

    def after_fork_in_child(self) -> None:
        """The parent's held connections and locks are not ours."""
        reset_locks_after_fork(self.client)
        self._format_lock = threading.Lock()
        self._conn_local = threading.local()
        self._conns = weakref.WeakSet()

    @property
    def held_connections(self) -> int:
        """Connections held by threads of this process right now."""
        return len(self._conns)

    def close(self) -> None:
        """Give every held connection back and close the client's pool."""
        for held in list(self._conns):
            held.close()  # its connection back to the pool
        self.client.close()

    # -- connections ------------------------------------------------------

    def conn(self) -> AnyRedis:
        """This thread's client for the manager's own commands.

        A plain ``redis.Redis`` gets, per thread (per greenlet under gevent)
        and per process, a client on the same pool that holds one connection
        (``single_connection_client``): each command then skips the pool's
        checkout and check-in (its locks and bookkeeping), keeping only its
        ``poll`` of the socket (unread data or a connection the server
        closed: reconnect first). The connection goes back to the pool when
        its thread ends or the manager is closed. A Redis Cluster client, a
        ``BlockingConnectionPool`` (whose size a held connection would eat
        into), a Sentinel pool (whose checkout follows a failover to the new
        master) and a client that is already single-connection are used as
        they are; so is the plain client when the connection cannot be made
        (the command then fails the usual way). Call :meth:`done` once the
        command's reply is read.
        """
        client = self.client
        if not self._hold_ok or not isinstance(client, redis.Redis):
            return client
        local = self._conn_local
        held: redis.Redis | None = getattr(local, "client", None)
        if held is not None and local.pid == os.getpid():
            conn = held.connection
            if conn is not None:
                if local.busy:
                    # The last command sent on it was cut short (an exception,
                    # SoftTimeLimitExceeded, a greenlet killed): its reply may
                    # still arrive and must never be read as another's.
                    conn.disconnect()
                else:
                    # The pool's checkout check: unread data, or a socket the
                    # server closed (a restart) -> a new connection, so the
                    # command is not sent into a dead socket.
                    if _stale(conn):
                        conn.disconnect()
            local.busy = True
            return held
        try:
            held = redis.Redis(
                connection_pool=client.connection_pool, single_connection_client=True
            )
        except Exception:  # unreachable: not cached, the next call tries again
            return self.client
        local.client, local.pid, local.busy = held, os.getpid(), True
        self._conns.add(held)
        return held

    def direct(self, c: AnyRedis) -> Any:
        """The connection of ``c``, a client from :meth:`conn`, if commands
        may be sent straight on it (:mod:`.wire`): a held client whose
        connection class is redis-py's own or keeps its way of encoding and
        sending commands (:func:`.wire.direct`). None: send through ``c`` as
        usual."""
        if c is self.client:
            return None
        conn = getattr(c, "connection", None)
        return conn if conn is not None and wire.direct(conn.__class__) else None

    def done(self) -> None:
        """The command sent on this thread's :meth:`conn` client completed."""
        self._conn_local.busy = False

    def cut_short(self) -> bool:
        """Whether this thread's last command may have been sent with its
        reply never read (cut short by an exception, an interrupt, a killed
        greenlet): it may still reach Redis. True when the thread holds no
        connection of its own (nothing tracks it there)."""
        local = self._conn_local
        if getattr(local, "client", None) is None or local.pid != os.getpid():
            return True
        return bool(local.busy)

    def errors(self, sent: str) -> AbstractContextManager[None]:
        """:func:`mapped_errors` for this channel's URL."""
        return mapped_errors(self.url, sent)

    # -- round trips ------------------------------------------------------

    def gates(self, client: Any = None) -> None:
        """The checks due before the first script call (eviction, format)."""
        if self._eviction_pending or self._eviction_refusal is not None:
            self._check_eviction_once()  # first: a refusal must write nothing
        if self.format_pending:
            self.check_format_once(client)

    def call(
        self,
        name: str,
        keys: list[Any],
        args: list[Any],
        client: Any = None,
        *,
        wait: int = 0,
        again: list[Any] | None = None,
    ) -> Any:
        """Run a script (one round trip); ``wait=N``: also ``WAIT N`` in the same pipeline.

        With ``wait`` the answer is ``(script reply, replicas that acknowledged)``.
        ``client``: another client of the same server (the heartbeat's).
        ``again``: arguments for any send that may be a resend. ``args`` then
        go only as the first send on the held connection (:mod:`.wire`, which
        resends ``again``); every other path, whose retries resend what they
        were given, sends ``again``.
        """
        resend = args if again is None else again
        if self._eviction_pending or self._eviction_refusal is not None:
            self._check_eviction_once()  # first: a refusal must write nothing
        if self.format_pending:
            self.check_format_once(client)
        # The hot path: errors mapped inline, not by errors() (a generator).
        try:
            if wait:
                return self.scripts.run_and_wait(name, keys, resend, wait, self._wait_ms)
            if client is not None:
                return self.scripts.run(name, keys, resend, client=client)
            c = self.conn()
            conn = self.direct(c)
            if conn is not None:
                reply = self.scripts.run_direct(conn, c, name, keys, args, again)
            else:
                reply = self.scripts.run(name, keys, resend, client=c)
            self.done()
            return reply
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
        except redis.ResponseError as exc:
            sent = f"EVALSHA {name}" + (" + WAIT" if wait else "")
            denied = permission_denied(exc, self.url, sent)
            if denied is None:
                raise
            raise denied from exc

    def run(self, call: ScriptCall, client: Any = None, *, wait: int = 0) -> Any:
        """:meth:`call` of a :class:`~celery_redislock.protocol.ScriptCall`."""
        return self.call(call.name, call.keys, call.args, client, wait=wait)

    def command(self, name: str, *args: Any) -> Any:
        """Send one plain command on this thread's connection (errors mapped)."""
        with self.errors(name):
            reply = self.conn().execute_command(name, *args)
            self.done()
            return reply

    def blpop(self, keys: list[str], seconds: float) -> Any:
        """``BLPOP keys seconds`` on this thread's connection (errors mapped)."""
        with self.errors("BLPOP"):
            c = self.conn()
            conn = self.direct(c)
            if conn is not None:
                got = wire.call(conn, wire.pack(conn, _BLPOP, (*keys, seconds), 1))
            else:
                got = c.blpop(keys, timeout=seconds)
            self.done()
            return got

    def pipeline(self) -> Any:
        """A non-transactional pipeline of the client (errors not mapped)."""
        return self.client.pipeline(transaction=False)

    # -- gates ------------------------------------------------------------

    def check_format_once(self, client: Any = None) -> None:
        """The data-format check of the first script call (see :meth:`check_format`).

        One round trip per manager (and per process: a forked child inherits
        the parent's result). A refusal or an unreachable Redis leaves it due,
        so every later call checks again until the namespace is usable.
        """
        with self._format_lock:
            if self.format_pending:
                self.check_format(client=client)
                self.format_pending = False

    def check_format(self, *, client: Any = None) -> int:
        """Check that the namespace's lock data has this release's format
        (``LockManager.check_format``)."""
        c = self.client if client is None else client
        call = self.protocol.format()
        with self.errors("EVALSHA format"):
            reply = self.scripts.run(call.name, call.keys, call.args, client=c)
        found = format_verdict(self.keys.namespace, self.url, text(reply[0]), text(reply[1]))
        assert found is not None
        self.format_pending = False  # checked: the next script call need not
        return found

    def _check_eviction_once(self) -> None:
        """The eviction-policy check of the first round trip (``eviction_check``).

        One INFO per manager (not per call); an unreachable Redis leaves it
        due for the next call. ``"raise"`` keeps refusing every later call.
        """
        if self._eviction_refusal is not None:
            raise ConfigurationError("eviction_check", self._eviction_refusal)
        self._eviction_pending = False  # one thread checks; others go on
        try:
            check = self.check_eviction()
        except BaseException:
            self._eviction_pending = True
            raise
        if not check.may_evict:
            return
        self.may_evict = True
        if self._eviction_mode == "raise":
            self._eviction_refusal = f"{check.describe()} (or pass eviction_check='warn')"
            raise ConfigurationError("eviction_check", self._eviction_refusal)
        log.warning("startup.eviction-risk url=%s %s", self.url, check.describe())

    def check_eviction(self) -> EvictionCheck:
        """Whether Redis may evict keys (``maxmemory_policy`` from INFO)."""
        try:
            return check_eviction(self.client)
        except REDIS_DOWN_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc
