"""End-to-end: @locked task semantics in a real ``celery worker -P prefork``.

One worker serves every test of this module (started once):

- an operator's ``redislock release --force`` while a task runs: the task
  fails with LockLost naming the operator (on_lost="fail", the default);
  with on_lost="ignore" it succeeds and logs locked.lost; with
  on_lost="terminate" its pool child is killed at once and the task is
  redelivered (acks_late + task_reject_on_worker_lost);
- ``redislock locks``, ``owners`` and the Inspector show which task (name,
  id) on which node holds a lock;
- a @locked task calling a @locked function on its own resource re-enters.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from celery_redislock import Inspector, LockLost, LockManager
from celery_redislock.exceptions import CAUSE_DECLARED_DEAD, CAUSE_EXPIRED, CAUSE_OPERATOR
from celery_redislock.integration.cli import redislock
from redis_server import RedisServer

from .harness import CELERY, REPO_ROOT, Cluster, Worker, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def sem(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, Worker]]:
    """One cluster and one prefork worker (2 children) for the whole module."""
    c = Cluster(
        redis_server.emptied_url(), tmp_path_factory.mktemp("sem"), owner_ttl=30, heartbeat=1
    )
    failed = False
    try:
        w = c.start_worker("sem", concurrency=2)
        yield c, w
        failed = request.session.testsfailed > 0
    finally:
        if failed:
            print(c.report())
        c.close()


@pytest.fixture(scope="module")
def operator(sem: tuple[Cluster, Worker]) -> Iterator[LockManager]:
    c, _ = sem
    mgr = LockManager(c.lock_url, c.namespace, heartbeat=False, eviction_check="ignore")
    yield mgr
    mgr.close()


def celery_cli(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A e2e.proj redislock ARGS`` as an operator runs it."""
    proc = subprocess.run(
        [*CELERY, "-A", "e2e.proj", "redislock", *args],
        env=c.env,
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def cli_json(c: Cluster, *args: str) -> Any:
    """The same command in-process (click), JSON output."""
    result = CliRunner().invoke(
        redislock, [*args, "--json", "--url", c.lock_url, "--namespace", c.namespace]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _held(c: Cluster, task: str, tag: str) -> tuple[Any, str]:
    """Send ``task`` on ``res:<tag>`` as ``tag``; once it holds: its result and owner."""
    result = c.send(task, tag, tag)
    return result, str(c.wait_held(tag)["owner"])


def test_operator_release_fails_the_task_with_lock_lost_naming_the_operator(
    sem: tuple[Cluster, Worker], operator: LockManager
) -> None:
    c, w = sem
    result, owner = _held(c, "hold", "op1")

    # Who holds it: the task (name, id) on its node, in the table and in JSON.
    table = celery_cli(c, "locks", "res:op1").stdout
    row = next(line for line in table.splitlines() if line.startswith("res:op1"))
    assert f"e2e.hold[{result.id}]" in row and w.nodename in row, table
    holder = cli_json(c, "locks", "res:op1")[0]["holders"][0]
    assert (holder["task_name"], holder["task_id"], holder["node"]) == (
        "e2e.hold",
        result.id,
        w.nodename,
    )
    inspected = Inspector(operator).locks(["res:op1"])[0].holders[0]
    assert (inspected.task_name, inspected.task_id, inspected.node) == (
        "e2e.hold",
        result.id,
        w.nodename,
    )
    # `owners` names the node without --node.
    owners = {o["owner_id"]: o for o in cli_json(c, "owners")}
    assert owners[owner]["node"] == w.nodename

    celery_cli(c, "release", "--owner", owner, "--force", "--yes")
    wait_for(lambda: c.data.exists("e2e:lost:op1"), 30, "the body to see its lease lost")
    c.go("op1")
    with pytest.raises(LockLost) as info:
        result.get(timeout=30)
    assert info.value.cause == CAUSE_OPERATOR, info.value
    assert result.state == "FAILURE"
    wait_for(
        lambda: w.log_lines("locked.lost", 'cause="released by operator via cli"', "on_lost=fail"),
        30,
        "the locked.lost line",
        on_timeout=w.tail,
    )
    assert w.log_lines("heartbeat.lost", owner, 'cause="released by operator via cli"'), w.tail()
    # The holder record goes with the grant (the owner's registry is gone).
    assert not c.namespace_keys("holder") and not c.lock_redis.exists(c.key("held", owner))


def test_on_lost_ignore_keeps_the_result_and_logs_the_cause(
    sem: tuple[Cluster, Worker], operator: LockManager
) -> None:
    c, w = sem
    result, owner = _held(c, "hold_ignore", "ig1")
    operator.cleanup_owner(owner, force=True, reason="operator")
    wait_for(lambda: c.data.exists("e2e:lost:ig1"), 30, "the body to see its lease lost")
    c.go("ig1")
    out = result.get(timeout=30)
    assert out["lost"] is True and result.state == "SUCCESS"
    wait_for(
        lambda: w.log_lines("locked.lost", result.id, "on_lost=ignore", "operator"),
        30,
        "the locked.lost line",
        on_timeout=w.tail,
    )


def test_on_lost_terminate_kills_the_child_at_once_and_the_task_is_redelivered(
    sem: tuple[Cluster, Worker], operator: LockManager
) -> None:
    c, w = sem
    # block=1: the redelivered attempt completes at once
    result = c.send("hold_terminate", "tm1", "tm1", block=1)
    first = c.wait_held("tm1")
    operator.cleanup_owner(first["owner"], force=True, reason="operator")
    # Killed while its body still waits for a go signal that never comes.
    second = c.wait_held("tm1", attempt=2)
    assert second["pid"] != first["pid"]
    out = result.get(timeout=60)
    assert out["attempt"] == 2 and out["lost"] is False
    lines = w.log_lines("locked.lost", "on_lost=terminate", f"pid {first['pid']}")
    assert lines and 'cause="released by operator via CLI"' in lines[0], w.tail()
    assert "locked.lost task=e2e.hold_terminate " in lines[0], lines[0]
    assert w.log_lines(f"pid:{first['pid']}", "signal 9 (SIGKILL)"), w.tail()


def test_a_task_calling_a_locked_function_on_its_own_resource_reenters(
    sem: tuple[Cluster, Worker],
) -> None:
    c, _ = sem
    out = c.send("reenter", "re1").get(timeout=60)
    assert out["inner_fence"] == out["outer_fence"] is not None
    assert c.lock_holders("res:re1") == {}


def test_a_worker_paused_past_owner_ttl_fails_its_task_with_lock_lost(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # SIGSTOP the whole worker (main process and child) for longer than
    # owner_ttl: nothing refreshes the child's liveness, its lock may pass to
    # another. Resumed, the task learns it and, on_lost="fail", fails.
    c = Cluster(redis_server.url, tmp_path_factory.mktemp("paused"), owner_ttl=3, heartbeat=0.5)
    try:
        w = c.start_worker("paused", concurrency=1)
        result, owner = _held(c, "hold", "ps1")
        w.kill_group(signal.SIGSTOP)
        try:
            wait_for(lambda: c.alive_pttl(owner) == -2, 30, "the child's liveness to expire")
        finally:
            w.kill_group(signal.SIGCONT)
        wait_for(lambda: c.data.exists("e2e:lost:ps1"), 30, "the body to see its lease lost")
        c.go("ps1")
        with pytest.raises(LockLost) as info:
            result.get(timeout=30)
        assert info.value.cause in (CAUSE_EXPIRED, CAUSE_DECLARED_DEAD), info.value
        assert w.log_lines("locked.lost", result.id, "on_lost=fail"), w.tail()
    except BaseException:
        print(c.report())
        raise
    finally:
        c.close()
