"""One masking function for every URL the package shows (errors, logs, CLI).

Each case names the secrets that must not appear in the output (nor any
piece of them between special characters, nor their decoded form) and the
parts that must stay readable (scheme, hosts, ports, db, service name).
"""

from __future__ import annotations

import json
import pickle
import re
from urllib.parse import unquote

import pytest

from celery_redislock import ConfigurationError, RedisUnavailable
from celery_redislock.ops.inspector import redact_url as inspect_redact_url
from celery_redislock.redact import UNPARSABLE, redact_url
from celery_redislock.store.connect import redact, validate_url

# (id, url, secrets, readable parts)
CASES: list[tuple[str, str, list[str], list[str]]] = [
    ("user-and-password", "redis://app:Zq9pw@h1:6379/0", ["Zq9pw"], ["redis://app:", "@h1:6379/0"]),
    ("password-no-user", "redis://:Zq9pw@h1:6379/2", ["Zq9pw"], ["redis://:", "@h1:6379/2"]),
    (
        "tls",
        "rediss://app:Zq9pw@h1:6380/0?ssl_cert_reqs=none",
        ["Zq9pw"],
        ["rediss://app:", "@h1:6380/0?ssl_cert_reqs=none"],
    ),
    (
        "at-in-password",
        "redis://app:Zq9@Xv7@h1:6379/0",
        ["Zq9@Xv7"],
        ["redis://app:", "@h1:6379/0"],
    ),
    (
        "colon-in-password",
        "redis://app:Zq9:Xv7@h1:6379/0",
        ["Zq9:Xv7"],
        ["redis://app:", "@h1:6379/0"],
    ),
    (
        "slash-in-password",
        "redis://app:Zq9/Xv7@h1:6379/0",
        ["Zq9/Xv7"],
        ["redis://app:", "@h1:6379/0"],
    ),
    (
        "all-specials",
        "redis://app:Zq9@:/#?Xv7@h1:6379/3?db=3",
        ["Zq9@:/#?Xv7"],
        ["@h1:6379/3?db=3"],
    ),
    (
        "percent-encoded",
        "redis://app:Zq9%40Xv7%2F@h1:6379/0",
        ["Zq9%40Xv7%2F"],
        ["redis://app:", "@h1:6379/0"],
    ),
    ("ipv6-host", "redis://app:Zq9pw@[::1]:6379/0", ["Zq9pw"], ["@[::1]:6379/0"]),
    (
        "unix-socket",
        "unix://:Zq9pw@/run/redis/redis.sock?db=1",
        ["Zq9pw"],
        ["unix://", "@/run/redis/redis.sock?db=1"],
    ),
    (
        "unix-query-password",
        "unix:///run/redis.sock?db=1&password=Zq9pw",
        ["Zq9pw"],
        ["unix:///run/redis.sock?db=1&password="],
    ),
    (
        "query-password",
        "redis://h1:6379/0?password=Zq9pw&socket_timeout=2",
        ["Zq9pw"],
        ["redis://h1:6379/0?password=", "&socket_timeout=2"],
    ),
    (
        "query-password-with-ampersand",
        "redis://h1/0?password=Zq9&Xv7&db=1",
        ["Zq9&Xv7"],
        ["redis://h1/0?", "&db=1"],
    ),
    (
        "query-password-any-case",
        "redis://h1/0?PASSWORD=Zq9pw",
        ["Zq9pw"],
        ["redis://h1/0?PASSWORD="],
    ),
    ("query-password-encoded-name", "redis://h1/0?pass%77ord=Zq9pw", ["Zq9pw"], ["redis://h1/0?"]),
    (
        "query-ssl-password",
        "rediss://h1/0?ssl_password=Zq9pw",
        ["Zq9pw"],
        ["rediss://h1/0?ssl_password="],
    ),
    (
        "user-and-query-password",
        "redis://app:Zq9pw@h1/0?password=Xv7pw",
        ["Zq9pw", "Xv7pw"],
        ["@h1/0?password="],
    ),
    (
        "sentinel-multi-host",
        "sentinel://app:Zq9pw@s1:26379,s2,[::1]:5/mymaster/0",
        ["Zq9pw"],
        ["sentinel://app:", "@s1:26379,s2,[::1]:5/mymaster/0"],
    ),
    (
        "sentinel-password-option",
        "sentinel://:Zq9pw@s1:26379,s2:26380/mymaster/2?sentinel_password=Xv7pw&socket_timeout=1",
        ["Zq9pw", "Xv7pw"],
        ["@s1:26379,s2:26380/mymaster/2?sentinel_password=", "&socket_timeout=1"],
    ),
    (
        "sentinel-slash-in-password",
        "sentinel://app:Zq9/Xv7@s1,s2/mymaster/0",
        ["Zq9/Xv7"],
        ["@s1,s2/mymaster/0"],
    ),
    (
        "kombu-semicolon-form",
        "sentinel://:Zq9pw@s1:26379/0;sentinel://u2:Xv7pw@s2:26380;sentinel://s3:26381",
        ["Zq9pw", "Xv7pw"],
        ["@s1:26379/0;sentinel://u2:", "@s2:26380;sentinel://s3:26381"],
    ),
    (
        "kombu-form-semicolon-query",
        "sentinel://s1/0?master_name=m;sentinel_password=Zq9pw;sentinel://s2",
        ["Zq9pw"],
        ["sentinel://s1/0?master_name=m;sentinel_password=", ";sentinel://s2"],
    ),
    ("unknown-scheme", "memcached://:Zq9pw@h1/0", ["Zq9pw"], ["memcached://:", "@h1/0"]),
    ("bad-port", "redis://app:Zq9pw@h1:notaport/0", ["Zq9pw"], ["@h1:notaport/0"]),
    ("unclosed-ipv6", "redis://app:Zq9pw@[::1/0", ["Zq9pw"], ["@[::1/0"]),
    ("no-scheme", "app:Zq9pw@h1:6379/0", ["Zq9pw"], ["@h1:6379/0"]),
    ("no-scheme-bare-password", "Zq9pw@h1:6379", ["Zq9pw"], ["@h1:6379"]),
    ("embedded-in-text", "cannot reach redis://app:Zq9pw@h1/0 now", ["Zq9pw"], ["@h1/0 now"]),
    ("leading-space", "  redis://app:Zq9pw@h1/0", ["Zq9pw"], ["  redis://app:", "@h1/0"]),
]


def pieces(secret: str) -> set[str]:
    """The secret, its decoded form and every run of 3+ ordinary characters in them."""
    out = {secret, unquote(secret)}
    for text in list(out):
        out.update(p for p in re.split(r"[@:/#?&%]", text) if len(p) >= 3)
    return out


@pytest.mark.parametrize(
    ("url", "secrets", "readable"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_no_secret_survives_and_the_address_stays_readable(
    url: str, secrets: list[str], readable: list[str]
) -> None:
    out = redact_url(url)
    for secret in secrets:
        for piece in pieces(secret):
            assert piece not in out, (piece, out)
    for part in readable:
        assert part in out, (part, out)
    assert "***" in out


@pytest.mark.parametrize("url", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_masking_is_idempotent(url: str) -> None:
    once = redact_url(url)
    assert redact_url(once) == once


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://u:secret@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:secret@h/0", "redis://:***@h/0"),
        ("redis://u:p@ss/w:rd@h:6379/0", "redis://u:***@h:6379/0"),
        (
            "sentinel://:pw@h1,h2:26380/svc/1?sentinel_password=x",
            "sentinel://:***@h1,h2:26380/svc/1?sentinel_password=***",
        ),
        ("sentinel://:a@h1/0;sentinel://:b@h2", "sentinel://:***@h1/0;sentinel://:***@h2"),
        ("unix:///tmp/r.sock?db=0&password=pw", "unix:///tmp/r.sock?db=0&password=***"),
    ],
)
def test_exact_masked_forms(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0",
        "redis://user@h:6379/0",  # a username alone is not a secret
        "rediss://h1:6380/0?ssl_cert_reqs=required&client_name=a@b",
        "unix:///run/user@1000/redis.sock?db=2",
        "sentinel://s1:26379,s2:26380/mymaster/0",
        "sentinel://s1:26379/0;sentinel://s2:26380",
        "redis://[::1]:6379/0",
        "",
        "not a url",
        "redis://[::1",
    ],
)
def test_urls_without_a_password_come_back_unchanged(url: str) -> None:
    assert redact_url(url) == url


@pytest.mark.parametrize("value", [None, 42, b"redis://:pw@h/0", ["redis://:pw@h"]])
def test_non_string_input_is_reported_unparsable_never_raised(value: object) -> None:
    assert redact_url(value) == UNPARSABLE  # type: ignore[arg-type]


@pytest.mark.parametrize("url", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_old_names_and_redis_unavailable_use_the_same_masking(url: str) -> None:
    assert redact(url) == inspect_redact_url(url) == redact_url(url)
    exc = RedisUnavailable(url, ConnectionError("refused"))
    assert exc.url == redact_url(url)
    back = pickle.loads(pickle.dumps(exc))
    assert back.url == exc.url and str(back) == str(exc)


def test_refused_url_error_quotes_no_piece_of_the_password() -> None:
    # urllib reads "Zq9" (the password's head) as the port and quotes it.
    with pytest.raises(ConfigurationError) as info:
        validate_url("redis://app:Zq9/Xv7@h1:6379/0", setting="redislock_url")
    message = str(info.value)
    assert "Zq9" not in message and "Xv7" not in message, message
    assert message.startswith("redislock_url: ") and "@h1:6379/0" in message


def test_refused_url_error_keeps_quoted_parts_the_masked_url_shows() -> None:
    with pytest.raises(ConfigurationError) as info:
        validate_url("redis://:Zq9pw@h1:notaport/0")
    assert "'notaport'" in str(info.value) and "Zq9pw" not in str(info.value)


# -- what Celery prints: `celery inspect conf` and `celery report` ---------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://app:Zq9pw@127.0.0.1:6379/0",
        "rediss://:Zq9pw@127.0.0.1:6380/0?ssl_cert_reqs=none",
        "sentinel://:Zq9pw@s1:26379,s2:26379/mymaster/0?sentinel_password=Zq9pw",
    ],
)
@pytest.mark.parametrize("configured_first", [False, True])
def test_celery_settings_views_mask_the_lock_url_password(url: str, configured_first: bool) -> None:
    from celery import Celery
    from celery.app.utils import bugreport
    from celery.utils.saferepr import saferepr
    from celery.utils.serialization import jsonify

    from celery_redislock import RedisLock

    app = Celery("mask", broker="memory://", set_as_current=False)
    app.conf.redislock_url = url
    if configured_first:
        app.conf.finalize()
    locks = RedisLock(app)
    # what `celery inspect conf` replies (celery/worker/control.py: conf) ...
    inspect_conf = json.dumps(jsonify(app.conf.table(), unknown_type_filter=saferepr))
    # ... and what `celery report` prints
    report = bugreport(app)
    for shown in (inspect_conf, report):
        assert "Zq9pw" not in shown
        assert "redislock_url" in shown and "***" in shown
    assert locks.config.url == url or "Zq9pw" in locks.config.url  # the engine still has it
