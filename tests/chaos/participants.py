"""The Celery participants of the chaos run, and which of them the short run uses.

Each participant is a kind of task the producer sends (``defer``, ``retry``,
``unique``, ``mixed``), a way to make adoptions land near the grant
deadline (``adopt_deadline``) or a fault (``lock_restart``, ``kill_*``).
:mod:`chaos.celery_runner` runs them; this module imports no Celery.
"""

from __future__ import annotations

import os

from .faults import parse_names

#: Participant -> what it adds to the run.
PARTICIPANTS: dict[str, str] = {
    "defer": 'deferred tasks (on_busy="defer"), exclusive and shared',
    "retry": "deferred tasks that call self.retry() once (a flag in their args)",
    "unique": 'UniqueTask with @locked(on_busy="defer"), and duplicate delay() calls',
    "mixed": 'on_busy="wait" tasks on the same resources as the deferred ones',
    "adopt_deadline": "adoptions stalled so they land near the grant deadline (before the "
    "adoption and between its two steps), and SIGSTOP/SIGCONT of pool children",
    "lock_restart": "kill the lock redis-server and start it again, empty (tasks are parked)",
    "kill_child": "SIGKILL a pool child",
    "kill_main": "SIGKILL a worker's main process, restart the worker under the same node name",
    "kill_worker": "SIGKILL a whole worker (process group), restart it under the same node name",
}
ALL_PARTICIPANTS: tuple[str, ...] = tuple(PARTICIPANTS)
#: The participants that are faults (the rest are kinds of tasks).
FAULT_PARTICIPANTS = ("adopt_deadline", "lock_restart", "kill_child", "kill_main", "kill_worker")

#: Participants that expose a known hole on the current code, with the hole.
#: The short run in ``make test`` leaves them out until the fix lands;
#: ``make chaos`` runs every participant. Remove one from here once its fix
#: is merged and the short run passes with it.
KNOWN_TO_FAIL: dict[str, str] = {}

#: The short run's participants (``CHAOS_CELERY_SHORT`` overrides).
SHORT_RUN_PARTICIPANTS: tuple[str, ...] = tuple(
    p for p in ALL_PARTICIPANTS if p not in KNOWN_TO_FAIL
)


def parse_participants(
    text: str | None, default: tuple[str, ...] = ALL_PARTICIPANTS
) -> tuple[str, ...]:
    """Participants from ``"a,b"``, ``"all"`` or ``"none"``; ValueError on an unknown one."""
    return parse_names(text, default, ALL_PARTICIPANTS, PARTICIPANTS, "participants")


def short_run_participants() -> tuple[str, ...]:
    """The short run's participants: ``CHAOS_CELERY_SHORT`` or :data:`SHORT_RUN_PARTICIPANTS`."""
    return parse_participants(os.environ.get("CHAOS_CELERY_SHORT"), SHORT_RUN_PARTICIPANTS)
