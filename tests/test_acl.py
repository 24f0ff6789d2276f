"""Least privilege: the documented ACL is exactly what the code uses, and a
refusal by the ACL is reported as such, never as an answer.

- The ``ACL SETUSER`` line of docs/operations.md is compared with the
  commands derived from the code: every ``redis.call`` of ``lua/*.lua``,
  plus every command ``INFO commandstats`` records while the engine, a worker
  node, the Inspector and every CLI command run as that very user (on
  database 1, so ``SELECT`` is used too). A missing grant fails the exercise
  (the user is refused); a grant nothing uses fails the comparison.
- A user lacking one permission at a time: the API raises PermissionDenied
  naming what was refused; each CLI command either answers exactly as with
  the full ACL (it does not need that permission) or says "permission
  denied" and exits 1. It never prints "nobody waits", a live owner as DEAD,
  or a plan built from unreadable keys.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

import acl_helpers
from celery_redislock import (
    Inspector,
    LockError,
    LockManager,
    LockTimeout,
    PermissionDenied,
    ShuttingDown,
    check_eviction,
)
from celery_redislock.integration.cli import redislock
from celery_redislock.worker import defer
from celery_redislock.worker.node import Node, group_key, halt_key, new_incarnation
from engine_helpers import wait_until
from redis_server import RedisServer
from test_inspect import dead_owner

LUA_DIR = Path(__file__).resolve().parent.parent / "celery_redislock" / "lua"
_CALL_RE = re.compile(r"redis\.p?call\(")
_LITERAL_CALL_RE = re.compile(r"redis\.p?call\(\s*(['\"])([A-Za-z]+)\1")
NS = "acl"
NODENAME = "celery@acl-host"

#: What the test's own admin connection sends while the exercise runs: only
#: commands the Lua scripts send anyway, so they cannot hide a command the
#: Python side stopped (or started) using.
ADMIN_DURING = {"set", "sadd"}
#: Sent by redis-py on connect and refused without harm (CLIENT SETINFO);
#: on Redis < 7 commandstats names no subcommand.
IGNORED = {"auth", "hello", "client", "client|setinfo"}


def lua_commands() -> set[str]:
    """Every command a Lua script calls (lower case); names must be literals."""
    found: set[str] = set()
    for path in sorted(LUA_DIR.glob("*.lua")):
        text = path.read_text(encoding="utf-8")
        code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
        literal = _LITERAL_CALL_RE.findall(code)
        assert len(literal) == len(_CALL_RE.findall(code)), (
            f"{path.name}: a redis.call whose command is not a literal string; "
            "the ACL test cannot derive it"
        )
        found.update(name.lower() for _, name in literal)
    return found


def commandstats(admin: redis.Redis) -> dict[str, dict[str, int]]:
    """``INFO commandstats`` as name -> counters, names lower case (``script|load``)."""
    out: dict[str, dict[str, int]] = {}
    for key, value in admin.info("commandstats").items():
        name = str(key).removeprefix("cmdstat_").lower()
        if name == "script":  # Redis < 7: no subcommand; the library only loads
            name = "script|load"
        out[name] = {k: int(v) for k, v in value.items() if k != "usec_per_call"}
    return out


# -- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module only, so its commandstats count only us."""
    with RedisServer(workdir=tmp_path_factory.mktemp("acl-redis")) as srv:
        yield srv


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    client.flushall()
    try:
        yield client
    finally:
        client.close()


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(redislock, ["--url", url, "--namespace", NS, *args])


# -- the documented ACL is derived from the code --------------------------------------


def test_the_documented_acl_names_one_key_pattern_no_channel_and_no_category() -> None:
    acl = acl_helpers.documented_acl()
    assert acl.key_patterns == ("~{redislock}:*",)
    assert acl.flags == ("on", "resetkeys", "resetchannels", "-@all")
    assert "select" not in acl.commands  # added only for a database other than 0


def test_documented_acl_grants_exactly_the_commands_the_code_sends(
    server: RedisServer, admin: redis.Redis
) -> None:
    admin.execute_command("ACL", "SETUSER", "exercise", "reset")
    acl_helpers.create_lock_user(admin, [NS], user="exercise", select=True)
    url = acl_helpers.user_url(server.url, user="exercise", db=1)
    admin.script_flush()  # so the library has to SCRIPT LOAD after NOSCRIPT
    db1 = redis.Redis.from_url(url.replace("exercise:lock-user-pw@", ""))
    db1.ping()  # connected (and SELECTed) before the counters are reset
    admin.config_resetstat()
    outcomes: list[Any] = []
    try:
        _exercise(url, db1, outcomes)
    finally:
        db1.close()

    stats = commandstats(admin)
    # CONFIG RESETSTAT counts itself once it has run.
    stats[next(n for n in ("config|resetstat", "config") if n in stats)]["calls"] -= 1
    refused = {
        name: s["rejected_calls"]
        for name, s in stats.items()
        if s.get("rejected_calls") and name not in IGNORED
    }
    assert not refused, f"the documented ACL refused commands the code sends: {refused}"
    assert isinstance(outcomes[0], ShuttingDown), outcomes  # the halt reached the waiter
    used = {name for name, s in stats.items() if s["calls"]} - IGNORED
    lua = lua_commands()
    assert lua >= ADMIN_DURING
    derived = lua | used
    documented = acl_helpers.documented_acl().commands | {"select"}
    assert not derived - documented, (
        f"used by the code but missing from docs/operations.md: {sorted(derived - documented)}"
    )
    assert not documented - derived, (
        f"granted in docs/operations.md but never sent: {sorted(documented - derived)}"
    )


def _exercise(url: str, admin: redis.Redis, outcomes: list[Any]) -> None:
    """Everything the library does against Redis, as the restricted user.

    ``admin``: a connection to the same database, already open. ``outcomes``
    receives what the halted waiter got (checked after the refusals, which
    explain a wrong one).
    """
    made: list[LockManager] = []

    def manager(**kw: Any) -> LockManager:
        kw.setdefault("owner_ttl", 1.0)
        kw.setdefault("heartbeat_interval", 0.1)
        m = LockManager(url, NS, **kw)
        made.append(m)
        return m

    try:
        holder, waiter = manager(), manager()
        lease = holder.acquire(exclusive=["a"], shared=["b"], timeout=5)
        # Nobody waits yet: this one blocks in XREAD for sure (below, the
        # waiter may queue before the holder looks, and no XREAD is sent).
        assert not lease.wait_for_contender(0.05)
        got: list[Any] = []
        t = threading.Thread(
            target=lambda: got.append(waiter.acquire(exclusive=["a"], timeout=30)), daemon=True
        )
        t.start()
        assert lease.wait_for_contender(20)
        assert lease.contenders() >= 1
        wait_until(lambda: holder.heartbeat.ticks >= 2, what="holder heartbeat")
        insp = Inspector(holder)
        insp.waiters("a")
        insp.holders("a")
        insp.plan_resource("a")
        lease.release()  # handed to the waiter
        t.join(30)
        assert got and not got[0].released
        got[0].release()
        with pytest.raises(LockTimeout):  # a try that leaves nothing behind
            with holder.lock("b", timeout=0), waiter.lock("b", timeout=0):
                pass

        # Locks held by a task id, adopted by the process that runs the task.
        assert holder.acquire_for_task("t1", "unique:a", ttl=30).granted
        assert waiter.acquire_for_task("t2", "unique:a", ttl=30).holder_task_id == "t1"
        [adopted] = waiter.adopt("t1").leases
        adopted.release()
        holder.acquire_for_task("t3", "unique:b", ttl=30)
        holder.release_task("t3")

        # Limited resources: a slot taken while another is held reads one
        # holder's mode (HRANDFIELD); the Inspector and status read them too.
        slots = [m.acquire(limited={"api": 2}, timeout=5) for m in (holder, waiter)]
        assert insp.lock_info("api").slots == "2/2"
        assert [x.resource for x in insp.limited()] == ["api"]
        for s in slots:
            s.release()

        # Deferred tasks (docs/defer.md): park, hand-off, dispatch, adopt,
        # done, the dispatcher's upkeep, and a withdrawal.
        busy = holder.acquire(exclusive=["d"], timeout=5)
        dreq = holder.request(["d"], [])
        msg = {"name": "t", "args": [], "kwargs": {}, "options": {}, "resources": ["d"]}
        assert defer.park(holder, "d1", dreq, msg, park_ttl=30, grant_ttl=30).outcome == "parked"
        defer.park(holder, "d2", dreq, msg, park_ttl=30, grant_ttl=30)
        busy.release()  # handed to d1: its id goes to the dispatch list
        sent: list[Any] = []
        dispatcher = defer.Dispatcher(
            holder, "acl-inc", publish=lambda *a: sent.append(a), on_withdrawn=lambda *a: None
        )
        dispatcher.step()  # upkeep, BLMOVE, claim, publish, LREM
        assert sent
        [dleased] = defer.adopt(waiter, "d1", 0)[1]
        dleased.release()  # handed to d2
        defer.mark_done(waiter, "d1", waiter.owner_id)
        defer.withdraw(holder, "d2")

        dead = manager(owner_ttl=0.3, heartbeat=False)
        dead.acquire(exclusive=["c"], timeout=5)
        dead_id = dead.owner_id
        dead.close()
        wait_until(lambda: not insp.liveness([dead_id])[dead_id].alive, what="dead owner")
        insp.plan_owner(dead_id)
        insp.owners(nodes=[NODENAME])
        insp.status()
        check_eviction(holder.client)
        assert holder.reconcile().cleaned == 1
        holder.cleanup_owner("nobody")
        admin.set("{acl}:lock:odd", "not a hash")  # TYPE: an odd key is reported
        assert insp.locks(["odd"])[0].odd_type == "string"

        inc = new_incarnation()
        gkey = group_key("{" + NS + "}:", inc)
        # A liveness value naming its incarnation: owners() reads the group (HEXISTS).
        child = manager(heartbeat=False, group=lambda: gkey, name=f"node={NODENAME} inc={inc}")
        node = Node(child, NODENAME, inc)
        node.start()
        child.acquire(exclusive=["n"], timeout=5)  # also starts the lost-owner watcher
        assert any(o.in_group for o in insp.owners())
        admin.sadd("{acl}:owners", "gone-child")
        admin.execute_command("HSET", gkey, "gone-child", "999999.1")  # a dead child
        assert "gone-child" in node.tick().dead  # freed, then HDEL from the group
        insp.node(NODENAME)

        # Warm shutdown: the node pushes its halt list; a waiter of the worker
        # (as @locked waits) leaves its queue and pushes the entry back.
        blocker = child.acquire(exclusive=["h"], timeout=5)
        pool = manager(heartbeat=False)
        pool.acquirer.halt_key = halt_key("{" + NS + "}:", inc)
        halted: list[Any] = []

        def wait_as_locked() -> None:
            try:
                with pool.context.using(haltable=True):
                    halted.append(pool.acquire(exclusive=["h"], timeout=30))
            except BaseException as exc:
                halted.append(exc)

        hw = threading.Thread(target=wait_as_locked, daemon=True)
        hw.start()
        wait_until(lambda: insp.waiters("h"), what="a waiter of the worker")
        node.halt_waiters()  # refused, it only logs node.halt-error: see commandstats
        # The halted waiter leaves its queue; only then is "h" freed (a grant
        # pushed before the waiter reached its BLPOP would be taken first).
        wait_until(lambda: not insp.waiters("h"), what="the halted waiter left its queue")
        blocker.release()
        hw.join(30)
        if halted and not isinstance(halted[0], BaseException):
            halted[0].release()
        outcomes.append(halted[0] if halted else None)

        for args in (
            ["status"],
            ["locks"],
            ["locks", "a", "odd"],
            ["owners", "--node", NODENAME],
            ["waiters", "a"],
            ["release", "--resource", "n", "--force", "--dry-run"],
            ["reconcile", "--yes"],
        ):
            result = cli(url, *args)
            assert result.exit_code == 0, (args, result.output)
        node.shutdown()  # node_stop, cleanup, DEL of the group hash
    finally:
        for m in made:
            m.close()


# -- refusals are reported as refusals ---------------------------------------------


@pytest.fixture
def restricted(server: RedisServer, admin: redis.Redis) -> Callable[..., str]:
    """``restricted(drop=[...])``: URL of a lock user lacking ``drop``."""

    def make(drop: tuple[str, ...] = ()) -> str:
        acl_helpers.create_lock_user(admin, [NS], user="partial", drop=drop)
        return acl_helpers.user_url(server.url, user="partial")

    admin.execute_command("ACL", "SETUSER", "partial", "reset")
    return make


@contextmanager
def _manager_at(url: str, **options: Any) -> Iterator[LockManager]:
    """A manager of the namespace at ``url`` (a restricted user's), closed after."""
    mgr = LockManager(url, NS, **options)
    try:
        yield mgr
    finally:
        mgr.close()


def test_acquire_without_evalsha_raises_permission_denied_naming_the_command(
    restricted: Callable[..., str],
) -> None:
    with _manager_at(restricted(drop=("evalsha",))) as mgr:
        with pytest.raises(PermissionDenied) as info:
            mgr.acquire("a", timeout=0)
        assert isinstance(info.value, LockError)
        # a manager's first script is the data-format check, then acquire
        assert info.value.command == "EVALSHA format"
        text = str(info.value)
        assert "permission denied" in text and "evalsha" in text.lower()
        assert "docs/operations.md" in text and "partial" in text and "lock-user-pw" not in text
        with pytest.raises(PermissionDenied):
            mgr.cleanup_owner("someone")


def test_a_command_refused_inside_a_script_is_permission_denied(
    restricted: Callable[..., str],
) -> None:
    with _manager_at(restricted(drop=("hset",))) as mgr:
        with pytest.raises(PermissionDenied) as info:
            mgr.acquire("a", timeout=0)
        assert info.value.command == "EVALSHA acquire"  # format.lua needs no HSET
        assert "acquire" in str(info.value)


@pytest.mark.parametrize("drop", ["sscan", "exists", "evalsha"])
def test_reconcile_without_a_permission_raises_permission_denied(
    drop: str, restricted: Callable[..., str], redis_server_url: str
) -> None:
    dead_owner(redis_server_url, [(["a"], [])], namespace=NS)
    with _manager_at(restricted(drop=(drop,))) as mgr:
        with pytest.raises(PermissionDenied) as info:
            mgr.reconcile()
        assert drop in str(info.value).lower()


@pytest.mark.parametrize("drop", ["info", "get", "sscan", "exists", "hlen", "hkeys", "hrandfield"])
def test_inspector_status_without_a_permission_raises_permission_denied(
    drop: str, restricted: Callable[..., str], redis_server_url: str
) -> None:
    dead_owner(redis_server_url, [(["a"], [])], namespace=NS)
    with _manager_at(restricted(drop=(drop,)), heartbeat=False) as mgr:
        with pytest.raises(PermissionDenied) as info:
            Inspector(mgr).status()
        assert drop in str(info.value).lower()


@pytest.fixture
def redis_server_url(server: RedisServer, admin: redis.Redis) -> str:
    """The module server's admin URL (emptied by ``admin``)."""
    return server.url


#: Every command the read-only views and the release planning send from Python.
INSPECTION_COMMANDS = [
    "pttl",
    "get",
    "hlen",
    "hgetall",
    "zcard",
    "zrange",
    "hget",
    "hexists",
    "hkeys",
    "hrandfield",
    "type",
    "sscan",
    "hscan",
    "exists",
    "info",
]

CLI_COMMANDS = [
    ["status", "--json"],
    ["locks", "--json"],
    ["locks", "R", "odd", "--json"],
    ["owners", "--node", NODENAME, "--json"],
    ["waiters", "R", "--json"],
    ["release", "--resource", "R", "--force", "--dry-run", "--json"],
    ["release", "--owner", "DEAD", "--dry-run", "--json"],
    ["reconcile", "--dry-run", "--json"],
]


def _stable(output: str) -> Any:
    """The JSON of a command, without the remaining TTLs (they tick down)."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "ttl"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(json.loads(output))


@pytest.fixture
def inspection_state(
    server: RedisServer, admin: redis.Redis, redis_server_url: str
) -> Iterator[dict[str, str]]:
    """A live holder of R, a queued waiter on R, a dead owner, a node, an odd key."""
    dead = dead_owner(redis_server_url, [(["D"], [])], namespace=NS)
    inc = new_incarnation()
    gkey = group_key("{" + NS + "}:", inc)
    holder = LockManager(server.url, NS, group=lambda: gkey, name=f"node={NODENAME} inc={inc}")
    waiter = LockManager(server.url, NS)
    node = Node(holder, NODENAME, inc)
    node.start()
    lease = holder.acquire(exclusive=["R"], timeout=5)
    t = threading.Thread(
        target=lambda: waiter.acquire(shared=["R"], timeout=60).release(), daemon=True
    )
    t.start()
    insp = Inspector(holder)
    wait_until(lambda: insp.waiters("R"), what="queued waiter")
    admin.set("{acl}:lock:odd", "x")
    try:
        yield {"DEAD": dead}
    finally:
        lease.release()
        t.join(30)
        node.shutdown()
        holder.close()
        waiter.close()


@pytest.mark.parametrize("drop", INSPECTION_COMMANDS)
def test_cli_lacking_one_permission_says_permission_denied_or_answers_as_with_all(
    drop: str,
    inspection_state: dict[str, str],
    restricted: Callable[..., str],
    server: RedisServer,
) -> None:
    full = restricted()
    answers: dict[tuple[str, ...], Any] = {}
    for args in CLI_COMMANDS:
        args = [inspection_state.get(a, a) for a in args]
        result = cli(full, *args)
        assert result.exit_code == 0, (args, result.output)
        answers[tuple(args)] = _stable(result.stdout)
    lacking = restricted(drop=(drop,))
    refused = 0
    for args_t, expected in answers.items():
        result = cli(lacking, *args_t)
        if result.exit_code == 0:
            assert _stable(result.stdout) == expected, (
                f"without {drop}, `{' '.join(args_t)}` answered differently:\n{result.output}"
            )
            continue
        refused += 1
        assert result.exit_code == 1, result.output
        assert "permission denied" in result.output, result.output
        assert drop in result.output.lower(), result.output
    assert refused, f"no CLI command needs {drop}: drop it from INSPECTION_COMMANDS"


def test_waiters_without_zrange_is_not_nobody_waits(
    inspection_state: dict[str, str], restricted: Callable[..., str]
) -> None:
    result = cli(restricted(drop=("zrange",)), "waiters", "R")
    assert result.exit_code == 1
    assert "nobody waits" not in result.output
    assert "permission denied" in result.output and "ZRANGE" in result.output


def test_release_without_pttl_never_plans_to_free_a_live_holder(
    inspection_state: dict[str, str], restricted: Callable[..., str]
) -> None:
    result = cli(restricted(drop=("pttl",)), "release", "--resource", "R", "--yes")
    assert result.exit_code == 1
    assert "This will free" not in result.output and "DEAD" not in result.output
    assert "permission denied" in result.output and "PTTL" in result.output


def test_worker_eviction_check_without_info_says_the_acl_refused_it(
    restricted: Callable[..., str],
) -> None:
    with _manager_at(restricted(drop=("info",)), heartbeat=False) as mgr:
        check = mgr.check_eviction()  # tolerated at worker start: the policy is unknown
        assert check.policy is None and check.may_evict
        assert "refused by the Redis user's ACL" in check.describe()
        assert "+info" in check.describe()


def test_wait_for_contender_without_xread_raises_permission_denied(
    restricted: Callable[..., str],
) -> None:
    with _manager_at(restricted(drop=("xread",))) as mgr:
        with mgr.lock("a", timeout=5) as lease:
            with pytest.raises(PermissionDenied) as info:
                lease.wait_for_contender(5)
            assert info.value.command == "XREAD" and "xread" in str(info.value).lower()


def test_plain_commands_of_the_node_raise_permission_denied_not_redis_py_errors(
    restricted: Callable[..., str],
) -> None:
    """The node's own HDEL/DEL (outside scripts) map ACL refusals like scripts do.

    Its heartbeat catches LockError: a redis-py NoPermissionError escaping a
    tick would log a traceback per tick and skip the tick's release retries.
    """
    with _manager_at(restricted(drop=("hdel",))) as mgr:
        with pytest.raises(PermissionDenied) as info:
            mgr.channel.command("HDEL", "{" + NS + "}:group:x", "owner")
        assert info.value.command == "HDEL"
        assert "hdel" in str(info.value).lower()
