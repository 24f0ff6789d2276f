"""Commands sent straight on a held connection, without redis-py's command wrapper.

The engine's own hot commands (its scripts' ``EVALSHA`` and the waiter's
``BLPOP``) go, when the manager holds a connection for the calling thread
(``LockManager._conn``), through :func:`call` instead of
``Redis.execute_command``. What is kept of redis-py: the connection itself
(connect, health check, socket errors mapped to ``ConnectionError`` and
``TimeoutError``, a cut-short read or write disconnects), its reply parser
(RESP2 or RESP3, hiredis when installed) and its retry policy (the client's
``Retry``: a failed attempt disconnects, then the command is sent again, as
redis-py does; a caller may give what a resend sends instead, since a
first send may claim what a resend cannot, such as a token never sent
before). What is skipped: the generic argument encoder (one
``isinstance`` chain per argument), the per-command observability hooks and
option handling, and the response callbacks (none apply to ``EVALSHA``;
``BLPOP``'s only makes a tuple of the pair). On this machine that halves
the client CPU of one script call (docs/benchmarks.md).

Arguments are ``bytes``, ``str`` (encoded with the connection's encoder
settings) or ``int``; anything else goes through the connection's own
encoder, so it is refused or encoded exactly as redis-py would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.connection import AbstractConnection

#: What :func:`call` skips on a connection: the methods ``execute_command``
#: would call to encode and send a command. A class that overrides one of
#: them (to log, trace or rewrite commands) must see every command, so it
#: keeps ``execute_command``.
_BYPASSED = ("send_command", "pack_command")
#: Connection class -> may :func:`call` be used on it (filled on first use).
_DIRECT: dict[type, bool] = {}


def direct(cls: type) -> bool:
    """May :func:`call` be used on connections of class ``cls``?

    Yes for redis-py's own connections (plain, SSL, Unix socket) and for a
    subclass of them that keeps their ``send_command`` and ``pack_command``
    (one that counts or times ``send_packed_command`` or ``read_response``
    still sees every command, since :func:`call` goes through both). No for
    anything else: a client-side cache's proxy connection, or a subclass that
    overrides how commands are encoded or sent.
    """
    ok = _DIRECT.get(cls)
    if ok is None:
        ok = issubclass(cls, AbstractConnection) and all(
            getattr(cls, name) is getattr(AbstractConnection, name) for name in _BYPASSED
        )
        _DIRECT[cls] = ok
    return ok


def pack(conn: Any, head: bytes, args: list[Any] | tuple[Any, ...], extra: int) -> bytes:
    """The RESP array of ``head`` (``extra`` elements already encoded) + ``args``.

    ``head``: the encoded bulk strings of the command name and any constant
    arguments, ``extra`` of them.
    """
    enc = conn.encoder
    encoding, errors = enc.encoding, enc.encoding_errors
    out = [b"*%d\r\n" % (len(args) + extra), head]
    for a in args:
        kind = a.__class__
        if kind is str:
            a = a.encode(encoding, errors)
        elif kind is int:
            a = b"%d" % a
        elif kind is not bytes:
            a = enc.encode(a)
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def bulk(value: str) -> bytes:
    """One RESP bulk string of an ASCII constant (a command name, a SHA)."""
    data = value.encode("ascii")
    return b"$%d\r\n%s\r\n" % (len(data), data)


def call(conn: Any, packed: bytes, again: Callable[[], bytes] | None = None) -> Any:
    """Send ``packed`` on ``conn`` and read its reply, under the connection's
    retry policy (each failed attempt disconnects first, as redis-py does).

    ``again``: makes what a retry sends instead of ``packed`` (a command
    whose first send may claim something a resend no longer can, for
    example that its token was never sent). A reply that is an error is
    raised (``ResponseError`` and its subclasses, as redis-py's parser makes
    them).
    """
    sends = 0

    def attempt() -> Any:
        nonlocal sends
        data = packed if sends == 0 or again is None else again()
        sends += 1
        conn.send_packed_command((data,))
        return conn.read_response()

    try:
        return conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
    finally:
        # A maintenance notice (redis-py 7+) asked for a new connection.
        should = getattr(conn, "should_reconnect", None)
        if should is not None and should():
            conn.disconnect()
            conn.connect()
