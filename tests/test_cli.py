"""The operator CLI: ``celery -A proj redislock ...`` and ``python -m celery_redislock``.

Commands run in-process with click's CliRunner against the real Redis
fixture, through a tiny Celery app object (as ``celery -A`` would pass it),
except the entry-point tests, which run the real programs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redislock import FORMAT_VERSION, LockManager
from celery_redislock.integration.cli import redislock
from celery_redislock.worker import defer
from engine_helpers import acquire_as_task, queue_requests
from redis_server import RedisServer
from test_inspect import (
    DEADLINE,
    NS,
    command_delta,
    commandstats,
    dead_owner,
    queued_waiter,
    registries,
    wait_until,
)


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


@pytest.fixture
def app(redis_url: str) -> Celery:
    app = Celery("clitest", set_as_current=False)
    app.conf.redislock_url = redis_url
    app.conf.redislock_namespace = NS
    return app


@pytest.fixture
def cli(app: Celery) -> Callable[..., Result]:
    """Invoke ``celery -A app redislock <args>`` in-process."""
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None, the_app: Any = None) -> Result:
        obj = CLIContext(app=the_app or app, no_color=True, workdir=None)
        return runner.invoke(redislock, list(args), obj=obj, input=input)

    return invoke


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.exception)
    return result


# -- read-only commands ---------------------------------------------------------


def test_status_prints_counts_and_eviction_policy_as_table_and_json(
    cli: Callable[..., Result], managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead_owner(redis_url, [(["a"], [])])
    lease = managers().acquire(exclusive=["b"], timeout=5)
    waiter = queued_waiter(managers(), exclusive=["b"])  # holds nothing, only waits
    wait_until(lambda: "1 request(s) queued" in ok(cli("status")).output, what="the waiter queued")
    out = ok(cli("status")).output
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert "owners 3 (2 alive, 1 dead; 2 holding locks, 1 only waiting)" in lines
    assert "locks 2 registered (1 by dead owners)" in lines
    assert f"fence {lease.fencing_token}" in lines
    assert "'noeviction': keys are never evicted" in out
    assert "WARNING: 1 dead owner(s) still hold 1 lock(s)" in out
    data = json.loads(ok(cli("status", "--json")).stdout)
    assert data["dead_owner_locks"] == 1 and data["fence"] == lease.fencing_token
    assert data["eviction_policy"] == "noeviction" and data["namespace"] == NS
    assert data["holding_owners"] == 2 and data["waiting_only_owners"] == 1
    lease.release()
    waiter.join(DEADLINE)


def test_standalone_help_names_no_app_setting_as_a_default() -> None:
    """``python -m celery_redislock`` has no app: --url is required there."""
    for args in ([], ["locks"]):
        out = subprocess.run(
            [sys.executable, "-m", "celery_redislock", *args, "--help"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "required here" in out and "REDISLOCK_URL" in out, out
        assert "redislock_url" not in out and "broker" not in out, out


def test_locks_table_shows_resource_mode_owner_state_and_waiters(
    cli: Callable[..., Result], managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead = dead_owner(redis_url, [(["repo:42"], [])])
    holder = managers(name="celery@w1")
    lease = holder.acquire(exclusive=["repo:1"], timeout=5)
    waiter = queued_waiter(managers(), exclusive=["repo:1"])
    wait_until(lambda: json.loads(cli("waiters", "repo:1", "--json").stdout), what="queued")
    lines = ok(cli("locks")).output.splitlines()
    assert lines[0].split() == ["RESOURCE", "MODE", "OWNER", "OWNER", "STATE", "WAITING"] + [
        "TASK",
        "NODE",
        "OWNER",
        "INFO",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["repo:1"][:4] == ["repo:1", "exclusive", holder.owner_id, "alive"]
    assert rows["repo:1"][5] == "1"  # one waiter
    assert "name=celery@w1" in lines[[ln.split()[0] for ln in lines].index("repo:1")]
    assert rows["repo:42"][:4] == ["repo:42", "exclusive", dead, "DEAD"]
    data = json.loads(ok(cli("locks", "repo:1", "nothing", "--json")).stdout)
    assert [(d["resource"], len(d["holders"])) for d in data] == [("nothing", 0), ("repo:1", 1)]
    assert data[1]["holders"][0]["token"] == lease.token
    lease.release()
    waiter.join(DEADLINE)


def test_locks_says_so_when_nothing_is_held(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    managers().acquire(exclusive=["gone"], timeout=5).release()  # the namespace is in use
    assert ok(cli("locks")).output.strip() == "no locks held"
    assert json.loads(ok(cli("locks", "--json")).stdout) == []


def test_owners_lists_dead_first_with_registry_size_and_node(
    cli: Callable[..., Result], managers: Callable[..., LockManager], redis_url: str
) -> None:
    dead = dead_owner(redis_url, [(["a", "b"], [])])
    live = managers(name="celery@w2")
    live.acquire(exclusive=["c"], timeout=5)
    lines = ok(cli("owners")).output.splitlines()
    assert lines[0].split() == ["OWNER", "STATE", "LOCKS", "NODE", "PID", "HOST"]
    assert lines[1].split()[:3] == [dead, "DEAD", "2"]
    assert lines[2].split()[:5] == [live.owner_id, "alive", lines[2].split()[2], "1", "celery@w2"]
    data = json.loads(ok(cli("owners", "--json")).stdout)
    assert [(o["owner_id"], o["alive"], o["locks"]) for o in data] == [
        (dead, False, 2),
        (live.owner_id, True, 1),
    ]


def test_waiters_lists_the_queue_in_serving_order(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    lease = managers().acquire(exclusive=["q"], timeout=5)
    w = managers()
    t = queued_waiter(w, shared=["q"])
    data = wait_until(lambda: json.loads(cli("waiters", "q", "--json").stdout), what="queued")
    assert [(d["position"], d["owner_id"], d["mode"], d["state"]) for d in data] == [
        (1, w.owner_id, "shared", "queued")
    ]
    lines = ok(cli("waiters", "q")).output.splitlines()
    assert lines[1].split()[:4] == ["1", "shared", w.owner_id, "alive"]
    lease.release()
    t.join(DEADLINE)
    assert ok(cli("waiters", "q")).output.strip() == "nobody waits for q"


def test_waiters_without_a_resource_lists_every_queue_longest_first(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    holder = managers()
    leases = [holder.acquire(exclusive=[name], timeout=5) for name in ("qa", "qb", "qc")]
    queue_requests(managers(), 3, exclusive=["qb"])
    queue_requests(managers(), 1, exclusive=["qa", "qc"])  # one request, two queues
    queue_requests(managers(), 1, shared=["qc"])
    lines = ok(cli("waiters")).output.splitlines()
    assert [line.split() for line in lines] == [
        ["RESOURCE", "WAITING"],
        ["qb", "3"],
        ["qc", "2"],
        ["qa", "1"],
    ]
    lines = ok(cli("waiters", "--limit", "1")).output.splitlines()
    assert [line.split() for line in lines[:2]] == [["RESOURCE", "WAITING"], ["qb", "3"]]
    assert lines[2] == "... and 2 more resource(s) with waiters (--limit)"
    assert json.loads(ok(cli("waiters", "--json")).stdout) == [
        {"resource": "qb", "waiting": 3},
        {"resource": "qc", "waiting": 2},
        {"resource": "qa", "waiting": 1},
    ]
    out = [" ".join(line.split()) for line in ok(cli("status")).output.splitlines()]
    assert "waiting 5 request(s) queued; most for qb (3): `redislock waiters qb`" in out
    data = json.loads(ok(cli("status", "--json")).stdout)
    assert (data["busiest_resource"], data["busiest_waiting"]) == ("qb", 3)
    for lease in leases:
        lease.release()


def test_waiters_without_a_resource_says_so_when_nobody_waits(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    managers().acquire(exclusive=["alone"], timeout=5)
    assert ok(cli("waiters")).output.strip() == "nobody waits"
    assert json.loads(ok(cli("waiters", "--json")).stdout) == []
    out = [" ".join(line.split()) for line in ok(cli("status")).output.splitlines()]
    assert "waiting 0 request(s) queued" in out


def test_waiters_shows_the_task_of_a_request_waiting_in_wait_mode(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    lease = managers().acquire(exclusive=["q"], timeout=5)
    w = managers()
    plain = queued_waiter(managers(), exclusive=["q"])
    wait_until(lambda: json.loads(cli("waiters", "q", "--json").stdout), what="queued")
    task = threading.Thread(
        target=lambda: acquire_as_task(w, "proj.sync\ntid-7\ncelery@w1", ["q"]).release(),
        daemon=True,
    )
    task.start()
    data = wait_until(
        lambda: (lambda d: d if len(d) == 2 else None)(
            json.loads(cli("waiters", "q", "--json").stdout)
        ),
        what="both queued",
    )
    assert [(d["position"], d["state"], d["task_name"], d["task_id"]) for d in data] == [
        (1, "queued", None, None),
        (2, "queued", "proj.sync", "tid-7"),
    ]
    lines = ok(cli("waiters", "q")).output.splitlines()
    assert lines[1].split()[5:7] == ["queued", "-"] and "proj.sync tid-7" in lines[2]
    lease.release()
    plain.join(DEADLINE)
    task.join(DEADLINE)


def test_waiters_shows_a_parked_task_with_its_name_and_id_in_its_place(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    mgr = managers()
    lease = mgr.acquire(exclusive=["q"], timeout=5)
    w = managers()
    t = queued_waiter(w, exclusive=["q"])
    wait_until(lambda: json.loads(cli("waiters", "q", "--json").stdout), what="queued")
    msg = {"name": "proj.sync", "args": [], "kwargs": {}, "options": {}, "resources": ["q"]}
    req = mgr.request(["q"], [])
    assert defer.park(mgr, "tid-1", req, msg, park_ttl=60, grant_ttl=60).outcome == "parked"
    data = json.loads(ok(cli("waiters", "q", "--json")).stdout)
    assert [(d["position"], d["state"], d["task_id"], d["task_name"]) for d in data] == [
        (1, "queued", None, None),
        (2, "parked", "tid-1", "proj.sync"),
    ]
    lines = ok(cli("waiters", "q")).output.splitlines()
    assert "TASK" in lines[0] and "proj.sync tid-1" in lines[2]
    lease.release()
    t.join(DEADLINE)
    defer.withdraw(mgr, "tid-1")


# -- release ------------------------------------------------------------------


def test_release_of_a_dead_owner_frees_exactly_its_locks_and_leaves_a_live_owner_untouched(
    cli: Callable[..., Result],
    managers: Callable[..., LockManager],
    redis_url: str,
    r: redis.Redis,
) -> None:
    dead = dead_owner(redis_url, [(["d1", "d2"], ["both"])])
    live = managers()
    lease = live.acquire(exclusive=["l1"], shared=["both"], timeout=5)
    before = registries(r)
    out = ok(cli("release", "--owner", dead, "--yes")).output
    assert "This will free 3 lock(s) of 1 owner(s)" in out
    assert f"owner {dead} (DEAD): 3 lock(s)" in out
    for name in ("d1", "d2", "both"):
        assert f"    {name}\n" in out
    assert f"owner {dead}: cleaned, 3 grant(s) released" in out
    after = registries(r)
    assert dead not in after
    assert after[live.owner_id] == before[live.owner_id]
    assert r.hkeys("{t}:lock:both") == [lease.token.encode()]
    assert r.exists("{t}:lock:d1", "{t}:lock:d2") == 0
    assert not lease.lost


def test_release_asks_first_and_frees_nothing_when_not_confirmed(
    cli: Callable[..., Result], redis_url: str, r: redis.Redis
) -> None:
    dead = dead_owner(redis_url, [(["keep:1"], [])])
    result = cli("release", "--owner", dead, input="n\n")
    assert result.exit_code == 1
    assert "keep:1" in result.output and "Free these locks?" in result.output
    assert "Aborted" in result.output
    assert r.hkeys("{t}:lock:keep:1") != []


def test_release_refuses_a_live_owner_without_force(
    cli: Callable[..., Result], managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    live = managers(name="busy")
    lease = live.acquire(exclusive=["in-use"], timeout=5)
    result = cli("release", "--owner", live.owner_id, "--yes")
    assert result.exit_code == 1
    assert "refusing" in result.output and "--force" in result.output
    assert "name=busy" in result.output
    assert r.hkeys("{t}:lock:in-use") == [lease.token.encode()]
    assert not lease.lost


def test_release_force_frees_a_live_owner_which_then_finds_its_lease_lost(
    cli: Callable[..., Result], managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    live = managers(owner_ttl=1.5)  # heartbeat every 0.5 s
    lease = live.acquire(exclusive=["wedged"], timeout=5)
    result = ok(cli("release", "--owner", live.owner_id, "--force", "--yes"))
    assert "WARNING: --force frees the locks of LIVE owners" in result.output
    assert r.exists("{t}:lock:wedged") == 0
    assert r.exists(f"{{t}}:alive:{live.owner_id}") == 0
    wait_until(lambda: lease.lost, what="heartbeat notices it was freed")


def test_release_by_resource_frees_dead_holders_and_names_their_other_locks(
    cli: Callable[..., Result],
    managers: Callable[..., LockManager],
    redis_url: str,
    r: redis.Redis,
) -> None:
    dead = dead_owner(redis_url, [(["elsewhere"], ["res"])])
    live = managers()
    lease = live.acquire(shared=["res"], timeout=5)
    out = ok(cli("release", "--resource", "res", "--yes")).output
    assert f"owner {dead} (DEAD): 2 lock(s)" in out
    assert "    elsewhere\n" in out
    assert f"left alone: {live.owner_id} holds res (shared, alive" in out
    assert r.hkeys("{t}:lock:res") == [lease.token.encode()]
    assert r.exists("{t}:lock:elsewhere") == 0


def test_release_by_resource_held_only_by_live_owners_refuses_without_force(
    cli: Callable[..., Result], managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    lease = managers().acquire(exclusive=["hot"], timeout=5)
    result = cli("release", "--resource", "hot", "--yes")
    assert result.exit_code == 1 and "refusing to free hot" in result.output
    assert r.hkeys("{t}:lock:hot") == [lease.token.encode()]
    assert ok(cli("release", "--resource", "cold", "--yes")).output.strip() == (
        "cold has no holders: nothing to free"
    )


def test_release_json_keeps_stdout_pure_json_and_reports_plan_and_results(
    cli: Callable[..., Result], redis_url: str
) -> None:
    dead = dead_owner(redis_url, [(["j1"], [])])
    result = ok(cli("release", "--owner", dead, "--yes", "--json"))
    data = json.loads(result.stdout)
    assert data["ok"] and data["released"] == 1 and not data["dry_run"]
    assert data["plan"]["owners"][0]["owner_id"] == dead
    assert data["plan"]["owners"][0]["resources"] == ["j1"]
    assert data["results"][0]["status"] == "cleaned"
    assert "This will free 1 lock(s)" in result.stderr


def test_release_dry_run_frees_nothing(
    cli: Callable[..., Result], redis_url: str, r: redis.Redis
) -> None:
    dead = dead_owner(redis_url, [(["dry"], [])])
    out = ok(cli("release", "--owner", dead, "--dry-run")).output
    assert "dry" in out and "dry run: nothing freed" in out
    assert r.exists("{t}:lock:dry") == 1


def test_release_needs_exactly_one_of_owner_or_resource(cli: Callable[..., Result]) -> None:
    assert cli("release").exit_code == 2
    assert cli("release", "--owner", "x", "--resource", "y").exit_code == 2


# -- reconcile ----------------------------------------------------------------


def test_reconcile_frees_every_dead_owner_and_no_live_one(
    cli: Callable[..., Result],
    managers: Callable[..., LockManager],
    redis_url: str,
    r: redis.Redis,
) -> None:
    d1 = dead_owner(redis_url, [(["x1"], [])])
    d2 = dead_owner(redis_url, [(["x2", "x3"], [])])
    live = managers()
    live.acquire(exclusive=["y"], timeout=5)
    dry = ok(cli("reconcile", "--dry-run")).output
    assert d1 in dry and d2 in dry and live.owner_id not in dry
    assert r.exists("{t}:lock:x1") == 1
    result = cli("reconcile", input="y\n")
    ok(result)
    assert "3 grant(s) released" in result.output and "2 cleaned" in result.output
    assert set(registries(r)) == {live.owner_id}
    assert r.exists("{t}:lock:y") == 1
    data = json.loads(ok(cli("reconcile", "--yes", "--json")).stdout)
    assert data["cleaned"] == 0 and data["alive"] == 1


# -- settings -------------------------------------------------------------------


def test_url_defaults_to_a_redis_broker_and_namespace_can_be_overridden(
    cli: Callable[..., Result], managers: Callable[..., LockManager], redis_url: str
) -> None:
    managers().acquire(exclusive=["ns-check"], timeout=5)
    broker_app = Celery("brokeronly", broker=redis_url, set_as_current=False)
    broker_app.conf.redislock_namespace = NS
    data = json.loads(ok(cli("locks", "--json", the_app=broker_app)).stdout)
    assert [d["resource"] for d in data] == ["ns-check"]
    other = cli("locks", "--json", "--namespace", "other")
    assert other.exit_code == 1 and "'other'" in other.output, other.output
    used = LockManager(redis_url, "other", heartbeat=False)
    used.acquire(exclusive=["o"], timeout=5).release()
    used.close()
    other_locks = json.loads(ok(cli("locks", "--json", "--namespace", "other")).stdout)
    assert other_locks == []
    via_group = json.loads(ok(cli("--namespace", "other", "locks", "--json")).stdout)
    assert via_group == []


def test_missing_redis_url_is_a_usage_error_that_says_what_to_set(
    cli: Callable[..., Result],
) -> None:
    amqp_app = Celery("amqp", broker="amqp://guest@localhost//", set_as_current=False)
    result = cli("status", the_app=amqp_app)
    assert result.exit_code == 2 and "redislock_url" in result.output


def test_unreachable_redis_is_a_one_line_error_naming_the_url(
    cli: Callable[..., Result], free_port: Callable[..., int]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = cli("owners", "--url", url)
    assert result.exit_code == 1 and f"Redis at {url} is unavailable" in result.output


# -- cost -----------------------------------------------------------------------


def test_locks_and_owners_commands_issue_no_scan_or_keys(
    cli: Callable[..., Result],
    managers: Callable[..., LockManager],
    redis_url: str,
    r: redis.Redis,
) -> None:
    dead_owner(redis_url, [(["c1", "c2"], [])])
    managers().acquire(exclusive=["c3"], timeout=5)
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.set(f"noise:{i}", "x")
    pipe.execute()
    before = commandstats(r)
    ok(cli("locks"))
    ok(cli("owners", "--json"))
    ok(cli("status"))
    delta = command_delta(before, commandstats(r))
    assert "scan" not in delta and "keys" not in delta, delta
    assert delta.get("sscan", 0) >= 1  # the registries were walked


# -- entry points -----------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("REDISLOCK_URL", None)
    env.pop("REDISLOCK_NAMESPACE", None)
    return env


def test_standalone_entry_runs_without_a_celery_app(redis_url: str) -> None:
    owner = dead_owner(redis_url, [(["standalone"], [])])
    proc = subprocess.run(
        [sys.executable, "-m", "celery_redislock", "--url", redis_url, "--namespace", NS]
        + ["locks", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    [info] = json.loads(proc.stdout)
    assert info["resource"] == "standalone" and info["holders"][0]["owner_id"] == owner
    no_url = subprocess.run(
        [sys.executable, "-m", "celery_redislock", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert no_url.returncode == 2 and "--url" in no_url.stderr


def test_celery_program_finds_the_redislock_command_through_its_entry_point(
    redis_url: str, tmp_path: Path
) -> None:
    owner = dead_owner(redis_url, [(["via-celery"], [])])
    (tmp_path / "cliproj.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            app = Celery("cliproj", broker={redis_url!r})
            app.conf.redislock_namespace = {NS!r}
            """
        )
    )
    celery_bin = Path(sys.executable).with_name("celery")
    proc = subprocess.run(
        [str(celery_bin), "-A", "cliproj", "redislock", "owners", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(_env(), PYTHONPATH=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr
    assert [o["owner_id"] for o in json.loads(proc.stdout)] == [owner]


def test_release_refuses_a_holder_token_and_names_its_owner(cli: Callable[..., Result]) -> None:
    result = cli("release", "--owner", "123-abc|req", "--yes")
    assert result.exit_code == 2 and "its owner is '123-abc'" in result.output


def test_a_refused_unrelated_setting_warns_but_the_cli_still_runs(
    cli: Callable[..., Result], app: Celery, r: redis.Redis
) -> None:
    app.conf.redislock_owner_ttl = "soon"
    r.set("{t}:format", str(FORMAT_VERSION))  # the namespace is in use
    result = ok(cli("owners"))
    assert "redislock_owner_ttl" in result.stderr and "no owners" in result.stdout


def test_owners_node_option_labels_the_owners_of_that_worker(
    cli: Callable[..., Result], managers: Callable[..., LockManager], r: redis.Redis
) -> None:
    r.hset("{t}:node:celery@w9", mapping={"inc": "i9"})
    m = managers(group=lambda: "{t}:group:i9")
    m.acquire(exclusive=["n"], timeout=5)
    row = ok(cli("owners", "--node", "celery@w9")).output.splitlines()[1].split()
    assert row[0] == m.owner_id and row[4] == "celery@w9"
    r.set("{t}:tomb:i9", "1")
    assert "celery@w9 (evicted)" in ok(cli("owners", "--node", "celery@w9")).output


# -- no surprises ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "locks", "owners", "reconcile", "waiters"])
def test_a_namespace_never_used_is_reported_not_shown_as_healthy_and_empty(
    cli: Callable[..., Result], command: str
) -> None:
    args = [command, "--namespace", "typo-ns"] + (["r1"] if command == "waiters" else [])
    result = cli(*args, input="y\n")
    assert result.exit_code == 1, result.output
    assert "namespace 'typo-ns'" in result.output and "never been used" in result.output
    assert "no locks held" not in result.output and "owners 0" not in result.output


def test_an_empty_namespace_option_is_a_usage_error_not_the_default(
    cli: Callable[..., Result], managers: Callable[..., LockManager]
) -> None:
    managers().acquire(exclusive=["busy"], timeout=5)
    for args in (("locks", "--namespace", ""), ("--namespace", "", "locks")):
        result = cli(*args)
        assert result.exit_code == 2, result.output
        assert "--namespace is empty" in result.output
        assert "busy" not in result.output


def test_release_dry_run_shows_live_owners_marked_and_never_refuses(
    cli: Callable[..., Result], managers: Callable[..., LockManager], redis_url: str, r: redis.Redis
) -> None:
    dead = dead_owner(redis_url, [(["shared-res", "d-only"], [])])
    live = managers(name="celery@busy")
    live.acquire(exclusive=["live-only"], timeout=5)
    by_owner = ok(cli("release", "--owner", live.owner_id, "--dry-run"))
    assert f"owner {live.owner_id}" in by_owner.output and "live-only" in by_owner.output
    assert "LIVE: needs --force" in by_owner.output and "refusing" not in by_owner.output
    assert "dry run: nothing freed" in by_owner.output
    by_resource = ok(cli("release", "--resource", "live-only", "--dry-run"))
    assert "LIVE: needs --force" in by_resource.output and live.owner_id in by_resource.output
    both = ok(cli("release", "--owner", dead, "--owner", live.owner_id, "--dry-run", "--json"))
    data = json.loads(both.stdout)
    assert data["dry_run"] is True and data["needs_force"] == [live.owner_id]
    assert {o["owner_id"] for o in data["plan"]["owners"]} == {dead, live.owner_id}
    forced = ok(cli("release", "--owner", live.owner_id, "--dry-run", "--force"))
    assert "needs --force" not in forced.output and "WARNING: --force" in forced.output
    assert r.exists("{t}:lock:live-only") == 1 and r.exists("{t}:lock:d-only") == 1
    # without --dry-run a live owner is still refused
    assert cli("release", "--owner", live.owner_id, "--yes").exit_code == 1
    assert r.exists("{t}:lock:live-only") == 1


def test_release_of_an_owner_that_does_not_exist_says_so_and_exits_non_zero(
    cli: Callable[..., Result], redis_url: str, r: redis.Redis
) -> None:
    dead = dead_owner(redis_url, [(["kept"], [])])
    for extra in ((), ("--dry-run",), ("--owner", dead)):
        result = cli("release", "--owner", "no-such-owner", *extra, "--yes")
        assert result.exit_code == 1, result.output
        assert "no such owner" in result.output and "no-such-owner" in result.output
    assert r.exists("{t}:lock:kept") == 1  # nothing freed, not even the real one


def test_without_an_app_or_url_the_error_says_to_pass_A_proj_or_url(tmp_path: Path) -> None:
    env = {k: v for k, v in _env().items() if not k.startswith("REDISLOCK_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)  # this tree's package
    for argv in (["celery", "redislock", "status"], ["celery_redislock", "status"]):
        proc = subprocess.run(
            [sys.executable, "-m", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "-A proj" in proc.stderr and "--url" in proc.stderr, (argv, proc.stderr)


# -- data format -----------------------------------------------------------------


def test_a_namespace_of_another_data_format_is_refused_naming_both_versions(
    cli: Callable[..., Result], redis_url: str, r: redis.Redis
) -> None:
    dead = dead_owner(redis_url, [(["old-format"], [])])
    r.set("{t}:format", str(FORMAT_VERSION + 1))
    for args in (
        ("status",),
        ("locks",),
        ("release", "--owner", dead, "--yes"),
        ("reconcile", "-y"),
    ):
        result = cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert f"format {FORMAT_VERSION + 1}" in result.output, result.output
        assert f"uses format {FORMAT_VERSION}" in result.output
        assert "docs/operations.md" in result.output
    assert r.exists("{t}:lock:old-format") == 1
    shown = ok(cli("format"))
    assert "MISMATCH" in shown.output and f"format          {FORMAT_VERSION + 1}" in shown.output


def test_format_switch_refuses_while_owners_are_left_then_switches_after_the_drain(
    cli: Callable[..., Result], redis_url: str, r: redis.Redis
) -> None:
    dead = dead_owner(redis_url, [(["drain-me"], [])])
    r.set("{t}:format", "0")  # an older release's format
    refused = cli("format", "--switch", "--yes")
    assert refused.exit_code == 1 and "1 owner(s) of the old release" in refused.output
    assert r.get("{t}:format") == b"0"
    # the old release drains: its reconcile frees the dead owner
    r.set("{t}:format", str(FORMAT_VERSION))
    ok(cli("release", "--owner", dead, "--yes"))
    r.set("{t}:format", "0")
    ok(cli("format", "--switch", "--yes"))
    assert r.get("{t}:format") == str(FORMAT_VERSION).encode()
    data = json.loads(ok(cli("status", "--json")).stdout)
    assert data["format_version"] == FORMAT_VERSION == data["release_format"]


# -- docs -----------------------------------------------------------------------


def test_operations_guide_lists_every_key_of_the_key_reference_and_every_command() -> None:
    import re

    import celery_redislock.protocol.keys as keys_module

    root = Path(__file__).resolve().parent.parent
    # A '|' inside a Markdown table cell is written with a backslash.
    guide = (root / "docs" / "operations.md").read_text().replace("\\|", "|")
    doc = keys_module.__doc__ or ""
    for key in re.findall(r"``(\{ns\}:[^`]+)``", doc):
        assert f"`{key}`" in guide, key
    for command in redislock.commands:
        assert f"redislock {command}" in guide, command
