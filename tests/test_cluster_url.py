"""The ``redis+cluster://`` URL form, parsed and refused without a server.

What an operator relies on: the setting accepts every documented form and
shows it in canonical form; a malformed URL (no node, a bad port, a
database other than 0, an unknown or misplaced option) is refused with a
ConfigurationError naming the setting and the problem, never the password.
The CLI on a cluster nobody answers is here too. The real-cluster side (RedisLock, the CLI, a prefork worker) is in
tests/test_cluster.py and tests/e2e/test_cluster_e2e.py.
"""

from __future__ import annotations

import pytest

from celery_redislock.exceptions import ConfigurationError
from celery_redislock.integration.settings import load_config
from celery_redislock.store.connect import (
    CLUSTER_OPTIONS,
    parse_cluster_url,
    validate_url,
)

PW = "s3cr@t:/pw"
ENC = "s3cr%40t%3A%2Fpw"


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("redis+cluster://h1:7000,h2:7001/", "redis+cluster://h1:7000,h2:7001/"),
        ("redis+cluster://h1", "redis+cluster://h1:6379/"),
        ("REDIS+CLUSTER://h1:7000/0", "redis+cluster://h1:7000/"),
        ("redis+cluster://[::1]:7000,h2/", "redis+cluster://[::1]:7000,h2:6379/"),
        (
            "rediss+cluster://u@h1:7000/?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem",
            "rediss+cluster://u@h1:7000/?ssl_ca_certs=%2Fca.pem&ssl_cert_reqs=required",
        ),
        (
            "redis+cluster://h1/?socket_timeout=2.5&db=0&max_connections=50&client_name=w1",
            "redis+cluster://h1:6379/?client_name=w1&max_connections=50&socket_timeout=2.5",
        ),
    ],
)
def test_valid_cluster_urls_are_accepted_in_canonical_form(url: str, canonical: str) -> None:
    assert validate_url(url, setting="redislock_url") == canonical


def test_credentials_are_read_kept_and_masked() -> None:
    url = f"rediss+cluster://app:{ENC}@h1:7000,h2:7000/?socket_connect_timeout=1"
    spec = parse_cluster_url(url)
    assert (spec.username, spec.password, spec.tls) == ("app", PW, True)
    assert spec.nodes == (("h1", 7000), ("h2", 7000))
    kwargs = spec.client_kwargs()
    assert kwargs["password"] == PW and kwargs["ssl"] is True
    assert kwargs["socket_connect_timeout"] == 1.0
    assert parse_cluster_url(spec.to_url()) == spec  # round trip
    shown = spec.to_url(redacted=True)
    assert shown.startswith("rediss+cluster://app:***@h1:7000") and "s3cr" not in shown


def test_a_password_with_unencoded_at_and_colon_is_read_to_the_last_at() -> None:
    spec = parse_cluster_url("redis+cluster://:p@ss:w@h1:7000/")
    assert (spec.username, spec.password, spec.nodes) == (None, "p@ss:w", (("h1", 7000),))


def test_load_config_accepts_a_cluster_url_for_redislock_url() -> None:
    cfg = load_config({"redislock_url": f"redis+cluster://:{ENC}@h1:7000,h2/"})
    assert cfg.url == f"redis+cluster://:{ENC}@h1:7000,h2:6379/"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis+cluster://", "names no cluster node"),
        ("redis+cluster:///0", "names no cluster node"),
        (f"redis+cluster://u:{ENC}@/", "names no cluster node"),
        ("redis+cluster://h1:7000,,h2/", "a cluster node address is empty"),
        ("redis+cluster://:7000/", "a cluster node address has no host"),
        ("redis+cluster://h1:port/", "cluster node port 'port' is not a port number"),
        ("redis+cluster://h1:0/", "is not a port number (1-65535)"),
        ("redis+cluster://h1:65536/", "is not a port number (1-65535)"),
        ("redis+cluster://h1:７０００/", "is not a port number"),
        ("redis+cluster://[::1:7000/", "unclosed '['"),
        ("redis+cluster://h1/1", "only database 0, not '1'"),
        ("redis+cluster://h1/abc", "must be a non-negative integer"),
        ("redis+cluster://h1/0/x", "path must be empty or /0"),
        ("redis+cluster://h1/?db=2", "only database 0, not db='2'"),
        ("redis+cluster://h1/?db=x", "only database 0"),
        ("redis+cluster://h1/?protocol=3", "unknown or unsupported cluster option 'protocol'"),
        ("redis+cluster://h1/?password=x", "unknown or unsupported cluster option 'password'"),
        ("redis+cluster://h1/?socket_timeout", "has no value"),
        ("redis+cluster://h1/?socket_timeout=1&socket_timeout=2", "given twice"),
        ("redis+cluster://h1/?socket_timeout=0", "socket_timeout must be a positive number"),
        ("redis+cluster://h1/?socket_timeout=-1", "socket_timeout must be a positive number"),
        ("redis+cluster://h1/?socket_timeout=nan", "socket_timeout must be a positive number"),
        ("redis+cluster://h1/?socket_timeout=inf", "below 86400"),
        ("redis+cluster://h1/?health_check_interval=5", "unknown or unsupported cluster option"),
        ("redis+cluster://h1/?max_connections=0", "max_connections must be an integer from 1"),
        ("redis+cluster://h1/?max_connections=1.5", "max_connections must be an integer"),
        ("redis+cluster://h1/?client_name=a%20b", "client_name must be 1-128 printable"),
        ("redis+cluster://h1/?require_full_coverage=maybe", "must be true or false"),
        ("redis+cluster://h1/?ssl_cert_reqs=required", "need TLS: use rediss+cluster://"),
        ("rediss+cluster://h1/?ssl_cert_reqs=always", "ssl_cert_reqs must be one of"),
        ("redis+cluster://h1/0;redis+cluster://h2/0", "with ',' (one URL), not ';'"),
        ("redis+cluster://h1/\n", "control characters or surrounding whitespace"),
        ("cluster://h1:7000/", "must be a redis://"),
    ],
)
def test_malformed_cluster_urls_are_refused_naming_the_setting_and_the_problem(
    url: str, fragment: str
) -> None:
    # Every URL also carries a password, which no message may show.
    with_pw = url.replace("://", f"://user:{ENC}@", 1) if "@" not in url else url
    for candidate in (url, with_pw):
        with pytest.raises(ConfigurationError) as err:
            load_config({"redislock_url": candidate})
        message = str(err.value)
        assert err.value.setting == "redislock_url"
        assert fragment in message, message
        assert "s3cr" not in message and PW not in message


def test_the_error_for_an_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(ConfigurationError) as err:
        validate_url("redis+cluster://h1/?readonly=1", setting="redislock_url")
    assert all(name in str(err.value) for name in CLUSTER_OPTIONS)


def test_the_cli_on_a_cluster_url_nobody_answers_says_so_in_one_line() -> None:
    """The cluster client connects when it is made: the CLI reports that as
    Redis being unavailable (exit 1, password masked), not a traceback."""
    from click.testing import CliRunner

    from celery_redislock.integration.cli import redislock
    from redis_server import free_port

    url = f"redis+cluster://ops:{ENC}@127.0.0.1:{free_port()}/?socket_connect_timeout=1"
    result = CliRunner().invoke(redislock, ["--url", url, "--namespace", "n", "status"])
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Error: Redis at redis+cluster://ops:***@127.0.0.1:" in result.output
    assert "is unavailable" in result.output and "s3cr" not in result.output
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a traceback
