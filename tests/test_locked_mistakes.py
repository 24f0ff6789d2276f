"""``@locked`` refuses its own misuse where it is written, not at the first call.

Decoration order, templates naming arguments the function does not have,
malformed templates and bad option values all raise when the module is
imported (so a worker refuses to start instead of running unlocked tasks or
failing every call). What only a call can tell (a value that does not
format, ``**kwargs`` names) still raises :class:`TemplateError` before
anything is locked.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, Task, shared_task

from celery_redislock import (
    ConfigurationError,
    LockManager,
    RedisLock,
    TemplateError,
    current_lease,
    locked,
)

NS = "mistakes"
PREFIX = "{" + NS + "}:"


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery("mistakes", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(
        redislock_namespace=NS,
        redislock_owner_ttl=1.5,
        redislock_heartbeat_interval=0.25,
        task_default_queue=f"q-{time.monotonic_ns()}",
        broker_connection_retry_on_startup=False,
    )
    yield app
    locks = RedisLock.of(app)
    if locks is not None:
        locks.close()


# -- decoration order ----------------------------------------------------------


def _says_the_right_order(exc: BaseException) -> None:
    text = str(exc)
    assert "@app.task" in text and "directly above" in text, text


def test_locked_above_a_finalized_task_is_a_type_error(app: Celery) -> None:
    app.finalize()

    def sync(repo_id: int) -> None: ...

    task = app.task(name="mistakes.sync")(sync)
    assert isinstance(task, Task)
    with pytest.raises(TypeError) as info:
        locked("repo:{repo_id}")(task)
    _says_the_right_order(info.value)
    assert "mistakes.sync" in str(info.value)


def test_locked_above_a_lazy_task_proxy_is_a_type_error_without_evaluating_it(
    app: Celery,
) -> None:
    assert not app.finalized

    def sync(repo_id: int) -> None: ...

    proxy = app.task(name="mistakes.lazy")(sync)
    assert not proxy.__evaluated__()
    with pytest.raises(TypeError) as info:
        locked("repo:{repo_id}")(proxy)
    _says_the_right_order(info.value)
    assert not proxy.__evaluated__() and not app.finalized


def test_locked_above_shared_task_is_a_type_error() -> None:
    def sync(repo_id: int) -> None: ...

    proxy = shared_task(name="mistakes.shared")(sync)
    with pytest.raises(TypeError) as info:
        locked("repo:{repo_id}")(proxy)
    _says_the_right_order(info.value)


def test_locked_on_a_task_class_is_a_type_error_pointing_at_run() -> None:
    class Sync(Task):  # type: ignore[misc]
        def run(self, repo_id: int) -> None: ...

    with pytest.raises(TypeError, match="run"):
        locked("repo:{repo_id}")(Sync)


def test_locked_on_something_not_callable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="function"):
        locked("repo:1")("not a function")  # type: ignore[arg-type]


def test_the_documented_order_still_locks(app: Celery, r: redis.Redis) -> None:
    RedisLock(app)

    @app.task(shared=False, bind=True)
    @locked("repo:{repo_id}")
    def sync(self: Any, repo_id: int) -> str:
        assert r.exists(PREFIX + "lock:repo:7")
        lease = current_lease()
        assert lease is not None
        return lease.resources[0]

    assert sync.apply(args=(7,), throw=True).get() == "repo:7"


# -- templates, checked at decoration -------------------------------------------


def test_unknown_template_field_is_refused_at_decoration_naming_everything() -> None:
    def sync(repo_id: int, remote_id: int = 0) -> None: ...

    with pytest.raises(TemplateError) as info:
        locked("repo:{repoid}")(sync)
    err = info.value
    assert err.template == "repo:{repoid}" and err.argument == "repoid"
    text = str(err)
    for needle in ("repo:{repoid}", "'repoid'", "repo_id", "remote_id", "sync"):
        assert needle in text, text


def test_unknown_field_in_a_shared_template_is_refused_too() -> None:
    def sync(repo_id: int) -> None: ...

    with pytest.raises(TemplateError) as info:
        locked("repo:{repo_id}", shared=["remote:{remote}"])(sync)
    assert info.value.template == "remote:{remote}" and info.value.argument == "remote"


@pytest.mark.parametrize(
    "template",
    [
        "repo:{repo.id}",  # attribute access: the root name must exist
        "repo:{ids[0]}",  # index access
        "repo:{name!r:>10}",  # conversion and format spec
        "repo:{name:{width}}",  # a nested field in the spec
    ],
)
def test_attribute_index_and_spec_fields_check_their_root_name(template: str) -> None:
    def good(repo: Any, ids: list[int], name: str, width: int) -> None: ...

    locked(template)(good)  # every root name exists: accepted

    def bad(other: int) -> None: ...

    with pytest.raises(TemplateError) as info:
        locked(template)(bad)
    assert info.value.argument in {"repo", "ids", "name", "width"}
    assert "other" in str(info.value)


def test_nested_spec_field_is_checked() -> None:
    def sync(name: str) -> None: ...

    with pytest.raises(TemplateError) as info:
        locked("repo:{name:{width}}")(sync)
    assert info.value.argument == "width"


def test_bind_self_positional_only_and_var_positional_names_are_accepted(
    app: Celery, r: redis.Redis
) -> None:
    RedisLock(app)
    seen: list[tuple[str, ...]] = []

    @app.task(shared=False, bind=True)
    @locked("repo:{repo_id}", shared=["task:{self.name}", "first:{rest[0]}"])
    def sync(self: Any, repo_id: int, /, *rest: Any) -> None:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.resources)

    sync.apply(args=(4, "x"), throw=True).get()
    assert seen == [("repo:4", f"task:{sync.name}", "first:x")]


def test_positional_only_parameter_wins_over_a_same_named_keyword(
    app: Celery, r: redis.Redis
) -> None:
    RedisLock(app)
    seen: list[tuple[str, ...]] = []

    @app.task(shared=False)
    @locked("repo:{repo_id}")
    def sync(repo_id: int, /, **kwargs: Any) -> None:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.resources)

    sync.apply(args=(1,), kwargs={"repo_id": 2}, throw=True).get()
    assert seen == [("repo:1",)]


def test_var_keyword_functions_are_checked_at_call_time(app: Celery, r: redis.Redis) -> None:
    RedisLock(app)

    @app.task(shared=False)
    @locked("repo:{repo}")  # accepted: **kwargs may carry "repo"
    def sync(n: int, **kwargs: Any) -> str:
        return "ran"

    assert sync.apply(args=(1,), kwargs={"repo": 5}, throw=True).get() == "ran"
    with pytest.raises(TemplateError) as info:
        sync.apply(args=(1,), throw=True)
    assert info.value.argument == "repo"
    assert not r.keys(PREFIX + "lock:*")


@pytest.mark.parametrize("template", ["repo:{}", "repo:{0}", "repo:{0.id}"])
def test_positional_fields_are_refused_at_decoration(template: str) -> None:
    def sync(repo_id: int) -> None: ...

    with pytest.raises(TemplateError, match="positional"):
        locked(template)(sync)


@pytest.mark.parametrize("template", ["repo:{repo_id", "repo:repo_id}", "repo:{repo_id!x}"])
def test_malformed_templates_are_refused_when_locked_is_called(template: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        locked(template)
    assert template in str(info.value)


def test_a_value_that_fails_to_format_is_a_template_error_at_call_time(
    app: Celery, r: redis.Redis
) -> None:
    RedisLock(app)

    @app.task(shared=False)
    @locked("repo:{n:d}", shared=["owner:{repo.owner}"])
    def sync(n: Any, repo: Any = None) -> None:
        raise AssertionError("body must not run")

    with pytest.raises(TemplateError) as info:
        sync.apply(args=("seven",), throw=True)
    assert info.value.template == "repo:{n:d}"
    assert "repo:{n:d}" in str(info.value) and "sync" in str(info.value)
    with pytest.raises(TemplateError) as info:
        sync.apply(args=(7, None), throw=True)
    assert info.value.template == "owner:{repo.owner}"
    assert not r.keys(PREFIX + "lock:*")


def test_decoration_template_error_survives_pickling() -> None:
    import pickle

    def sync(repo_id: int) -> None: ...

    with pytest.raises(TemplateError) as info:
        locked("repo:{repoid}")(sync)
    back = pickle.loads(pickle.dumps(info.value))
    assert str(back) == str(info.value) and back.argument == "repoid"


# -- other arguments -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"timeout": "30"}, "timeout"),
        ({"on_busy": "later"}, "on_busy"),
        ({"on_busy": None}, "on_busy"),
        ({"on_lost": "kill"}, "on_lost"),
        ({"on_lost": None}, "on_lost"),
        ({"shared": None}, "shared"),
        ({"shared": b"remote:1"}, "shared"),
        ({"shared": [""]}, "shared"),
        ({"shared": [3]}, "shared"),
        ({"on_busy": "retry", "retry_countdown": -1}, "retry_countdown"),
        ({"on_busy": "retry", "retry_countdown": float("nan")}, "retry_countdown"),
        ({"on_busy": "retry", "retry_backoff": 0.5}, "retry_backoff"),
        ({"on_busy": "retry", "retry_backoff_max": -3}, "retry_backoff_max"),
        ({"on_busy": "retry", "retry_jitter": "yes"}, "retry_jitter"),
        ({"on_busy": "retry", "max_retries": -1}, "max_retries"),
        ({"on_busy": "retry", "max_retries": 2.5}, "max_retries"),
        ({"retry_countdown": 10}, "on_busy"),  # retry options without on_busy="retry"
        ({"on_busy": "raise", "max_retries": 3}, "on_busy"),
    ],
)
def test_bad_options_are_refused_when_locked_is_called(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        locked("repo:1", **kwargs)


def test_exclusive_templates_passed_as_a_list_get_a_hint() -> None:
    with pytest.raises(ConfigurationError, match="separate arguments"):
        locked(["repo:1", "repo:2"])  # type: ignore[arg-type]


def test_bare_locked_without_templates_gets_a_hint() -> None:
    def sync(repo_id: int) -> None: ...

    with pytest.raises(ConfigurationError, match="bare @locked"):
        locked(sync)  # type: ignore[arg-type]


def test_no_resource_at_all_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least one"):
        locked()
    with pytest.raises(ConfigurationError, match="at least one"):
        locked(shared=[])


def test_same_template_exclusive_and_shared_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="both exclusive and shared"):
        locked("repo:{a}", shared=["repo:{a}"])


def test_good_options_are_accepted() -> None:
    locked("repo:1", timeout=float("inf"))
    locked("repo:1", timeout=None)
    locked("repo:1", timeout=0)
    locked("repo:1", on_busy="retry", retry_countdown=0, retry_backoff=1, max_retries=None)
    locked("repo:1", on_busy="retry", retry_jitter=False, retry_backoff_max=60)


def test_resource_exclusive_and_shared_after_formatting_is_locked_exclusively(
    app: Celery, other: LockManager, r: redis.Redis
) -> None:
    RedisLock(app)
    seen: list[tuple[str, ...]] = []

    @app.task(shared=False)
    @locked("repo:{dst}", shared=["repo:{src}"])
    def copy(src: int, dst: int) -> None:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.resources)
        assert r.hvals(PREFIX + "lock:repo:3")[0][:1] == b"x"

    copy.apply(args=(3, 3), throw=True).get()
    assert seen == [("repo:3",)]
    assert not r.keys(PREFIX + "lock:*")


@pytest.fixture
def other(redis_url: str) -> Iterator[LockManager]:
    mgr = LockManager(redis_url, NS, owner_ttl=1.5)
    yield mgr
    mgr.close()


def test_signature_of_locked_shows_readable_defaults() -> None:
    """Options left to the app's settings read ``<app setting>`` in help()."""
    import inspect

    from celery_redislock import locked

    text = str(inspect.signature(locked))
    assert "timeout: 'float | None' = <app setting>" in text
    assert "object at 0x" not in text
