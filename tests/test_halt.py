"""Halting a worker's waiters at shutdown (``Node.halt_waiters``).

Every non-nested waiter of the incarnation blocks on ``{ns}:halt:<inc>``
next to its wake list: one push makes all of them (in any process) leave
their queues with ShuttingDown, each pushing the entry back for the next.
"""

from __future__ import annotations

import threading
from typing import Any

import redis

from celery_redislock import LockManager, ShuttingDown
from celery_redislock.worker.node import Node, halt_key, new_incarnation
from engine_helpers import Managers, assert_registry_truth, wait_until

NS = "t"
PREFIX = "{" + NS + "}:"


def waiter(
    mgr: LockManager, resource: str, out: list[Any], halt_ok: bool = True, **kwargs: Any
) -> threading.Thread:
    """``mgr.acquire`` in a thread; ``halt_ok``: as ``@locked`` waits (halted)."""

    def run() -> None:
        try:
            with mgr.context.using(haltable=halt_ok):
                out.append(mgr.acquire(resource, **kwargs))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_halt_makes_every_waiter_of_the_worker_leave_its_queue(
    r: redis.Redis, managers: Managers
) -> None:
    inc = new_incarnation()
    main = managers(heartbeat=False)  # the worker's main process
    children = [managers(), managers()]  # two pool processes of the same worker
    for m in (main, *children):
        m.acquirer.halt_key = halt_key(PREFIX, inc)
    holder = managers()
    held = [holder.acquire(name, timeout=5) for name in ("R", "S", "T")]
    halted: list[list[Any]] = [[], []]
    threads = [waiter(m, "R", out) for m, out in zip(children, halted)]
    wait_until(lambda: r.zcard(f"{PREFIX}q:R") == 2, what="two waiters queued")
    # Not halted: a running body's own acquire (not @locked's wait), and a
    # nested request (inside a held lock, finite timeout).
    plain: list[Any] = []
    nested: list[Any] = []
    kept = [waiter(children[1], "T", plain, halt_ok=False, timeout=30)]
    with children[0].lock("N", timeout=5):
        kept.append(waiter(children[0], "S", nested, timeout=30, nested=True))
        wait_until(
            lambda: r.zcard(f"{PREFIX}q:S") == 1 and r.zcard(f"{PREFIX}q:T") == 1,
            what="the waiters that are not halted",
        )
        node = Node(main, "celery@h", inc)
        node.halt_waiters()
        for t in threads:
            t.join(20)
        assert all(isinstance(out[0], ShuttingDown) for out in halted), halted
        assert r.zcard(f"{PREFIX}q:R") == 0
        assert r.zcard(f"{PREFIX}q:S") == 1 and r.zcard(f"{PREFIX}q:T") == 1
        held[1].release()
        held[2].release()
        for t in kept:
            t.join(20)
        for out in (plain, nested):
            assert not isinstance(out[0], BaseException), out
            out[0].release()
    # A later @locked-style waiter of the halted worker stops at once.
    late: list[Any] = []
    waiter(children[1], "R", late).join(20)
    assert isinstance(late[0], ShuttingDown) and r.zcard(f"{PREFIX}q:R") == 0
    assert r.exists(halt_key(PREFIX, inc))  # pushed back for the next waiter
    held[0].release()
    node.shutdown()
    assert not r.exists(halt_key(PREFIX, inc))
    assert_registry_truth(r, NS)
