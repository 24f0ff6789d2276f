"""Idle time of resources with waiting and deferred tasks mixed on them.

A real ``celery worker -P prefork -c 2`` (the end-to-end harness of
``tests/e2e``; prefetch 1, ``acks_late``) gets ``--tasks`` tasks of
``--work`` seconds spread round-robin over ``--resources`` resources
(``bench:r0``, ``bench:r1``...), sent in a seeded order ``--interval``
seconds apart (0: all at once), a share ``--wait-share`` of them
``on_busy="wait"`` and the rest ``on_busy="defer"``
(``redislock_defer_grant_ttl`` = ``--grant-ttl``). Every task records when
its body ended; its body ran for the ``--work`` seconds before that.

A resource is *idle* while nobody runs a body on it although one of its
tasks was sent and has not ended (it waits in the broker, parked, or in a
pool slot). Reported per run: tasks finished (within ``--deadline`` of the
last send), the makespan, the idle time summed over the resources and per
task, the longest idle stretch and the stretches over 1 s (a grant waiting
for a pool slot until its grant TTL shows as a stretch of about
``--grant-ttl``), and the worker's ``defer.regrant`` (a grant nobody
adopted in its TTL) and ``locked.wait-parked`` (a waiting task gave its
slot up) log lines.

Usage::

    .venv/bin/python -m benchmarks.defer_idle [--tasks 60] [--resources 2]
        [--wait-share 0.3] [--work 0.05] [--grant-ttl 5] [--interval 0]
        [--deadline 90] [--rounds 1] [--seed 1]

Starts its own redis-server and one worker per round. Run from another checkout (a
git worktree of an older commit, with this file copied in) it measures
that checkout's library: the worker runs the package of the checkout the
file sits in. Not a timed test: tests/test_benchmarks_smoke.py runs it small.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import Cluster  # noqa: E402
from redis_server import RedisServer  # noqa: E402

#: A gap this long (s) counts as a stall (far above one dispatch round trip).
STALL = 1.0


@dataclass
class IdleResult:
    """One run: what finished, and how long the resources sat idle."""

    tasks: int
    finished: int
    makespan: float
    idle: float
    gaps: list[float] = field(default_factory=list)
    regrants: int = 0
    wait_parked: int = 0
    left: dict[str, int] = field(default_factory=dict)

    @property
    def longest(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def stalls(self) -> int:
        return sum(1 for g in self.gaps if g > STALL)

    @property
    def per_task(self) -> float:
        return self.idle / self.finished if self.finished else 0.0


def _idle(sends: list[float], ends: list[float], work: float) -> list[tuple[float, float]]:
    """The idle stretches of one resource: nobody runs a body on it although
    a task of it was sent and has not ended. Its bodies ran ``work`` seconds
    before their ends (an exclusive lock: one at a time)."""
    busy = sorted((end - work, end) for end in ends)
    points = sorted({*sends, *ends, *(b for b, _ in busy)})
    stretches: list[tuple[float, float]] = []
    for a, b in zip(points, points[1:]):
        mid = (a + b) / 2
        pending = sum(1 for t in sends if t <= mid) - sum(1 for t in ends if t <= mid)
        running = any(lo <= mid < hi for lo, hi in busy)
        if pending > 0 and not running:
            if stretches and stretches[-1][1] == a:
                stretches[-1] = (stretches[-1][0], b)
            else:
                stretches.append((a, b))
    return stretches


def run_once(
    c: Cluster,
    *,
    tasks: int,
    resources: int,
    wait_share: float,
    work: float,
    interval: float,
    deadline: float,
    seed: int,
) -> IdleResult:
    """Send the tasks (``interval`` s apart; 0: all at once), wait for them
    (at most ``deadline`` s after the last send), measure."""
    c.data.delete("e2e:bench-finish")
    rng = random.Random(seed)
    plan = [
        (f"r{i % resources}", f"T{i}", "wait" if rng.random() < wait_share else "defer")
        for i in range(tasks)
    ]
    rng.shuffle(plan)
    worker = c.processes[0]
    regrants0 = len(worker.log_lines("defer.regrant"))
    parked0 = len(worker.log_lines("locked.wait-parked"))
    sent: dict[str, list[float]] = {}
    results: list[Any] = []
    t0 = time.time()
    for res, tag, mode in plan:
        if interval:
            time.sleep(max(0.0, t0 + interval * len(results) - time.time()))
        sent.setdefault(res, []).append(time.time())
        results.append(c.send(f"bench_{mode}", res, tag, work))
    give_up = time.monotonic() + deadline
    while c.data.llen("e2e:bench-finish") < tasks and time.monotonic() < give_up:
        time.sleep(0.05)
    finished = [json.loads(x) for x in c.data.lrange("e2e:bench-finish", 0, -1)]
    ends: dict[str, list[float]] = {}
    for f in finished:
        ends.setdefault(f["res"], []).append(float(f["at"]))
    last = max((float(f["at"]) for f in finished), default=t0)
    gaps = []
    for res, times in sent.items():
        # Unfinished tasks wait until the run is given up.
        res_ends = ends.get(res, [])
        stop = max(last, time.time()) if len(res_ends) < len(times) else last
        res_ends_or_stop = res_ends + [stop] * (len(times) - len(res_ends))
        gaps += [b - a for a, b in _idle(times, res_ends_or_stop, work)]
    left: dict[str, int] = {}
    for r in results:
        if r.state != "SUCCESS":
            left[r.state] = left.get(r.state, 0) + 1
    for r in results:
        r.forget()
    return IdleResult(
        tasks=tasks,
        finished=len(finished),
        makespan=last - t0,
        idle=sum(gaps),
        gaps=gaps,
        regrants=len(worker.log_lines("defer.regrant")) - regrants0,
        wait_parked=len(worker.log_lines("locked.wait-parked")) - parked0,
        left=left,
    )


def run(
    redis_url: str,
    workdir: Path,
    *,
    tasks: int = 60,
    resources: int = 2,
    wait_share: float = 0.3,
    work: float = 0.05,
    grant_ttl: float = 5.0,
    interval: float = 0.0,
    deadline: float = 90.0,
    rounds: int = 1,
    seed: int = 1,
) -> list[IdleResult]:
    """Run the scenario ``rounds`` times, each on a prefork worker (-c 2) of
    its own (a fresh namespace and queue: a round given up leaves tasks
    behind, which must not run into the next)."""
    out = []
    for i in range(rounds):
        c = Cluster(
            redis_url, workdir / f"round{i}", owner_ttl=10, heartbeat=1, defer_grant_ttl=grant_ttl
        )
        try:
            c.start_worker("bench-idle", concurrency=2)
            out.append(
                run_once(
                    c,
                    tasks=tasks,
                    resources=resources,
                    wait_share=wait_share,
                    work=work,
                    interval=interval,
                    deadline=deadline,
                    seed=seed + i,
                )
            )
        finally:
            c.close()
    return out


def checkout() -> str:
    """The commit of the checkout this file is in (``+`` when it has changes)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+" if dirty else "")


def markdown(results: list[IdleResult], label: str) -> str:
    """One table row per run."""
    lines = [
        "| code | tasks finished | makespan (s) | idle, all resources (s) | idle per task "
        "(ms) | longest idle stretch (s) | stretches > 1 s | defer.regrant | "
        "locked.wait-parked | left unfinished |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        left = ", ".join(f"{n} {s}" for s, n in sorted(r.left.items())) or "-"
        lines.append(
            f"| {label} | {r.finished}/{r.tasks} | {r.makespan:.1f} | {r.idle:.2f} | "
            f"{1000 * r.per_task:.0f} | {r.longest:.2f} | {r.stalls} | {r.regrants} | "
            f"{r.wait_parked} | {left} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=60)
    ap.add_argument("--resources", type=int, default=2)
    ap.add_argument("--wait-share", type=float, default=0.3)
    ap.add_argument("--work", type=float, default=0.05, help="seconds of each body")
    ap.add_argument("--grant-ttl", type=float, default=5.0, help="redislock_defer_grant_ttl")
    ap.add_argument(
        "--interval", type=float, default=0.0, help="seconds between sends (0: all at once)"
    )
    ap.add_argument(
        "--deadline", type=float, default=90.0, help="longest wait after the last send, s"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(workdir=Path(tmp) / "r") as server:
        results = run(
            server.url,
            Path(tmp) / "w",
            tasks=args.tasks,
            resources=args.resources,
            wait_share=args.wait_share,
            work=args.work,
            grant_ttl=args.grant_ttl,
            interval=args.interval,
            deadline=args.deadline,
            rounds=args.rounds,
            seed=args.seed,
        )
    print(markdown(results, f"{checkout()}, interval {args.interval:g} s"))


if __name__ == "__main__":
    main()
