"""A worker node whose Redis lost its state (restart without persistence,
FLUSHALL, an evicted group) fences itself and continues as a fresh
incarnation; its pool children learn it too (docs/worker.md, "Redis lost
the node's state").

No Celery: a Node and a forked "pool child" driven directly, against the
real redis-server fixture; ticks are called explicitly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import redis

from celery_redislock import LockLost, LockManager
from celery_redislock.worker.node import IncarnationCell, Node, group_key, new_incarnation, node_key
from engine_helpers import wait_until
from redis_server import RedisServer

NS = "nodeloss"
PREFIX = "{" + NS + "}:"
IV = 0.2
TTL = 2.0


class Worker:
    """A worker's main process in this process: exempt manager + node + cell."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.cell = IncarnationCell(new_incarnation())
        self.mgr = self.manager()
        self.mgr.watcher.exempt_pid = os.getpid()  # the node heartbeat watches it
        self.children: set[int] = set()
        self.node = Node(
            self.mgr,
            "celery@loss",
            self.cell.get(),
            live_pids=lambda: set(self.children),
            incarnation_cell=self.cell,
        )

    def manager(self) -> LockManager:
        cell = self.cell
        return LockManager(
            self.url,
            NS,
            owner_ttl=TTL,
            heartbeat_interval=IV,
            heartbeat=False,
            group=lambda: group_key(PREFIX, cell.get()),
        )

    def fork_child(self) -> tuple[int, int, int]:
        """A pool child: holds ``c`` until its lease is lost, then takes ``d``.

        Reports over a pipe: its owner id, then ``lost <raised>`` and its new
        owner id. Returns (pid, read fd, write fd to tell it to exit).
        """
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                os.close(up_r)
                os.close(down_w)
                mgr = self.mgr  # inherited: a fresh identity after fork
                mgr.become_member()  # what worker_process_init does in a pool child
                lease = mgr.acquire("c", timeout=5)
                os.write(up_w, (lease.owner_id + "\n").encode())
                wait_until(lambda: lease.lost, timeout=30)
                try:
                    lease.check()
                    raised = "0"
                except LockLost:
                    raised = "1"
                again = mgr.acquire("d", timeout=5)
                os.write(up_w, f"lost {raised} {again.owner_id}\n".encode())
                os.read(down_r, 1)
                again.release()
                code = 0
            finally:
                os._exit(code)
        os.close(up_w)
        os.close(down_r)
        self.children.add(pid)
        return pid, up_r, down_w

    def close(self) -> None:
        self.node._heartbeat.stop()
        self.mgr.close()


def read_line(fd: int) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 1)
        assert chunk, "child closed its pipe"
        buf += chunk
    return buf.decode().strip()


@pytest.fixture
def worker(redis_url: str) -> Iterator[Worker]:
    w = Worker(redis_url)
    yield w
    w.close()


def _state_lost_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        rec.getMessage()
        for rec in caplog.records
        if rec.levelno == logging.ERROR and rec.getMessage().startswith("node.state-lost")
    ]


@pytest.mark.parametrize("how", ["flushall", "restart"])
def test_node_whose_redis_lost_its_state_fences_and_continues_as_a_fresh_incarnation(
    how: str,
    worker: Worker,
    redis_server: RedisServer,
    r: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    node, mgr = worker.node, worker.mgr
    assert node.start() == "owner"
    old_inc = node.incarnation
    main_lease = mgr.acquire("m", timeout=5)
    pid, up, down = worker.fork_child()
    try:
        child_owner = read_line(up)
        assert node.tick().state == "owner"
        assert r.hexists(group_key(PREFIX, old_inc), child_owner)
        caplog.set_level(logging.ERROR, logger="celery_redislock.node")

        if how == "flushall":
            r.flushall()
        else:
            redis_server.restart()
        # The pool child notices first here (its watcher reads its key's PTTL
        # while it holds a lease) and registers again, under the incarnation
        # id it still reads: the node has not ticked yet.
        msg = read_line(up).split()
        assert msg[:2] == ["lost", "1"] and msg[2] != child_owner
        child_again = msg[2]
        result = node.tick()

        assert result.state_lost and node.state == "owner"
        new_inc = node.incarnation
        assert new_inc != old_inc and worker.cell.get() == new_inc
        # the main process's lease is lost, without a round trip
        assert main_lease.lost
        with pytest.raises(LockLost):
            main_lease.check()
        client = redis_server.client()
        try:
            # the old incarnation is not re-created; the record names the new one
            assert client.hget(node_key(PREFIX, "celery@loss"), "inc") == new_inc.encode()
            # the next tick adopts the child's new owner into the new group
            # and refreshes it; nothing of the old incarnation is left
            assert not node.tick().state_lost
            assert client.hexists(group_key(PREFIX, new_inc), child_again)
            assert not client.exists(group_key(PREFIX, old_inc))
            assert client.pttl(PREFIX + "alive:" + child_again) > 0
            # later ticks are ordinary; the loss was logged once
            assert not node.tick().state_lost
        finally:
            client.close()
        errors = _state_lost_errors(caplog)
        assert len(errors) == 1 and old_inc in errors[0] and new_inc in errors[0], errors
        # the main process goes on under a fresh owner in the new group
        again = mgr.acquire("m", timeout=5)
        assert again.owner_id != main_lease.owner_id and not again.lost
        assert r.hexists(group_key(PREFIX, new_inc), again.owner_id)
        again.release()
    finally:
        os.write(down, b"x")
        os.waitpid(pid, 0)
        os.close(up)
        os.close(down)


def test_node_whose_group_vanished_fences_and_continues_as_a_fresh_incarnation(
    worker: Worker, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The record survived but the group hash did not (evicted, deleted): the
    # main process's owner is no longer in it, so nothing refreshes it.
    node, mgr = worker.node, worker.mgr
    assert node.start() == "owner"
    old_inc = node.incarnation
    lease = mgr.acquire("m", timeout=5)
    assert node.tick().state == "owner"
    r.delete(group_key(PREFIX, old_inc))
    caplog.set_level(logging.ERROR, logger="celery_redislock.node")
    result = node.tick()
    assert result.state_lost and lease.lost
    assert node.incarnation != old_inc and node.state == "owner"
    assert r.hget(node_key(PREFIX, "celery@loss"), "inc") == node.incarnation.encode()
    assert len(_state_lost_errors(caplog)) == 1


def test_node_tick_feeds_the_main_process_lease_deadline(worker: Worker) -> None:
    # The worker's main process has no heartbeat thread and no watcher: its
    # leases' deadline moves with the node heartbeat's refreshes.
    node, mgr = worker.node, worker.mgr
    node.start()
    lease = mgr.acquire("m", timeout=5)
    first = lease.deadline
    wait_until(lambda: node.tick() and lease.deadline > first, what="tick moved the deadline")
    assert not lease.lost
    lease.release()


def test_incarnation_cell_is_shared_with_forked_children() -> None:
    cell = IncarnationCell("a" * 16)
    r_fd, w_fd = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.read(go_r, 1)
            os.write(w_fd, cell.get().encode())
        finally:
            os._exit(0)
    cell.set("b" * 16)
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    assert os.read(r_fd, 64) == b"b" * 16
    for fd in (r_fd, w_fd, go_r, go_w):
        os.close(fd)
