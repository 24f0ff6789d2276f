"""A chaos worker process: threads that lock random resource sets.

Run by :mod:`chaos.runner` as ``python -m chaos.worker ...``. Each thread
loops: pick 1-3 of the resources, each exclusive or shared, and a timeout
(0, short, or long); acquire; ``check()``; fenced read-modify-write of
every exclusive resource and fenced read of every shared one on the store;
``check()`` again; release. A share of the requests (``--limited-share``,
drawn from a random stream of their own, so the others are the same
sequence as without them) takes one slot of the limited resource
``--limited-name`` (``limited={name: N}``, N = ``--limited-slots``), alone
or with one exclusive resource: the same section, the slot itself touching
nothing on the store (its holders are not exclusive of each other; the
checker counts them). Every step is appended to this process's
timeline (JSON lines, ``t`` = ``time.monotonic()``, which is one clock for
every process of the machine, ``w`` = wall time).

Timeline events (besides ``ev``, ``p`` process label, ``pid``, ``th``,
``t``, ``w``):

==============  ===========================================================
``start``       owner_ttl, namespace
``acq``         op, x (exclusive names), s (shared names), l (limited name ->
                its limit; absent for a request without one), timeout, owner
``granted``     op, fence, owner
``timeout``     op (LockTimeout)
``acq_error``   op, err
``cs_begin``    op, ok (check() passed), tc (time just before check())
``store``       op, res, kind (read/write), mode, ok, value
``cs_end``      op, ok, tc (time just before check())
``released``    op, lost (lease.lost after release)
``release_error`` op, lost, err
``reconcile``   owners_seen, alive, cleaned, released, errors
``exit``        (clean exit after SIGTERM)
==============  ===========================================================

With ``--asyncio`` the process is an asyncio service instead: one
``AsyncLockManager`` (one owner for the process, as the asyncio front-end
has), ``--threads`` coroutines on one event loop in place of the threads,
the same requests from the same random streams, the same timeline (``th``
is the coroutine's name), the store reached through ``asyncio.to_thread``
(the fenced read and write stay inside the critical section). Its
SIGUSR1 reconcile goes through a ``LockManager`` of its own.

SIGTERM: finish the current operation and exit. SIGUSR1: run
``LockManager.reconcile()`` once, from a thread of its own. While the file
named by ``--quiet-flag`` exists (the runner's calm between fault storms),
only thread 0 works, pausing 0.3-1.5 s between requests, so resources are
left alone long enough for the checker to prove a waiter was not blocked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import threading
import time
from typing import Any

from celery_redislock import LockManager, LockTimeout
from celery_redislock.asyncio import AsyncLockManager

from .store import Store


class Timeline:
    """Append-only JSON lines, one per event, flushed at each line."""

    def __init__(self, path: str, label: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()
        self.label = label

    def write(self, ev: str, **fields: Any) -> None:
        task = _current_task()
        rec = {
            "ev": ev,
            "p": self.label,
            "pid": os.getpid(),
            "th": task.get_name() if task is not None else threading.current_thread().name,
            "t": time.monotonic(),
            "w": time.time(),
            **fields,
        }
        line = json.dumps(rec, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop: a thread
        return None


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tl = Timeline(args.timeline, args.label)
        self.manager = self.make_manager()
        self.store = Store(args.store_url)
        self.resources = [f"r{i}" for i in range(args.resources)]
        self.weights = [1.0 / (i + 1) for i in range(args.resources)]
        self.stopping = threading.Event()
        self.reconcile_now = threading.Event()

    def make_manager(self) -> Any:
        return LockManager(self.args.url, self.args.namespace, owner_ttl=self.args.owner_ttl)

    def begin(self) -> None:
        """The timeline's start and the signals (SIGTERM: stop, SIGUSR1: reconcile)."""
        self.tl.write("start", owner_ttl=self.args.owner_ttl, namespace=self.args.namespace)
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGUSR1, lambda *_: self.reconcile_now.set())

    def end(self) -> None:
        self.tl.write("exit")
        self.tl.close()

    def run(self) -> None:
        self.begin()
        threads = [
            threading.Thread(target=self.loop, args=(i,), name=f"T{i}", daemon=True)
            for i in range(self.args.threads)
        ]
        rec = threading.Thread(target=self.reconcile_loop, name="reconcile", daemon=True)
        rec.start()
        for th in threads:
            th.start()
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(0.1)  # short joins: signal handlers run in this thread
        self.manager.close()
        self.end()

    def reconcile_loop(self) -> None:
        while not self.stopping.is_set():
            if not self.reconcile_now.wait(0.2):
                continue
            self.reconcile_now.clear()
            reconcile_into(self.tl, self.manager)

    def pick(self, rng: random.Random) -> tuple[list[str], list[str], float]:
        # r0 is the busiest and the last resource the quietest (weight 1/(i+1)),
        # so that some resources are left alone long enough for the waiter check.
        k = rng.choice((1, 1, 2, 2, 3))
        names: list[str] = []
        while len(names) < k:
            name = rng.choices(self.resources, self.weights)[0]
            if name not in names:
                names.append(name)
        ex = [n for n in names if rng.random() < 0.6]
        sh = [n for n in names if n not in ex]
        return ex, sh, self.pick_timeout(rng)

    def pick_timeout(self, rng: random.Random) -> float:
        """A request's timeout: 0 (a try) a fifth of the time, else short
        (0.1 to 1.5 s) or, three times in ten, long (``--long-timeout``)."""
        roll = rng.random()
        if roll < 0.2:
            return 0.0
        if roll < 0.7:
            return round(rng.uniform(0.1, 1.5), 3)
        return round(rng.uniform(*self.args.long_timeout), 3)

    def pick_limited(self, rng: random.Random) -> tuple[list[str], dict[str, int], float]:
        """A request of one slot of the limited resource, alone or (half of
        them) with one exclusive resource, and its timeout."""
        ex = [rng.choices(self.resources, self.weights)[0]] if rng.random() < 0.5 else []
        return ex, {self.args.limited_name: self.args.limited_slots}, self.pick_timeout(rng)

    def quiet(self) -> bool:
        """The runner's calm: the file ``--quiet-flag`` exists."""
        return bool(self.args.quiet_flag) and os.path.exists(self.args.quiet_flag)

    def streams(self, index: int) -> tuple[random.Random, random.Random]:
        """Loop ``index``'s random streams: its requests', and the limited
        requests' own (so that the others stay as without them)."""
        base = f"{self.args.seed}:{self.args.label}:{index}"
        return random.Random(base), random.Random(f"{base}:limited")

    def next_op(self, index: int, n: int, rng: random.Random, lrng: random.Random) -> Any:
        """Operation ``n`` of loop ``index``: (its stream, its name, limited?)."""
        op = f"{self.args.label}.{index}.{n}"
        if self.args.limited_share and lrng.random() < self.args.limited_share:
            return lrng, op, True
        return rng, op, False

    @staticmethod
    def pause(rng: random.Random, quiet: bool) -> float:
        """The pause after an operation: long in a calm, short in a storm."""
        return rng.uniform(0.3, 1.5) if quiet else rng.uniform(0.0, 0.06)

    def draw(self, rng: random.Random, op: str, limited: bool) -> Any:
        """The request of operation ``op`` (exclusive, shared, limited,
        timeout), written to the timeline as its ``acq``."""
        owner = self.manager.owner_id
        if limited:
            ex, lim, timeout = self.pick_limited(rng)
            self.tl.write("acq", op=op, x=ex, s=[], l=lim, timeout=timeout, owner=owner)
            return ex, [], lim, timeout
        ex, sh, timeout = self.pick(rng)
        self.tl.write("acq", op=op, x=ex, s=sh, timeout=timeout, owner=owner)
        return ex, sh, {}, timeout

    def loop(self, index: int) -> None:
        rng, lrng = self.streams(index)
        n = 0
        while not self.stopping.is_set():
            quiet = self.quiet()
            if quiet and index > 0:
                time.sleep(0.1)  # in a calm only thread 0 works, and slowly
                continue
            n += 1
            self.operation(*self.next_op(index, n, rng, lrng))
            time.sleep(self.pause(rng, quiet))

    def operation(self, rng: random.Random, op: str, limited: bool = False) -> None:
        tl = self.tl
        ex, sh, lim, timeout = self.draw(rng, op, limited)
        try:
            lease = self.manager.acquire(ex, sh, limited=lim or None, timeout=timeout)
        except LockTimeout:
            tl.write("timeout", op=op)
            return
        except Exception as exc:
            tl.write("acq_error", op=op, err=repr(exc))
            time.sleep(0.05)
            return
        fence = lease.fencing_token
        tl.write("granted", op=op, fence=fence, owner=lease.owner_id)
        hold = rng.uniform(0.0, 0.03)
        try:
            tc = time.monotonic()
            ok = _check(lease)
            tl.write("cs_begin", op=op, ok=ok, tc=tc)
            if ok:
                for res in ex:
                    accepted, value = self.store.read(res, fence, "x")
                    tl.write(
                        "store", op=op, res=res, kind="read", mode="x", ok=accepted, value=value
                    )
                    if not accepted:
                        continue
                    time.sleep(hold)
                    accepted, before = self.store.write(res, fence, value, value + 1, op)
                    tl.write(
                        "store", op=op, res=res, kind="write", mode="x", ok=accepted, value=before
                    )
                for res in sh:
                    accepted, value = self.store.read(res, fence, "s")
                    tl.write(
                        "store", op=op, res=res, kind="read", mode="s", ok=accepted, value=value
                    )
                # A slot holds a while (the checker counts the holders at once).
                time.sleep(hold + (rng.uniform(0.0, 0.05) if lim else 0.0))
            tc = time.monotonic()
            tl.write("cs_end", op=op, ok=_check(lease), tc=tc)
        except Exception as exc:
            tl.write("store_error", op=op, err=repr(exc))
        try:
            lease.release()
        except Exception as exc:
            tl.write("release_error", op=op, lost=lease.lost, err=repr(exc))
        else:
            tl.write("released", op=op, lost=lease.lost)


class AsyncWorker(Worker):
    """The asyncio service: coroutines where :class:`Worker` has threads."""

    def make_manager(self) -> Any:
        return AsyncLockManager(self.args.url, self.args.namespace, owner_ttl=self.args.owner_ttl)

    def run(self) -> None:
        self.begin()
        rec = threading.Thread(target=self.reconcile_loop, name="reconcile", daemon=True)
        rec.start()
        asyncio.run(self.main())
        self.end()

    def reconcile_loop(self) -> None:
        manager: LockManager | None = None
        while not self.stopping.is_set():
            if not self.reconcile_now.wait(0.2):
                continue
            self.reconcile_now.clear()
            if manager is None:
                manager = LockManager(
                    self.args.url, self.args.namespace, owner_ttl=self.args.owner_ttl
                )
            reconcile_into(self.tl, manager)
        if manager is not None:
            manager.close()

    async def main(self) -> None:
        coros = [asyncio.create_task(self.aloop(i), name=f"A{i}") for i in range(self.args.threads)]
        try:
            await asyncio.gather(*coros)
        finally:
            await self.manager.close()

    async def aloop(self, index: int) -> None:
        rng, lrng = self.streams(index)
        n = 0
        while not self.stopping.is_set():
            quiet = self.quiet()
            if quiet and index > 0:
                await asyncio.sleep(0.1)
                continue
            n += 1
            await self.aoperation(*self.next_op(index, n, rng, lrng))
            await asyncio.sleep(self.pause(rng, quiet))

    async def aoperation(self, rng: random.Random, op: str, limited: bool = False) -> None:
        tl = self.tl
        ex, sh, lim, timeout = self.draw(rng, op, limited)
        try:
            lease = await self.manager.acquire(ex, sh, limited=lim or None, timeout=timeout)
        except LockTimeout:
            tl.write("timeout", op=op)
            return
        except Exception as exc:
            tl.write("acq_error", op=op, err=repr(exc))
            await asyncio.sleep(0.05)
            return
        fence = lease.fencing_token
        tl.write("granted", op=op, fence=fence, owner=lease.owner_id)
        hold = rng.uniform(0.0, 0.03)
        store = self.store
        try:
            tc = time.monotonic()
            ok = _check(lease)
            tl.write("cs_begin", op=op, ok=ok, tc=tc)
            if ok:
                for res in ex:
                    accepted, value = await asyncio.to_thread(store.read, res, fence, "x")
                    tl.write(
                        "store", op=op, res=res, kind="read", mode="x", ok=accepted, value=value
                    )
                    if not accepted:
                        continue
                    await asyncio.sleep(hold)
                    accepted, before = await asyncio.to_thread(
                        store.write, res, fence, value, value + 1, op
                    )
                    tl.write(
                        "store", op=op, res=res, kind="write", mode="x", ok=accepted, value=before
                    )
                for res in sh:
                    accepted, value = await asyncio.to_thread(store.read, res, fence, "s")
                    tl.write(
                        "store", op=op, res=res, kind="read", mode="s", ok=accepted, value=value
                    )
                await asyncio.sleep(hold + (rng.uniform(0.0, 0.05) if lim else 0.0))
            tc = time.monotonic()
            tl.write("cs_end", op=op, ok=_check(lease), tc=tc)
        except Exception as exc:
            tl.write("store_error", op=op, err=repr(exc))
        try:
            await lease.release()
        except Exception as exc:
            tl.write("release_error", op=op, lost=lease.lost, err=repr(exc))
        else:
            tl.write("released", op=op, lost=lease.lost)


def _check(lease: Any) -> bool:
    try:
        lease.check()
    except Exception:
        return False
    return True


def reconcile_into(tl: Timeline, manager: LockManager) -> None:
    """Reconcile through ``manager``; write its report (or its error) to ``tl``."""
    try:
        rep = manager.reconcile()
    except Exception as exc:
        tl.write("reconcile_error", err=repr(exc))
        return
    tl.write(
        "reconcile",
        owners_seen=rep.owners_seen,
        alive=rep.alive,
        cleaned=rep.cleaned,
        released=rep.released,
        errors=len(rep.errors),
    )


def reconcile_once(args: argparse.Namespace) -> None:
    """The end-of-run reconcile, run by several of these processes at once."""
    tl = Timeline(args.timeline, args.label)
    manager = LockManager(args.url, args.namespace, owner_ttl=args.owner_ttl)
    try:
        reconcile_into(tl, manager)
    finally:
        manager.close()
        tl.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--store-url", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--timeline", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--seed", required=True)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--resources", type=int, default=8)
    ap.add_argument("--owner-ttl", type=float, default=1.5)
    ap.add_argument("--long-timeout", type=float, nargs=2, default=(5.0, 8.0))
    ap.add_argument("--quiet-flag", default="", help="file whose presence means: go quiet")
    ap.add_argument("--limited-share", type=float, default=0.0, help="share of limited requests")
    ap.add_argument("--limited-name", default="lim")
    ap.add_argument("--limited-slots", type=int, default=3)
    ap.add_argument("--reconcile-once", action="store_true")
    ap.add_argument("--asyncio", action="store_true", help="an AsyncLockManager service")
    args = ap.parse_args()
    if args.reconcile_once:
        reconcile_once(args)
    elif args.asyncio:
        AsyncWorker(args).run()
    else:
        Worker(args).run()


if __name__ == "__main__":
    main()
