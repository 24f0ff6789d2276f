"""Hostile input is refused where it enters, with an error naming what was wrong.

Names (namespace, resource, Sentinel service, node, owner id) are matched
against the whole string: a trailing newline is not "before the end". Every
public parameter has a type and a range: ``bool`` is not a number, NaN and
numbers too large for a float are refused with a message (not an
OverflowError), and a heartbeat interval has a floor. Every numeric
argument's table has NaN and both infinities: -inf is never "wait for
ever", +inf only where the argument documents it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_redislock import ConfigurationError, InvalidResource, LockManager, _validate, locked
from celery_redislock._validate import label
from celery_redislock.integration.cli import redislock
from celery_redislock.integration.settings import load_config
from celery_redislock.ops.inspector import Inspector
from celery_redislock.protocol.keys import (
    Keyspace,
    validate_namespace,
    validate_node_name,
    validate_owner_id,
    validate_resource,
)
from celery_redislock.store.connect import parse_sentinel_url
from celery_redislock.worker.node import Node
from engine_helpers import Managers

NOWHERE = "redis://127.0.0.1:1/0"  # never connected to: constructors do no I/O

INF, NAN = math.inf, math.nan
#: NaN and both infinities: in every numeric argument's table (+inf where it is refused).
NON_FINITE = (NAN, INF, -INF)

CONTROL = [chr(c) for c in range(0x20)] + ["\x7f"]


# -- names: full-string matching ---------------------------------------------------


@pytest.mark.parametrize("ns", ["redislock\n", "redislock\r\n", "\nredislock", "a\nb", "ns\x00"])
def test_namespace_with_a_newline_is_refused_by_manager_settings_and_cli(ns: str) -> None:
    with pytest.raises(ConfigurationError, match="namespace"):
        LockManager(NOWHERE, ns)
    with pytest.raises(ConfigurationError, match="redislock_namespace"):
        load_config({"redislock_url": NOWHERE, "redislock_namespace": ns})
    app = Celery("v", set_as_current=False)
    app.conf.redislock_url = NOWHERE
    result = CliRunner().invoke(
        redislock,
        ["status", "--namespace", ns],
        obj=CLIContext(app=app, no_color=True, workdir=None),
    )
    assert result.exit_code == 2, result.output
    assert "namespace" in result.output


def test_two_namespaces_differing_by_a_newline_never_share_a_lock(
    managers: Managers, redis_url: str
) -> None:
    first = managers(namespace="redislock").acquire("repo:1", timeout=0)
    with pytest.raises(ConfigurationError):
        managers(namespace="redislock\n").acquire("repo:1", timeout=0)
    first.release()


@pytest.mark.parametrize("service", ["mymaster\n", "my\nmaster", "mymaster\x00"])
def test_sentinel_service_name_with_control_characters_is_refused(service: str) -> None:
    with pytest.raises(ConfigurationError, match="service name"):
        parse_sentinel_url(f"sentinel://h:26379/{quote(service)}")
    with pytest.raises(ConfigurationError, match="service name"):
        parse_sentinel_url("sentinel://h:26379", master_name=service)


@pytest.mark.parametrize("node", ["celery@host\n", "celery@\x1bhost", "", 5, None])
def test_node_name_with_control_characters_or_not_a_str_is_refused(
    node: Any, redis_url: str
) -> None:
    mgr = LockManager(redis_url, "t", heartbeat=False)
    try:
        with pytest.raises(ValueError, match="node"):
            Node(mgr, node, "inc1")
        with pytest.raises(ValueError, match="node"):
            Inspector(mgr).node(node)
        with pytest.raises(ValueError, match="node"):
            Inspector(mgr).owners(nodes=[node])
    finally:
        mgr.close()


def _hash_tag(key: str) -> str:
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1 : end] if start >= 0 and end > start + 1 else key


def _accepted(validate: Callable[[Any], Any], value: Any) -> bool:
    try:
        validate(value)
    except ValueError:
        return False
    return True


#: Characters that matter to names: anchors, separators, hash tags, globs.
_TRICKY = "\n\r\t\x00\x7f\x1b {}:|*?[]\\/.-_aZ09é😀\u2028"
texts = st.one_of(
    st.text(alphabet=st.sampled_from(_TRICKY), max_size=12),
    st.text(max_size=20),
    st.sampled_from(["redislock\n", "redislock", "a" * 64 + "\n", "x\r", "mymaster\n"]),
)
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(texts, texts)
def test_accepted_namespaces_are_clean_and_map_to_disjoint_prefixes(a: str, b: str) -> None:
    for ns in (a, b):
        if _accepted(validate_namespace, ns):
            assert not any(c in ns for c in CONTROL)
            assert "{" not in ns and "}" not in ns and ":" not in ns
            keys = Keyspace(ns)
            assert _hash_tag(keys.lock("r")) == ns
            assert keys.lock("r").startswith(keys.prefix)
    if a != b and _accepted(validate_namespace, a) and _accepted(validate_namespace, b):
        pa, pb = Keyspace(a).prefix, Keyspace(b).prefix
        # No key of one namespace can be a key of the other.
        assert not pa.startswith(pb) and not pb.startswith(pa)


@PROPS
@given(texts, st.sampled_from(["redislock", "t", "a.b-c_1"]))
def test_every_accepted_name_is_clean_and_stays_inside_the_namespace(name: str, ns: str) -> None:
    keys = Keyspace(ns)
    if _accepted(validate_resource, name):
        assert not any(c in name for c in CONTROL)
        for key in (keys.lock(name), keys.queue(name)):
            assert key.startswith(keys.prefix) and _hash_tag(key) == ns
    for validate in (validate_node_name, validate_owner_id):
        if _accepted(validate, name):
            assert name and not any(c in name for c in CONTROL)
            assert keys.held(name).startswith(keys.prefix)
    if _accepted(validate_owner_id, name):
        assert "|" not in name
    if _accepted(lambda v: label("name", v), name):  # LockManager(name=...)
        assert name.isprintable() and not any(c in name for c in CONTROL)
    try:
        spec = parse_sentinel_url(f"sentinel://h:26379/{quote(name, safe='')}")
    except ConfigurationError:
        pass
    else:
        assert spec.service_name == name
        assert not any(c in name for c in CONTROL)


# -- LockManager constructor -------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"owner_ttl": 10**400}, "owner_ttl"),
        ({"owner_ttl": True}, "owner_ttl"),
        ({"owner_ttl": "30"}, "owner_ttl"),
        *(({"owner_ttl": x}, "owner_ttl") for x in NON_FINITE),
        ({"owner_ttl": 0.09}, "owner_ttl"),
        ({"owner_ttl": 86400.5}, "owner_ttl"),
        ({"heartbeat_interval": 1e-9}, "heartbeat_interval"),
        ({"heartbeat_interval": 0.049}, "heartbeat_interval"),
        ({"heartbeat_interval": 0}, "heartbeat_interval"),
        ({"heartbeat_interval": -1}, "heartbeat_interval"),
        *(({"heartbeat_interval": x}, "heartbeat_interval") for x in NON_FINITE),
        ({"heartbeat_interval": 10**400}, "heartbeat_interval"),
        ({"heartbeat_interval": False}, "heartbeat_interval"),
        ({"owner_ttl": 1.0, "heartbeat_interval": 0.51}, "heartbeat_interval"),
        ({"queue_scan_limit": True}, "queue_scan_limit"),
        ({"queue_scan_limit": 2**63}, "queue_scan_limit"),
        ({"queue_scan_limit": 100_001}, "queue_scan_limit"),
        ({"queue_scan_limit": 0}, "queue_scan_limit"),
        ({"queue_scan_limit": 1.0}, "queue_scan_limit"),
        *(({"queue_scan_limit": x}, "queue_scan_limit") for x in NON_FINITE),
        *(({"wait_replicas": x}, "wait_replicas") for x in NON_FINITE),
        ({"wait_replicas": -1}, "wait_replicas"),
        *(({"wait_timeout": x}, "wait_timeout") for x in NON_FINITE),
        ({"wait_timeout": 10**400}, "wait_timeout"),
        ({"wait_timeout": 0}, "wait_timeout"),
        ({"name": "a\nb"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x" * 201}, "name"),
        ({"name": 5}, "name"),
        ({"heartbeat": "no"}, "heartbeat"),
        ({"group": "key"}, "group"),
    ],
)
def test_manager_refuses_out_of_range_or_mistyped_arguments(
    kwargs: dict[str, Any], setting: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        LockManager(NOWHERE, "t", **kwargs)
    assert info.value.setting == setting
    assert "OverflowError" not in repr(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"owner_ttl": 0.1},  # default heartbeat: the 0.05 s floor
        {"owner_ttl": 86400},
        {"owner_ttl": 1.0, "heartbeat_interval": 0.05},
        {"owner_ttl": 1.0, "heartbeat_interval": 0.5},
        {"queue_scan_limit": 1},
        {"queue_scan_limit": 100_000},
        {"name": "x" * 200},
    ],
)
def test_manager_accepts_the_boundaries(kwargs: dict[str, Any]) -> None:
    LockManager(NOWHERE, "t", **kwargs).close()


def test_a_heartbeat_below_half_a_second_logs_one_warning_per_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 0.123: a value no other test uses (the warning is once per process and value)
    with caplog.at_level(logging.WARNING, "celery_redislock.heartbeat"):
        LockManager(NOWHERE, "t", owner_ttl=10, heartbeat_interval=0.5).close()
        assert not [r for r in caplog.records if "fast-interval" in r.getMessage()]
        for _ in range(3):
            LockManager(NOWHERE, "t", owner_ttl=10, heartbeat_interval=0.123).close()
    [record] = [r for r in caplog.records if "fast-interval" in r.getMessage()]
    assert "heartbeat_interval=0.123s" in record.getMessage()


# -- acquire / lock / lease / cleanup ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"exclusive": 5}, InvalidResource),
        ({"exclusive": ["a"], "shared": 7.5}, InvalidResource),
        ({"exclusive": {"a": 1}}, InvalidResource),
        ({"exclusive": b"a"}, InvalidResource),
        ({"exclusive": "a", "timeout": 10**400}, ConfigurationError),
        ({"exclusive": "a", "timeout": True}, ConfigurationError),
        ({"exclusive": "a", "timeout": "5"}, ConfigurationError),
        ({"exclusive": "a", "timeout": math.nan}, ConfigurationError),
        ({"exclusive": "a", "timeout": -math.inf}, ConfigurationError),  # never "for ever"
        ({"exclusive": "a", "timeout": -0.001}, ConfigurationError),
        ({"exclusive": "a", "timeout": 1, "nested": "yes"}, ConfigurationError),
    ],
)
def test_acquire_refuses_bad_arguments_before_any_io(
    kwargs: dict[str, Any], error: type[Exception], managers: Managers, r: Any
) -> None:
    mgr = managers()
    with pytest.raises(error):
        mgr.acquire(**kwargs)
    with pytest.raises(error):
        with mgr.lock(**kwargs):
            pass
    assert r.keys("*") == []  # nothing registered, no alive: key left behind


def test_acquire_accepts_a_zero_and_an_infinite_timeout(managers: Managers) -> None:
    mgr = managers()
    with mgr.lock("a", timeout=0), mgr.lock("b", timeout=math.inf, nested=False):
        pass
    with mgr.lock(iter(["c", "d"]), shared=("e",), timeout=0):
        pass


@pytest.mark.parametrize("timeout", [-1, math.nan, -math.inf, 10**400, True, "1", None])
def test_wait_for_contender_refuses_a_bad_timeout(timeout: Any, managers: Managers) -> None:
    with managers().lock("a", timeout=0) as lease:
        with pytest.raises(ConfigurationError, match="timeout"):
            lease.wait_for_contender(timeout)
        assert lease.wait_for_contender(0) is False


@pytest.mark.parametrize("ttl", [*NON_FINITE, 10**400, True, "30", 0, -1, 86400.5])
def test_acquire_for_task_refuses_a_bad_ttl_before_any_io(
    ttl: Any, managers: Managers, r: Any
) -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        managers().acquire_for_task("t1", "a", ttl=ttl)
    assert r.keys("*") == []


@pytest.mark.parametrize("ttl", [*NON_FINITE, 10**400, True, "30", 0, -1])
def test_unique_task_refuses_a_bad_unique_ttl_at_definition(ttl: Any) -> None:
    from celery_redislock import UniqueTask

    app = Celery("v", set_as_current=False)
    with pytest.raises(ConfigurationError, match="unique_ttl"):

        @app.task(base=UniqueTask, unique_ttl=ttl, name="v.bad_ttl", shared=False)
        def bad() -> None:
            pass

        _ = bad.name  # a lazy proxy: make the task


@pytest.mark.parametrize("owner", ["", "a|b", "a\nb", 5, None, "x" * 513])
def test_cleanup_owner_refuses_a_malformed_owner_id(owner: Any, managers: Managers) -> None:
    with pytest.raises(ValueError, match="owner id"):
        managers().cleanup_owner(owner)


def test_cleanup_owner_force_must_be_a_bool(managers: Managers) -> None:
    with pytest.raises(ConfigurationError, match="force"):
        managers().cleanup_owner("someone", force="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [0, 10_001, True, 2.0, "500", *NON_FINITE])
def test_reconcile_and_inspector_refuse_a_bad_batch_size(batch: Any, managers: Managers) -> None:
    mgr = managers()
    with pytest.raises(ConfigurationError, match="batch_size"):
        mgr.reconcile(batch_size=batch)
    with pytest.raises(ConfigurationError, match="batch_size"):
        Inspector(mgr, batch_size=batch)


@pytest.mark.parametrize("limit", [0, True, 1.5, 100_001, *NON_FINITE])
def test_inspector_waiters_refuses_a_bad_limit(limit: Any, managers: Managers) -> None:
    with pytest.raises(ConfigurationError, match="limit"):
        Inspector(managers()).waiters("a", limit=limit)


def test_inspector_refuses_a_str_where_it_takes_many_names_and_a_malformed_owner_id(
    managers: Managers,
) -> None:
    insp = Inspector(managers())
    with pytest.raises(ConfigurationError, match="resources"):
        insp.locks("repo:1")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="owners"):
        insp.liveness("owner-1")
    for bad in ("", "a|b", "a\nb"):
        with pytest.raises(ValueError, match="owner id"):
            insp.owner(bad)
        with pytest.raises(ValueError, match="owner id"):
            insp.registry(bad)
        with pytest.raises(ValueError, match="owner id"):
            insp.plan_owner(bad)


def test_inspector_needs_a_lock_manager() -> None:
    with pytest.raises(ConfigurationError, match="manager"):
        Inspector("redis://h/0")  # type: ignore[arg-type]


# -- @locked ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"timeout": 10**400}, "locked(timeout=)"),
        ({"timeout": math.nan}, "locked(timeout=)"),
        ({"timeout": -math.inf}, "locked(timeout=)"),  # never "for ever"
        ({"on_busy": "defer", "timeout": -math.inf}, "locked(timeout=)"),
        ({"on_busy": "defer", "timeout": math.nan}, "locked(timeout=)"),
        ({"timeout": True}, "locked(timeout=)"),
        ({"timeout": -1}, "locked(timeout=)"),
        ({"on_busy": "retry", "retry_countdown": -1}, "locked(retry_countdown=)"),
        *(
            ({"on_busy": "retry", name: x}, f"locked({name}=)")
            for name in ("retry_countdown", "retry_backoff", "retry_backoff_max", "max_retries")
            for x in NON_FINITE
        ),
        ({"on_busy": "retry", "retry_backoff": 10**400}, "locked(retry_backoff=)"),
        ({"on_busy": "retry", "retry_backoff_max": "600"}, "locked(retry_backoff_max=)"),
        ({"on_busy": "retry", "retry_jitter": "yes"}, "locked(retry_jitter=)"),
        ({"on_busy": "retry", "max_retries": -1}, "locked(max_retries=)"),
        ({"on_busy": "retry", "max_retries": True}, "locked(max_retries=)"),
        ({"shared": 5}, "locked(shared=)"),
        ({"on_busy": ["wait"]}, "locked(on_busy=)"),
        ({"on_busy": "skip", "timeout": 5}, "locked(timeout=)"),
        ({"on_busy": "defer", "retry_countdown": 1}, "locked(retry_countdown=)"),
    ],
)
def test_locked_refuses_bad_arguments_at_decoration(kwargs: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        locked("repo:{x}", **kwargs)
    assert info.value.setting == setting


def test_locked_accepts_an_infinite_timeout_as_none() -> None:
    locked("repo:{x}", timeout=math.inf)
    locked("repo:{x}", on_busy="retry", max_retries=None, retry_countdown=0)
    locked("repo:{x}", on_busy="defer", timeout=3600)  # the longest it stays parked
    locked("repo:{x}", timeout=30)  # the app's default mode decides at call time


# -- settings --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("redislock_owner_ttl", 10**400),
        ("redislock_owner_ttl", True),
        ("redislock_owner_ttl", "nan"),
        ("redislock_owner_ttl", 0.05),
        *(
            (name, x)
            for name in (
                "redislock_owner_ttl",
                "redislock_heartbeat_interval",
                "redislock_reconcile_interval",
                "redislock_defer_ttl",
                "redislock_defer_grant_ttl",
                "redislock_unique_ttl",
                "redislock_wait_timeout",
                "redislock_wait_replicas",
                "redislock_metrics_port",
            )
            for x in (*NON_FINITE, str(NAN), str(INF), str(-INF))
        ),
        ("redislock_default_timeout", -math.inf),  # never "for ever"
        ("redislock_default_timeout", "-inf"),
        ("redislock_unique_ttl", 10**400),
        ("redislock_wait_timeout", 10**400),
        ("redislock_heartbeat_interval", 1e-9),
        ("redislock_heartbeat_interval", 0.049),
        ("redislock_heartbeat_interval", "1e-9"),
        ("redislock_heartbeat_interval", 10**400),
        ("redislock_reconcile_interval", 0.5),
        ("redislock_reconcile_interval", math.inf),
        ("redislock_reconcile_interval", 10**400),
        ("redislock_reconcile_interval", True),
        ("redislock_default_timeout", 10**400),
        ("redislock_default_timeout", math.nan),
        ("redislock_default_timeout", -1),
        ("redislock_fast_restart_cleanup", 2),
        ("redislock_eviction_check", ["warn"]),
        ("redislock_on_lost", "kill"),
        ("redislock_on_lost", ["fail"]),
        ("redislock_namespace", 5),
        ("redislock_default_on_busy", "later"),
        ("redislock_default_on_busy", ["defer"]),
        ("redislock_defer_ttl", 0.5),
        ("redislock_defer_ttl", math.inf),
        ("redislock_defer_grant_ttl", -1),
        ("redislock_defer_grant_ttl", "soon"),
    ],
)
def test_every_setting_refuses_out_of_range_or_mistyped_values(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_config({"redislock_url": NOWHERE, name: value})
    assert info.value.setting == name


def test_settings_accept_their_boundaries(caplog: pytest.LogCaptureFixture) -> None:
    base = {"redislock_url": NOWHERE}
    cfg = load_config({**base, "redislock_owner_ttl": 0.1})
    assert cfg.heartbeat_interval == 0.05  # the default is raised to the floor
    cfg = load_config({**base, "redislock_reconcile_interval": 1, "redislock_default_timeout": 0})
    assert (cfg.reconcile_interval, cfg.default_timeout) == (1.0, 0.0)
    assert load_config({**base, "redislock_default_timeout": "inf"}).default_timeout is None
    assert load_config({**base, "redislock_reconcile_interval": 0}).reconcile_interval is None
    cfg = load_config({**base, "redislock_default_on_busy": "defer", "redislock_defer_ttl": 1})
    assert (cfg.default_on_busy, cfg.defer_ttl, cfg.defer_grant_ttl) == ("defer", 1.0, 300.0)
    # The warning is once per process and value: forget an earlier test's.
    _validate._warned_fast.discard(("redislock_heartbeat_interval", 0.05))
    with caplog.at_level(logging.WARNING, "celery_redislock.heartbeat"):
        load_config({**base, "redislock_heartbeat_interval": 0.05})
    assert any("redislock_heartbeat_interval=0.05s" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h/0\n",
        " redis://h/0",
        "redis://h\x00/0",
        "redis://h/abc",  # redis-py would read it as database 0
        "redis://h/-1",
        "redis://h/²",
        "redis://h/2147483648",
        "unix:///tmp/r.sock?db=-2",
        "sentinel://h:26379/m/0\n",
    ],
)
def test_lock_url_with_control_characters_or_a_bad_database_is_refused(url: str) -> None:
    with pytest.raises(ConfigurationError, match="redislock_url"):
        load_config({"redislock_url": url})
    with pytest.raises(ConfigurationError, match="redis_url"):
        LockManager(url)


@pytest.mark.parametrize(
    "url", ["redis://h", "redis://h/", "redis://h/2147483647", "unix:///tmp/r.sock?db=2"]
)
def test_lock_url_boundaries_are_accepted(url: str) -> None:
    assert load_config({"redislock_url": url}).url == url
