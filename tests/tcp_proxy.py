"""A small TCP proxy for tests: forward bytes, or cut every connection.

``TcpProxy(upstream_port)`` listens on a free 127.0.0.1 port and forwards
every connection to ``127.0.0.1:<upstream_port>`` (one thread per
connection, ``select`` on both sockets). ``cut()`` closes every open
connection and the listening socket, so new connections are refused, as
when Redis or a network path goes away; ``restore()`` listens again on the
same port. ``trap(marker)`` holds back the next bytes a client sends that
contain ``marker`` (and whatever that connection sends after them), also
after the client closes the connection, until ``let_go()`` delivers them:
a command that reaches Redis after later commands sent on other
connections, as a proxy or a multi-threaded server may deliver them. Point
a client at ``proxy.url`` to put the proxy in its path.

Imports neither celery nor celery_redislock.
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

LOOPBACK = "127.0.0.1"


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:upstream_port`` until cut."""

    def __init__(self, upstream_port: int, upstream_host: str = LOOPBACK) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        #: Connections accepted so far (tests may wait for a reconnect).
        self.accepted = 0
        self._marker: bytes | None = None
        #: Set when :meth:`trap`'s marker was caught (its bytes held back).
        self.caught = threading.Event()
        #: Set when :meth:`let_go` delivered them and Redis replied.
        self.delivered = threading.Event()
        #: Redis's reply to the trapped bytes (what nobody else reads).
        self.reply = b""
        self._let_go = threading.Event()
        self.restore()

    def trap(self, marker: bytes) -> None:
        """Hold back the next client bytes that contain ``marker`` (once)."""
        with self._lock:
            self._marker = marker
        self.caught.clear()
        self.delivered.clear()
        self._let_go.clear()

    def let_go(self, timeout: float = 30.0) -> None:
        """Deliver the trapped bytes to Redis and wait for its reply."""
        self._let_go.set()
        if not self.delivered.wait(timeout):
            raise TimeoutError("the trapped bytes were not delivered")

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def restore(self) -> None:
        """Listen (again, on the same port): connections are forwarded."""
        with self._lock:
            if self._listener is not None:
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, self.port))
            sock.listen(64)
            self.port = sock.getsockname()[1]
            self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def cut(self) -> None:
        """Close every connection and stop listening: new ones are refused."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            _close(listener)
        for conn in conns:
            _close(conn)

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut meanwhile
                    _close(client)
                    _close(upstream)
                    return
                self._conns.update((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 0.5)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is a and self._caught(data):
                        self._hold(a, b, [data])
                        return
                    peers[sock].sendall(data)
                with self._lock:
                    if a not in self._conns:
                        return
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(a)
                self._conns.discard(b)
            _close(a)
            _close(b)

    def _caught(self, data: bytes) -> bool:
        with self._lock:
            if self._marker is None or self._marker not in data:
                return False
            self._marker = None
        self.caught.set()
        return True

    def _hold(self, client: socket.socket, upstream: socket.socket, held: list[bytes]) -> None:
        """Keep what the client sends (until it closes) until let go, then
        deliver it and read Redis's reply (nobody is left to read it)."""
        open_ = True
        while not self._let_go.wait(0.02):
            if not open_:
                continue
            readable, _, _ = select.select([client], [], [], 0)
            if readable:
                data = client.recv(65536)
                if data:
                    held.append(data)
                else:
                    open_ = False
        upstream.sendall(b"".join(held))
        upstream.settimeout(10)
        self.reply = upstream.recv(65536)
        self.delivered.set()


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
