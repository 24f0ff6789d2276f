"""The public face does not move: names, settings, loggers, metrics, CLI, paths.

Operators configure, grep and alert on these names; users import these
paths. Each list here is what a release promises: a change to one of them is
a change of the public face and belongs in the changelog.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from pathlib import Path

import click
import pytest

import celery_redislock

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "celery_redislock"

PUBLIC_NAMES = {
    "Adoption",
    "CleanupReport",
    "ConfigurationError",
    "DuplicateTask",
    "EvictionCheck",
    "FORMAT_VERSION",
    "FormatMismatch",
    "Inspector",
    "InvalidResource",
    "Lease",
    "LockError",
    "LockHolder",
    "LockLost",
    "LockManager",
    "LockTimeout",
    "LockUpgradeError",
    "PermissionDenied",
    "ReconcileReport",
    "RedisLock",
    "RedisUnavailable",
    "ReplicationTimeout",
    "ShuttingDown",
    "TaskGrant",
    "TemplateError",
    "UniqueTask",
    "check_eviction",
    "current_lease",
    "locked",
    "normalise_key_value",
}

SETTINGS = [
    "redislock_url",
    "redislock_namespace",
    "redislock_owner_ttl",
    "redislock_heartbeat_interval",
    "redislock_reconcile_interval",
    "redislock_default_timeout",
    "redislock_default_on_busy",
    "redislock_defer_ttl",
    "redislock_defer_grant_ttl",
    "redislock_defer_guard_interval",
    "redislock_defer_guard_rate",
    "redislock_fast_restart_cleanup",
    "redislock_eviction_check",
    "redislock_on_lost",
    "redislock_wait_replicas",
    "redislock_wait_timeout",
    "redislock_wait_policy",
    "redislock_metrics_port",
    "redislock_metrics_address",
    "redislock_unique_ttl",
]

LOGGERS = {
    "celery_redislock.acquire",
    "celery_redislock.app",
    "celery_redislock.cleanup",
    "celery_redislock.cli",
    "celery_redislock.defer",
    "celery_redislock.heartbeat",
    "celery_redislock.metrics",
    "celery_redislock.node",
    "celery_redislock.reconcile",
    "celery_redislock.release",
    "celery_redislock.task",
    "celery_redislock.unique",
    "celery_redislock.worker",
}

METRICS = {
    "redislock_acquire_wait_seconds",
    "redislock_cleanups",
    "redislock_dead_owner_locks",
    "redislock_grants",
    "redislock_heartbeat_failures",
    "redislock_hold_seconds",
    "redislock_holders",
    "redislock_leases_lost",
    "redislock_limited_resource_limit",
    "redislock_limited_resource_slots",
    "redislock_limited_resource_waiters",
    "redislock_limited_resources",
    "redislock_limited_slots",
    "redislock_limited_waiters",
    "redislock_namespace_truncated",
    "redislock_namespace_up",
    "redislock_owners",
    "redislock_parks",
    "redislock_timeouts",
    "redislock_waiters",
}

CLI = {
    "format": ["--json", "--namespace", "--switch", "--url", "--yes", "-y"],
    "locks": ["--json", "--namespace", "--url", "resources"],
    "owners": ["--json", "--namespace", "--node", "--url"],
    "reconcile": ["--batch-size", "--dry-run", "--json", "--namespace", "--url", "--yes", "-y"],
    "release": [
        "--dry-run",
        "--force",
        "--json",
        "--namespace",
        "--owner",
        "--resource",
        "--url",
        "--yes",
        "-f",
        "-y",
    ],
    "status": ["--json", "--namespace", "--url"],
    "waiters": ["--json", "--limit", "--namespace", "--url", "resource"],
}

#: Task names registered on users' apps (sent through their brokers).
TASK_NAMES = {"celery_redislock.defer_guard", "celery_redislock.reconcile"}

#: Dotted paths users import (the docs show them, or a release offered them).
PATHS = [
    "celery_redislock.manager:LockManager",
    "celery_redislock.manager:TaskGrant",
    "celery_redislock.manager:Adoption",
    "celery_redislock.manager:RequestMoved",
    "celery_redislock.manager:DEFAULT_OWNER_TTL",
    "celery_redislock.lease:Lease",
    "celery_redislock.keys:FORMAT_VERSION",
    "celery_redislock.keys:UNVERSIONED_FORMAT",
    "celery_redislock.connect:AnyRedis",
    "celery_redislock.metrics:MetricsHook",
    "celery_redislock.prometheus:PrometheusMetrics",
    "celery_redislock.prometheus:NamespaceCollector",
    "celery_redislock.settings:SETTINGS",
    "celery_redislock.settings:load_config",
    "celery_redislock.redact:redact_url",
    "celery_redislock.inspect:Inspector",
    "celery_redislock.exceptions:LOST_CAUSES",
    "celery_redislock.testing:RedisServer",
    "celery_redislock.testing:LockView",
    "celery_redislock.cli:redislock",
    "celery_redislock.app:RedisLock",
    "celery_redislock.task:locked",
    "celery_redislock.unique:UniqueTask",
    "celery_redislock.asyncio:AsyncLockManager",
    "celery_redislock.asyncio:AsyncLease",
    "celery_redislock.asyncio:cancel_on_disconnect",
]


def test_every_public_name_is_exported_and_importable() -> None:
    assert set(celery_redislock.__all__) == PUBLIC_NAMES
    for name in PUBLIC_NAMES:
        assert getattr(celery_redislock, name) is not None


def test_the_settings_table_names_every_setting_once() -> None:
    from celery_redislock.settings import SETTINGS as TABLE

    assert [s.name for s in TABLE] == SETTINGS


def _source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_logger_names_stay_those_operators_filter_on() -> None:
    names: set[str] = set()
    for path in _source_files():
        text = path.read_text(encoding="utf-8")
        names |= set(re.findall(r'getLogger\("([^"]+)"\)', text))
        # A module's own name would move with the module.
        assert "getLogger(__name__)" not in text, path
    assert names == LOGGERS


def test_metric_names_stay_those_dashboards_query() -> None:
    pytest.importorskip("prometheus_client")
    from celery_redislock.prometheus import PrometheusMetrics

    source = Path(inspect.getsourcefile(PrometheusMetrics) or "").read_text(encoding="utf-8")
    assert set(re.findall(r'"(redislock_[a-z_]+)"', source)) == METRICS


def test_cli_commands_and_options_stay() -> None:
    from celery_redislock.cli import redislock

    assert isinstance(redislock, click.Group)
    seen = {
        name: sorted(opt for param in cmd.params for opt in param.opts)
        for name, cmd in redislock.commands.items()
    }
    assert seen == CLI


def test_registered_task_names_stay() -> None:
    from celery_redislock.app import RECONCILE_TASK
    from celery_redislock.integration.guard import GUARD_TASK

    assert {RECONCILE_TASK, GUARD_TASK} == TASK_NAMES


@pytest.mark.parametrize("path", PATHS)
def test_documented_import_paths_still_work(path: str) -> None:
    module, _, name = path.partition(":")
    assert getattr(importlib.import_module(module), name) is not None


def test_the_celery_subcommand_entry_point_resolves() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'redislock = "([\w.]+):(\w+)"', text)
    assert match is not None
    command = getattr(importlib.import_module(match.group(1)), match.group(2))
    assert isinstance(command, click.Group)
    assert logging.getLogger("celery_redislock").name == "celery_redislock"
