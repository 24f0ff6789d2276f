"""Engine-level tests of a worker node's incarnation (celery_redislock.worker.node).

No Celery: a Node is driven directly (start, tick, shutdown) against the real
redis-server fixture. Heartbeat threads are not started; ticks are called
explicitly, so nothing depends on timing except the eviction thresholds,
which are measured by Redis TIME and waited for with a polling helper.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from celery_redislock import Lease, LockManager, LockTimeout
from celery_redislock.engine.identity import (
    parse_proc_stat,
    pid_of_tag,
    process_tag,
    read_proc_stat,
)
from celery_redislock.worker.node import (
    Node,
    free_dead_member,
    group_key,
    new_incarnation,
    node_key,
    tomb_key,
)
from engine_helpers import wait_until as wait_for
from redis_server import RedisServer

NS = "nodetest"
PREFIX = "{" + NS + "}:"
IV = 0.2  # heartbeat interval, s: eviction threshold = 0.4 s
TTL = 2.0


@pytest.fixture(scope="module")
def redis_server(private_redis_server: RedisServer) -> RedisServer:
    """This module counts server commands: a server no other module uses."""
    return private_redis_server


class Worker:
    """A simulated worker incarnation in this process: manager + node."""

    def __init__(
        self,
        url: str,
        nodename: str = "celery@host",
        iv: float = IV,
        ttl: float = TTL,
        **node_kw: object,
    ) -> None:
        self.inc = new_incarnation()
        key = group_key(PREFIX, self.inc)
        self.mgr = LockManager(
            url,
            NS,
            owner_ttl=ttl,
            heartbeat_interval=iv,
            heartbeat=False,
            group=lambda: key,
        )
        self.children: set[int] = set()
        self.node = Node(
            self.mgr,
            nodename,
            self.inc,
            live_pids=lambda: set(self.children),
            **node_kw,  # type: ignore[arg-type]
        )

    def close(self) -> None:
        self.mgr.close()


@pytest.fixture
def workers(redis_url: str) -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(nodename: str = "celery@host", **kw: object) -> Worker:
        w = Worker(redis_url, nodename, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.node._heartbeat.stop()
        w.close()


def started(workers: Callable[..., Worker], *args: object, **kw: object) -> Worker:
    """``workers(*args, **kw)`` with its node started."""
    w = workers(*args, **kw)
    w.node.start()
    return w


def started_holding(
    workers: Callable[..., Worker], resource: str = "repo:1", **kw: object
) -> tuple[Worker, Lease]:
    """A started worker (``workers(**kw)``) whose main process holds ``resource``."""
    w = started(workers, **kw)
    return w, w.mgr.acquire(resource, timeout=1)


def member(url: str, group: str, owner_ttl: float = TTL) -> LockManager:
    """A manager that joins ``group`` (a pool child's), without a heartbeat of its own."""
    return LockManager(
        url, NS, owner_ttl=owner_ttl, heartbeat_interval=IV, heartbeat=False, group=lambda: group
    )


def contender(url: str) -> LockManager:
    """A standalone manager (its own heartbeat) that contends for the test's locks."""
    return LockManager(url, NS, owner_ttl=TTL, heartbeat_interval=IV)


def fill(r: redis.Redis, n: int) -> None:
    """Empty Redis, then ``n`` unrelated keys."""
    r.flushall()
    pipe = r.pipeline(transaction=False)
    for i in range(0, n, 1000):
        pipe.mset({f"unrelated:{j}": "x" for j in range(i, min(n, i + 1000))})
    pipe.execute()


def assert_same_commands_without_scan(deltas: list[dict[str, int]]) -> None:
    """The command counts of both key-space sizes are the same, with no SCAN or KEYS."""
    small, large = deltas
    assert small == large
    assert not any(k.startswith(("cmdstat_scan", "cmdstat_keys")) for k in large)


def assert_predecessor_kept(r: redis.Redis, old: Worker, record: bool = True) -> None:
    """``old``'s lock of repo:1 and liveness stay, no tombstone (and, with
    ``record``, the node record still names it)."""
    assert r.exists(f"{PREFIX}lock:repo:1")
    assert r.exists(f"{PREFIX}alive:{old.mgr.owner_id}")
    assert not r.exists(tomb_key(PREFIX, old.inc))
    if record:
        assert r.hget(node_key(PREFIX, "celery@host"), "inc") == old.inc.encode()


def fake_live_child(w: Worker, r: redis.Redis) -> int:
    """A live process (our parent) the pool reports as a child, in the group as
    ``fake-owner`` (a bare pid) with a short liveness; its pid."""
    other_pid = os.getppid()
    w.children.add(other_pid)
    r.hset(group_key(PREFIX, w.inc), "fake-owner", str(other_pid))
    r.set(f"{PREFIX}alive:fake-owner", "x", px=500)
    return other_pid


def age_record(r: redis.Redis, nodename: str, ms: int) -> None:
    """Pretend the record's last beat was ``ms`` ago (Redis TIME)."""
    sec, usec = r.time()
    r.hset(node_key(PREFIX, nodename), "hb_ms", str(sec * 1000 + usec // 1000 - ms))


def commandstats(r: redis.Redis) -> dict[str, int]:
    stats = r.info("commandstats")
    return {k: int(v["calls"]) for k, v in stats.items() if k not in ("cmdstat_info",)}


def fork_child(body: Callable[[], int], close: tuple[int, ...] = ()) -> int:
    """Fork a child that closes the fds ``close``, runs ``body`` and exits with
    the status it returns (1 if it raised); return its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its pipes
        code = 1
        try:
            for fd in close:
                os.close(fd)
            code = body()
        finally:
            os._exit(code)
    return pid


def fork_child_holding(url: str, inc: str, resource: str) -> int:
    """Fork a child that joins ``inc``'s group, takes ``resource`` and exits."""
    r_fd, w_fd = os.pipe()

    def body() -> int:
        mgr = member(url, group_key(PREFIX, inc))
        mgr.acquire(resource, timeout=5)
        os.write(w_fd, mgr.owner_id.encode())
        return 0

    pid = fork_child(body, close=(r_fd,))
    os.close(w_fd)
    with os.fdopen(r_fd, "rb") as f:
        owner = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and owner
    return pid


# -- start-up ---------------------------------------------------------------


def test_brand_new_node_start_costs_constant_commands_without_scan(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    deltas = []
    for n in (100, 50_000):
        fill(r, n)
        assert r.dbsize() == n
        w = workers(f"celery@new{n}")
        r.script_flush()
        r.config_resetstat()
        assert w.node.start() == "owner"
        w.node.tick()
        deltas.append(commandstats(r))
        w.node.shutdown()
    assert_same_commands_without_scan(deltas)


def test_brand_new_node_creates_its_record(workers: Callable[..., Worker], r: redis.Redis) -> None:
    w = workers()
    assert w.node.start() == "owner"
    rec = r.hgetall(node_key(PREFIX, "celery@host"))
    assert rec[b"inc"] == w.inc.encode()
    assert int(rec[b"pid"]) == os.getpid()
    assert w.node.tick().owned
    assert r.hget(node_key(PREFIX, "celery@host"), "hb") == b"1"


def test_predecessor_with_stale_heartbeat_is_evicted_at_start(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    old, lease = started_holding(workers)
    # Read now: once freed, old.mgr's lost-owner watcher retires the identity.
    old_id = old.mgr.owner_id
    age_record(r, "celery@host", 10_000)  # it crashed long ago (its beat is stale)

    new = workers()
    assert new.node.start() == "owner"
    assert r.exists(tomb_key(PREFIX, old.inc))
    assert not r.exists(f"{PREFIX}alive:{old_id}")
    assert not r.exists(f"{PREFIX}lock:repo:1")
    assert not r.exists(group_key(PREFIX, old.inc))
    assert r.hget(node_key(PREFIX, "celery@host"), "inc") == new.inc.encode()
    # The new incarnation can take the resource at once.
    new.mgr.acquire("repo:1", timeout=0).release()
    assert not lease.released


def test_predecessor_whose_heartbeat_stops_is_evicted_after_two_intervals(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    old = started(workers)
    old.node.tick()
    old.mgr.acquire("repo:1", timeout=1)  # its liveness is still fresh (TTL 2 s)
    old_id = old.mgr.owner_id  # read before its identity can be retired

    new = workers()
    assert new.node.start() == "watching"
    assert r.exists(f"{PREFIX}lock:repo:1")
    # The predecessor never beats again: within ~2 intervals a tick evicts it.
    wait_for(lambda: new.node.tick().predecessor == old.inc, what="eviction")
    assert new.node.state == "owner"
    assert not r.exists(f"{PREFIX}lock:repo:1")
    assert r.ttl(f"{PREFIX}alive:{old_id}") == -2


def test_predecessor_whose_heartbeat_keeps_advancing_is_a_duplicate_never_freed(
    workers: Callable[..., Worker], r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Interval 1 s: eviction needs 2 s without a beat; the first worker beats
    # every few ms here, so only a 2 s stall of this test could fail it.
    first, _ = started_holding(workers, iv=1.0)

    second = workers(iv=1.0)
    assert second.node.start() == "watching"
    deadline = time.monotonic() + 2.5  # past the eviction threshold
    while time.monotonic() < deadline:
        first.node.tick()
        res = second.node.tick()
        assert res.predecessor is None
        time.sleep(0.02)
    assert second.node.state == "duplicate"
    assert "node.duplicate" in caplog.text
    assert_predecessor_kept(r, first)
    # The duplicate still refreshes its own owners.
    second.mgr.acquire("repo:2", timeout=1)
    assert second.node.tick().lost == []


def test_eviction_compare_and_set_refuses_when_heartbeat_advanced(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    old, _ = started_holding(workers)
    new = workers()
    assert new.node.start() == "watching"
    seen_hb = r.hget(node_key(PREFIX, "celery@host"), "hb").decode()
    old.node.tick()  # it beats between our watch and our eviction
    age_record(r, "celery@host", 10_000)
    reply = new.node.manager.channel.call(
        "node_evict",
        [new.node.node_key],
        [PREFIX, old.inc, seen_hb, "1", "evict", new.inc, "1", "h", "0", "200", "60000", "60000"],
    )
    assert reply[0] in ("changed", b"changed")
    assert_predecessor_kept(r, old)


def test_tombstoned_incarnation_heartbeat_reports_evicted_and_fences(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    fenced: list[bool] = []
    old, lease = started_holding(workers, on_evicted=lambda: fenced.append(True))
    age_record(r, "celery@host", 10_000)  # it stalled (SIGSTOP, GC, partition)
    new = workers()
    assert new.node.start() == "owner"

    res = old.node.tick()  # it resumes
    assert res.evicted and old.node.state == "evicted"
    assert fenced == [True]
    assert lease.lost
    with pytest.raises(Exception, match="lease lost"):
        lease.check()
    # Nothing was refreshed or re-created for it.
    assert not r.exists(f"{PREFIX}alive:{lease.owner_id}")
    assert r.hget(node_key(PREFIX, "celery@host"), "inc") == new.inc.encode()
    # Its shutdown never touches the successor's record.
    old.node.shutdown()
    assert r.hget(node_key(PREFIX, "celery@host"), "inc") == new.inc.encode()


def test_successor_never_frees_its_own_locks_when_evicting(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    old, _ = started_holding(workers, "repo:old")
    new = workers()
    mine = new.mgr.acquire("repo:new", timeout=1)  # before the eviction
    age_record(r, "celery@host", 10_000)
    assert new.node.start() == "owner"
    assert not r.exists(f"{PREFIX}lock:repo:old")
    assert r.hexists(f"{PREFIX}lock:repo:new", mine.token)
    assert new.node.tick().lost == []


def test_fast_restart_cleanup_off_leaves_predecessor_to_expire(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    old, _ = started_holding(workers)
    age_record(r, "celery@host", 1_000)  # stale for eviction, not for owner_ttl
    new = workers(fast_restart_cleanup=False)
    assert new.node.start() == "watching"
    assert_predecessor_kept(r, old, record=False)


# -- children ----------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_dead_child_locks_freed_in_one_tick_and_group_entry_removed(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    w, main_lease = started_holding(workers, "main:1")
    pid = fork_child_holding(redis_url, w.inc, "repo:child")
    group = {k.decode(): pid_of_tag(v) for k, v in r.hgetall(group_key(PREFIX, w.inc)).items()}
    assert pid in group.values()
    child_owner = next(o for o, p in group.items() if p == pid)
    assert r.exists(f"{PREFIX}lock:repo:child")

    res = w.node.tick()  # the child is gone (exited and reaped)
    assert res.dead == [child_owner]
    assert not r.exists(f"{PREFIX}lock:repo:child")
    assert not r.hexists(group_key(PREFIX, w.inc), child_owner)
    assert not r.sismember(f"{PREFIX}owners", child_owner)
    # The main process's own owner is refreshed, not freed.
    assert r.hexists(f"{PREFIX}lock:main:1", main_lease.token)
    assert r.pttl(f"{PREFIX}alive:{w.mgr.owner_id}") > 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_dead_child_cleanup_cost_is_independent_of_keyspace(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    deltas = []
    for n in (100, 50_000):
        fill(r, n)
        w = started(workers, f"celery@cost{n}")
        w.node.tick()
        fork_child_holding(redis_url, w.inc, "repo:child")
        r.script_flush()
        r.config_resetstat()
        assert len(w.node.tick().dead) == 1
        deltas.append(commandstats(r))
        w.node.shutdown()
    assert_same_commands_without_scan(deltas)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_child_exit_notice_beats_at_once_and_frees_the_dead_childs_locks(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    w = started(workers, iv=30.0, ttl=90.0)  # a regular tick is 30 s away
    pid = fork_child_holding(redis_url, w.inc, "repo:child")  # exited and reaped
    assert r.exists(f"{PREFIX}lock:repo:child")
    w.node.start_heartbeat()

    assert w.node.child_exited(pid) is True
    wait_for(lambda: not r.exists(f"{PREFIX}lock:repo:child"), 10, "the child's lock freed")
    wait_for(lambda: w.node.ticks >= 1, 10, "the woken tick to finish")
    assert w.node.ticks == 1  # one beat, the woken one
    assert r.hlen(group_key(PREFIX, w.inc)) == 0


def test_child_exit_notice_for_a_live_pid_wakes_nothing_and_frees_nothing(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    w = started(workers)
    other_pid = fake_live_child(w, r)  # a live process the pool reports as its child

    assert w.node.child_exited(other_pid) is False
    assert not w.node._heartbeat._wake
    assert w.node.tick().dead == []
    assert r.hexists(group_key(PREFIX, w.inc), "fake-owner")


def fork_holder(
    mgr: LockManager, resource: str, report: int, go: int, close: tuple[int, ...] = ()
) -> int:
    """Fork a helper that takes ``resource`` with ``mgr`` (inherited) and holds it.

    The helper writes a JSON line to ``report`` (pid, owner), blocks until it reads one byte from
    ``go``, writes a second line (``lost``, ``check``: whether
    ``lease.check()`` passed), releases and exits 0. It closes the fds in
    ``close`` (the test's ends of the pipes), so that it sees EOF on ``go``
    when the test ends early.
    """

    def body() -> int:  # pragma: no cover - runs in the helper
        lease = mgr.acquire(resource, timeout=5)
        line = {"pid": os.getpid(), "owner": lease.owner_id}
        os.write(report, (json.dumps(line) + "\n").encode())
        if not os.read(go, 1):
            return 1  # the test ended early
        try:
            lease.check()
            checked = True
        except Exception:
            checked = False
        line = {"pid": os.getpid(), "lost": lease.lost, "check": checked}
        os.write(report, (json.dumps(line) + "\n").encode())
        lease.release()
        return 0

    return fork_child(body, close)


def reap(pid: int) -> None:
    """Wait for a forked child of the test (or SIGKILL it after 30 s)."""
    try:
        wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 30, f"child {pid} to exit")
    except ChildProcessError:  # already reaped by the test
        pass
    except AssertionError:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise


def hold_past_ttl(w: Worker, r: redis.Redis, contender: LockManager, owner: str, res: str) -> None:
    """Tick the node until twice the owner TTL passed (Redis TIME) while ``owner``
    holds ``res``: no tick may report it, and a try of ``contender`` must fail."""
    sec, usec = r.time()
    start_ms = sec * 1000 + usec // 1000
    ticks = 0

    def past_ttl() -> bool:
        nonlocal ticks
        result = w.node.tick()
        ticks += 1
        assert owner not in result.dead and owner not in result.lost, result
        with pytest.raises(LockTimeout):
            contender.acquire(res, timeout=0)
        assert r.hkeys(f"{PREFIX}lock:{res}") and all(
            t.decode().startswith(owner + "|") for t in r.hkeys(f"{PREFIX}lock:{res}")
        )
        sec, usec = r.time()
        return ticks >= 5 and sec * 1000 + usec // 1000 - start_ms > 2 * TTL * 1000

    wait_for(past_ttl, 60, f"{res} held past owner_ttl", interval=IV)
    assert owner.encode() not in r.hkeys(group_key(PREFIX, w.inc))
    assert r.pttl(f"{PREFIX}alive:{owner}") > 0  # its own heartbeat keeps it


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_helper_forked_from_the_main_process_is_a_standalone_owner_never_freed(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    # A task of a threads/solo pool runs in the worker's main process: a
    # helper it forks is neither the main process nor a pool child. It keeps
    # its own liveness and the node never touches it.
    w, main_lease = started_holding(workers, "main:1")
    rival = contender(redis_url)
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = fork_holder(w.mgr, "repo:h", report_w, go_r, close=(report_r, go_w))
    os.close(report_w)  # a helper that dies early ends the pipe: no hang
    os.close(go_r)
    try:
        with os.fdopen(report_r, "r") as lines:
            held = json.loads(lines.readline())
            hold_past_ttl(w, r, rival, held["owner"], "repo:h")
            os.write(go_w, b"g")
            done = json.loads(lines.readline())
        assert done == {"pid": pid, "lost": False, "check": True}
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        rival.acquire("repo:h", timeout=0).release()  # released: free at once
        assert not main_lease.lost and r.hexists(f"{PREFIX}lock:main:1", main_lease.token)
    finally:
        rival.close()
        os.close(go_w)  # EOF: a helper still waiting exits
        reap(pid)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_helper_forked_from_a_pool_child_is_a_standalone_owner_never_freed(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    # A prefork task runs in a pool child (a group member): a helper it
    # forks is not in the pool, and a group owner of a pid outside the pool
    # would be freed as a dead child on the next tick.
    w = started(workers)
    rival = contender(redis_url)
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()

    def pool_child() -> int:  # pragma: no cover - holds a lock, forks a helper
        w.mgr.become_member()  # what worker_process_init does
        lease = w.mgr.acquire("pool:1", timeout=5)
        line = {"pid": os.getpid(), "owner": lease.owner_id}
        os.write(report_w, (json.dumps(line) + "\n").encode())
        helper = fork_holder(w.mgr, "repo:h", report_w, go_r)
        _, status = os.waitpid(helper, 0)
        lease.release()
        return os.waitstatus_to_exitcode(status)

    child = fork_child(pool_child, close=(report_r, go_w))
    w.children.add(child)
    os.close(report_w)  # a child that dies early ends the pipe: no hang
    os.close(go_r)
    try:
        with os.fdopen(report_r, "r") as lines:
            pool = json.loads(lines.readline())
            held = json.loads(lines.readline())
            assert r.hexists(group_key(PREFIX, w.inc), pool["owner"])  # the pool child joined
            hold_past_ttl(w, r, rival, held["owner"], "repo:h")
            os.write(go_w, b"g")
            done = json.loads(lines.readline())
        assert done == {"pid": held["pid"], "lost": False, "check": True}
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        rival.acquire("repo:h", timeout=0).release()
    finally:
        rival.close()
        os.close(go_w)  # EOF: a helper still waiting exits, then its parent
        reap(child)


def test_live_child_registered_as_bare_pid_is_refreshed_not_freed(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    w = started(workers)
    # A live "child" whose pid the pool reports: simulate with our parent's pid.
    # Its group value is a bare pid (an older registration): compared by pid.
    fake_live_child(w, r)
    res = w.node.tick()
    assert res.dead == [] and res.lost == []
    assert r.pttl(f"{PREFIX}alive:fake-owner") > 1000


def test_process_tag_is_pid_and_start_time_parsed_after_the_last_paren() -> None:
    fields = ["S", "4242"] + [str(n) for n in range(5, 22)] + ["987654", "0", "0"]
    # Field 22 (starttime) is the 20th field after the command name, which
    # may contain spaces and parentheses.
    line = "1234 (evil) name (x)) " + " ".join(fields) + "\n"
    assert parse_proc_stat(line) == ("S", 4242, 987654)
    with pytest.raises(ValueError):
        parse_proc_stat("1234 (truncated) S 1")
    assert pid_of_tag("1234.987654") == 1234
    assert pid_of_tag(b"1234.987654") == 1234
    assert pid_of_tag("1234") == 1234  # a bare pid (older registration)
    with pytest.raises(ValueError):
        pid_of_tag("not-a-tag")
    me = os.getpid()
    if sys.platform.startswith("linux"):
        with open(f"/proc/{me}/stat") as f:
            start = parse_proc_stat(f.read())[2]
        assert process_tag(me) == f"{me}.{start}"
    assert pid_of_tag(process_tag(me)) == me


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
def test_dead_owner_whose_pid_was_reused_by_a_live_child_is_freed_not_refreshed(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    w = started(workers)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        w.children.add(child.pid)
        st = read_proc_stat(child.pid)
        assert st is not None
        key = group_key(PREFIX, w.inc)
        made = [
            LockManager(redis_url, NS, owner_ttl=TTL, heartbeat=False, group=lambda: key)
            for _ in range(2)
        ]
        try:
            dead_mgr, live_mgr = made
            dead_mgr.acquire("repo:old", timeout=5)
            live_lease = live_mgr.acquire("repo:new", timeout=5)
            # Read once: when the tick frees it, dead_mgr's lost-owner watcher
            # retires that identity and owner_id then names a fresh one.
            dead_id = dead_mgr.owner_id
            # The dead owner's process had the child's pid but started earlier:
            # the pid was reused by the live child (race R6).
            r.hset(key, dead_id, f"{child.pid}.{st[2] - 1}")
            # The live child's own owner carries its real tag.
            r.hset(key, live_mgr.owner_id, f"{child.pid}.{st[2]}")
            r.pexpire(f"{PREFIX}alive:{live_mgr.owner_id}", 500)

            res = w.node.tick()
            assert res.dead == [dead_id] and res.lost == []
            assert not r.exists(f"{PREFIX}lock:repo:old")
            assert not r.hexists(key, dead_id)
            assert not r.sismember(f"{PREFIX}owners", dead_id)
            # The live child is refreshed, not freed.
            assert r.hexists(f"{PREFIX}lock:repo:new", live_lease.token)
            assert r.hexists(key, live_mgr.owner_id)
            assert r.pttl(f"{PREFIX}alive:{live_mgr.owner_id}") > 1000
        finally:
            for m in made:
                m.close()
    finally:
        child.kill()
        child.wait()


def test_a_process_frees_a_dead_member_of_its_own_group_and_nothing_else(
    workers: Callable[..., Worker], r: redis.Redis, redis_url: str
) -> None:
    """free_dead_member: what a pool child uses when a sibling that died
    still holds a lock it needs, before the node's tick has freed it."""
    w, other = workers(), workers("celery@other")
    alone = contender(redis_url)
    group = group_key(PREFIX, w.inc)
    r_fd, w_fd = os.pipe()

    def sibling() -> int:  # pragma: no cover - reports through the pipe, then is killed
        mgr = member(redis_url, group, owner_ttl=60)
        mgr.acquire("sib:1", timeout=5)
        os.write(w_fd, mgr.owner_id.encode())
        time.sleep(600)  # until killed
        return 0

    pid = fork_child(sibling, close=(r_fd,))
    os.close(w_fd)
    owner = os.read(r_fd, 200).decode()
    os.close(r_fd)
    try:
        assert owner and r.hexists(group, owner)
        # Alive: never freed, by its own worker or any other process.
        for mgr in (w.mgr, other.mgr, alone):
            assert free_dead_member(mgr, owner) is None
        assert r.exists(f"{PREFIX}lock:sib:1")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # Dead, but not of their group: left to the usual paths (its liveness).
    for mgr in (other.mgr, alone):
        assert free_dead_member(mgr, owner) is None
    assert r.exists(f"{PREFIX}lock:sib:1")
    # A tag naming a live process (this one) is not dead, whatever the owner.
    tag = process_tag(os.getpid())
    r.hset(group, owner, tag)
    assert free_dead_member(w.mgr, owner) is None
    # Its pid reused by another process (other start time): dead.
    stale = tag.split(".")[0] + "." + str(int(tag.split(".")[1]) - 1)
    r.hset(group, owner, stale)
    report = free_dead_member(w.mgr, owner)
    assert report is not None and report.released == 1
    assert not r.exists(f"{PREFIX}lock:sib:1")
    assert r.exists(f"{PREFIX}dead:{owner}")  # tombstoned, as the node does
    alone.close()


def test_owner_whose_liveness_vanished_is_reported_lost_and_its_leases_marked(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    w, lease = started_holding(workers)
    r.delete(f"{PREFIX}alive:{lease.owner_id}")  # e.g. evicted by maxmemory
    res = w.node.tick()
    assert res.lost == [lease.owner_id]
    assert lease.lost
    assert not r.exists(f"{PREFIX}lock:repo:1")
    # The process carries on under a new identity that joins the group.
    again = w.mgr.acquire("repo:1", timeout=1)
    assert again.owner_id != lease.owner_id
    assert r.hexists(group_key(PREFIX, w.inc), again.owner_id)


# -- shutdown -----------------------------------------------------------------


def test_shutdown_frees_every_owner_and_deletes_own_record(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    w, _ = started_holding(workers)
    w.mgr.acquire("repo:2", shared="remote:1", timeout=1)
    reports = w.node.shutdown()
    assert sum(x.released for x in reports) == 3
    assert not r.exists(node_key(PREFIX, "celery@host"))
    assert not r.exists(group_key(PREFIX, w.inc))
    assert not r.exists(f"{PREFIX}lock:repo:1", f"{PREFIX}lock:repo:2", f"{PREFIX}lock:remote:1")
    assert w.node.shutdown() == []  # idempotent


def test_heartbeat_thread_keeps_owners_alive_past_their_ttl(
    workers: Callable[..., Worker], r: redis.Redis
) -> None:
    w, lease = started_holding(workers)
    w.node.start_heartbeat()
    # The liveness TTL is 2 s; wait for enough ticks to span more than that.
    wait_for(lambda: w.node.ticks >= int(TTL / IV) + 3, what="heartbeat ticks")
    assert r.pttl(f"{PREFIX}alive:{lease.owner_id}") > 0
    assert not lease.lost
    w.node.shutdown()
    assert not r.exists(f"{PREFIX}lock:repo:1")


def test_node_module_does_not_import_celery() -> None:
    import subprocess

    code = (
        "import sys, celery_redislock.worker.node, celery_redislock; print('celery' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_outage_logs_one_heartbeat_error_then_a_resumed_line(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every tick of an outage fails; the log gets one ERROR line, not one per tick.

    The ticks are called directly (no thread), so the count is exact: three
    failed ticks log one ``node.heartbeat-error`` (the next reminder is a
    minute away), and the first good tick logs ``node.heartbeat-resumed``
    with the number of failed ticks.
    """
    from tcp_proxy import TcpProxy

    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(port) as proxy:
        w = Worker(proxy.url, nodename="celery@outage")
        try:
            w.node.start()
            caplog.set_level("INFO", logger="celery_redislock.node")
            proxy.cut()
            for _ in range(3):
                w.node._safe_tick()
            errors = [m for m in caplog.messages if m.startswith("node.heartbeat-error ")]
            assert len(errors) == 1, errors
            assert "failed_ticks=1 " in errors[0]
            assert w.node.failed_ticks == 3
            proxy.restore()
            w.node._safe_tick()
            assert w.node.failed_ticks == 0
            resumed = [m for m in caplog.messages if m.startswith("node.heartbeat-resumed ")]
            assert resumed == ["node.heartbeat-resumed node=celery@outage failed_ticks=3"]
        finally:
            w.close()
