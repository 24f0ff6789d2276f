"""``python -m chaos``: one randomized fault-injection run (``make chaos``).

Run from the repository root with ``PYTHONPATH=.:tests`` (the Makefile does).
Exit status: 0 without violations, 1 with violations, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from . import checker
from .faults import FAULTS, KNOWN_TO_FAIL, parse_faults
from .participants import KNOWN_TO_FAIL as CELERY_KNOWN
from .participants import PARTICIPANTS, parse_participants
from .runner import Config, Outcome, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m chaos",
        description="Randomized fault injection against real redis-servers; checks the "
        "lock invariants from every process's timeline afterwards.",
        epilog="fault kinds: " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()),
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    ap.add_argument("--processes", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--threads", type=int, default=3, help="threads per worker (default 3)")
    ap.add_argument("--resources", type=int, default=8, help="resource names (default 8)")
    ap.add_argument("--owner-ttl", type=float, default=1.5, help="seconds (default 1.5)")
    ap.add_argument(
        "--limited-share",
        type=float,
        default=0.25,
        help="share of requests taking a slot of the limited resource (default 0.25)",
    )
    ap.add_argument("--limited-slots", type=int, default=3, help="its limit N (default 3)")
    ap.add_argument(
        "--asyncio-every",
        type=int,
        default=4,
        help="every N-th worker started is an asyncio service (AsyncLockManager); 0: none "
        "(default 4)",
    )
    ap.add_argument("--faults", default="all", help="comma-separated fault kinds, 'all' or 'none'")
    ap.add_argument(
        "--end",
        choices=("term", "kill"),
        default="term",
        help="end the workers with SIGTERM (default) or SIGKILL them mid-flight",
    )
    ap.add_argument("--out", default="", help="folder for timelines and logs (default: a temp dir)")
    ap.add_argument(
        "--celery",
        choices=("no", "also", "only"),
        default="no",
        help="the Celery participants (real prefork workers): 'also' runs them after the "
        "engine run, splitting --duration in two halves; 'only' runs them alone",
    )
    ap.add_argument(
        "--participants",
        default="all",
        help="Celery participants, comma-separated, 'all' or 'none' "
        f"(known: {', '.join(PARTICIPANTS)})",
    )
    ap.add_argument("--check-only", metavar="FOLDER", help="re-run the checker on a finished run")
    args = ap.parse_args(argv)
    if args.check_only:
        report = checker.check(args.check_only)
        print(json.dumps(report.stats, indent=1))
        print(checker.render(report))
        return 1 if report.violations else 0
    try:
        faults = parse_faults(args.faults)
        participants = parse_participants(args.participants)
    except ValueError as exc:
        ap.error(str(exc))
    seed = args.seed if args.seed is not None else random.randrange(1, 10**9)
    if args.celery == "no":
        return engine_run(args, faults, seed, args.duration)
    half = args.duration / 2 if args.celery == "also" else args.duration
    code = engine_run(args, faults, seed, half) if args.celery == "also" else 0
    return max(code, celery_run(args, participants, seed, half))


def _reported(
    outcome: Outcome[Any], known_title: str, known: dict[str, str], head: str, tail: str
) -> int:
    """Print a run's stats, its violations (with the ``known`` holes they may
    expose) and its verdict line, ``head: <verdict>tail``; return the exit status."""
    print(json.dumps(outcome.stats, indent=1))
    if outcome.violations:
        print(checker.render(checker.Report(outcome.stats, outcome.violations)))
        if known:
            print(known_title)
            for name, why in known.items():
                print(f"  {name}: {why}")
    verdict = f"{len(outcome.violations)} violation(s)" if outcome.violations else "no violation"
    print(f"{head}: {verdict}{tail}")
    return 1 if outcome.violations else 0


def celery_run(
    args: argparse.Namespace, participants: tuple[str, ...], seed: int, duration: float
) -> int:
    """The Celery participants' run (:mod:`chaos.celery_runner`)."""
    from .celery_runner import CeleryConfig
    from .celery_runner import run as run_celery

    out = str(Path(args.out) / "celery") if args.out else ""
    cfg = CeleryConfig(seed=seed, duration=duration, participants=participants, out=out)
    outcome = run_celery(cfg)
    return _reported(
        outcome,
        "participants that expose known holes (tests/chaos/participants.py KNOWN_TO_FAIL):",
        {p: CELERY_KNOWN[p] for p in participants if p in CELERY_KNOWN},
        "chaos (celery)",
        f"; seed={seed}; replay: make chaos CELERY=only SEED={seed} "
        f"DURATION={duration:g}"
        + ("" if args.participants == "all" else f" PARTICIPANTS={args.participants}")
        + f"; output in {cfg.out}",
    )


def engine_run(
    args: argparse.Namespace, faults: tuple[str, ...], seed: int, duration: float
) -> int:
    """The engine-level run (:mod:`chaos.runner`)."""
    out = str(Path(args.out) / "engine") if args.out and args.celery == "also" else args.out
    cfg = Config(
        seed=seed,
        duration=duration,
        processes=args.processes,
        threads=args.threads,
        resources=args.resources,
        owner_ttl=args.owner_ttl,
        faults=faults,
        long_timeout=(max(5.0, 3.3 * args.owner_ttl), max(8.0, 5.3 * args.owner_ttl)),
        limited_share=args.limited_share,
        limited_slots=args.limited_slots,
        asyncio_every=args.asyncio_every,
        out=out,
        end=args.end,
    )
    outcome = run(cfg)
    found = {v.kind for v in outcome.violations}
    return _reported(
        outcome,
        "known engine holes that match (tests/chaos/faults.py KNOWN_TO_FAIL):",
        {k: KNOWN_TO_FAIL[k] for k in faults if KNOWN_TO_FAIL.get(k, "").split(":")[0] in found},
        "chaos",
        f"; seed={seed}; replay: make chaos CELERY=0 SEED={seed} "
        f"DURATION={duration:g}"
        + ("" if args.faults == "all" else f" FAULTS={args.faults}")
        + ("" if args.end == "term" else f" END={args.end}")
        + f"; output in {cfg.out}",
    )


if __name__ == "__main__":
    sys.exit(main())
