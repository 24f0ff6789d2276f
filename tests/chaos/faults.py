"""The faults the runner injects, and which of them the short run uses.

Each fault is recorded in ``faults.jsonl`` as ``{"kind", "t0", "t1",
"target", ...}`` (``t0``/``t1`` on ``time.monotonic()``: when it started and
when it ended, equal for an instant fault).
"""

from __future__ import annotations

import os
from collections.abc import Collection

#: kind -> what the runner does.
FAULTS: dict[str, str] = {
    "kill_worker": "SIGKILL a worker process (and start a new one)",
    "stop_worker": "SIGSTOP a worker for 1.5-2.5 x owner_ttl, then SIGCONT",
    "redis_restart": "kill the lock redis-server and start it again, empty (no persistence)",
    "redis_stop": "SIGSTOP the lock redis-server for 1-3 s, then SIGCONT",
    "client_kill": "CLIENT KILL ID of about half of the lock server's clients",
    "script_flush": "SCRIPT FLUSH on the lock server",
    "force_cleanup": "LockManager.cleanup_owner(owner, force=True) of a random registered owner",
    "reconcile": "LockManager.reconcile() from 2-3 workers at once (SIGUSR1)",
}

ALL_FAULTS: tuple[str, ...] = tuple(FAULTS)

#: Faults that expose a known engine bug on the current code, with what they
#: expose (docs/chaos.md has the traces). The short run (``make test``) leaves
#: them out until the fix lands; ``make chaos`` uses every fault. Remove a
#: kind from here once its fix is merged and the short run passes with it.
KNOWN_TO_FAIL: dict[str, str] = {}

#: The short run's fault set, unless ``CHAOS_SHORT_FAULTS`` (comma-separated
#: kinds, or ``all``) says otherwise.
SHORT_RUN_FAULTS: tuple[str, ...] = tuple(k for k in ALL_FAULTS if k not in KNOWN_TO_FAIL)


def parse_faults(text: str | None, default: tuple[str, ...] = ALL_FAULTS) -> tuple[str, ...]:
    """Fault kinds from ``"a,b"``, ``"all"`` or ``"none"``; ValueError on an unknown kind."""
    return parse_names(text, default, ALL_FAULTS, FAULTS, "fault kinds")


def parse_names(
    text: str | None,
    default: tuple[str, ...],
    every: tuple[str, ...],
    known: Collection[str],
    what: str,
) -> tuple[str, ...]:
    """Names from ``"a,b"``, ``"all"`` (``every``) or ``"none"``; ``default`` for
    no text; ValueError (naming ``what``) on a name not in ``known``."""
    if text is None or not text.strip():
        return default
    text = text.strip()
    if text == "all":
        return every
    if text == "none":
        return ()
    names = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in names if k not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def short_run_faults() -> tuple[str, ...]:
    """The short run's faults: ``CHAOS_SHORT_FAULTS`` or :data:`SHORT_RUN_FAULTS`."""
    return parse_faults(os.environ.get("CHAOS_SHORT_FAULTS"), SHORT_RUN_FAULTS)
