"""Errors keep their fields across pickling and Celery's result backend.

A task that raises LockTimeout or LockLost has its error serialized by the
result backend and rebuilt as ``cls(*args)`` on ``result.get()``: with the
message as the only argument, the fields came back scrambled (resources
split into characters).
"""

from __future__ import annotations

import pickle

import pytest
from celery import Celery

from celery_redislock import (
    ConfigurationError,
    DuplicateTask,
    InvalidResource,
    LockError,
    LockLost,
    LockTimeout,
    PermissionDenied,
    RedisUnavailable,
    ReplicationTimeout,
    ShuttingDown,
    TemplateError,
)

ERRORS: list[LockError] = [
    LockTimeout(["repo:1", "remote:7"], 2.5),
    LockLost(["repo:1"], "123-abcdef", 1795986670523722),
    InvalidResource("resource name is empty", ""),
    ConfigurationError("redislock_owner_ttl", "must be within 0.05..86400 s, not -1"),
    ShuttingDown(["repo:1"]),
    DuplicateTask("report:42", "6f1c2a9e-3b7d-4e1a-9c55-0d2b8e4f7a10", "proj.report"),
    DuplicateTask("report:42", None),
    DuplicateTask("report:42", "6f1c2a9e", "proj.report", 3599.5),
    TemplateError("repo:{repo}", "repo", "sync"),
    TemplateError("repo:{n:d}", "Unknown format code", "sync", "cannot be formatted (ValueError)"),
    ReplicationTimeout(["repo:1"], 2.5, 1, 0, 0.5),
    PermissionDenied(
        "redis://user:secret@127.0.0.1:1/0",
        "PTTL",
        "this user has no permissions to run the 'pttl' command or its subcommand",
    ),
    RedisUnavailable("redis://user:secret@127.0.0.1:1/0", ConnectionError("refused")),
]


def fields(exc: LockError) -> dict[str, object]:
    return {k: v for k, v in vars(exc).items() if k != "cause"}


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_error_survives_pickling_with_its_fields(exc: LockError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert fields(back) == fields(exc)


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
def test_error_survives_celerys_json_result_backend_with_its_fields(exc: LockError) -> None:
    app = Celery("t", backend="cache+memory://")
    app.conf.result_serializer = "json"
    app.conf.result_accept_content = ["json"]
    backend = app.backend
    wire = backend.decode(backend.encode(backend.prepare_exception(exc)))
    back = backend.exception_to_python(wire)
    assert type(back).__name__ == type(exc).__name__
    assert str(back) == str(exc)
    assert fields(back) == fields(exc)


def test_unavailable_redis_error_never_shows_the_password() -> None:
    exc = ERRORS[-1]
    assert "secret" not in str(exc) and "secret" not in repr(exc.args)


def test_manager_url_shown_in_logs_and_errors_hides_the_password() -> None:
    from celery_redislock import LockManager

    mgr = LockManager("redis://user:secret@127.0.0.1:1/0")
    try:
        assert "secret" not in mgr.url
        assert mgr.url == "redis://user:***@127.0.0.1:1/0"
    finally:
        mgr.close()
