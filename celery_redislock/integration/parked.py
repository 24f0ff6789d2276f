"""How a parked deferred task leaves its pool slot, and how Celery words it.

A task parked by ``@locked(on_busy="defer")`` ends its run with Celery's
``Ignore`` (the message is acked, no state is stored: the park record is
the task from then on), and Celery's trace logs every ``Ignore`` as
``Task <name>[<id>] ignored``, which reads as if the task were dropped.
Celery's line has no place for the exception's message, and no setting
changes it, so the park raises :class:`Parked` (an ``Ignore``) and a
logging filter on Celery's ``celery.app.trace`` logger rewords the line of
a ``Parked`` only: ``Task <name>[<id>] parked (on_busy='defer'): it runs
when its locks are free``. Any other ``Ignore`` is logged as Celery logs
it. The filter reads the record's arguments as Celery 5 builds them; a
record of another shape passes unchanged.
"""

from __future__ import annotations

import logging

from celery.exceptions import Ignore

__all__ = ["PARKED_WORDING", "Parked"]

#: What Celery's ``Task <name>[<id>] ...`` line says of a parked task.
PARKED_WORDING = "parked (on_busy='defer'): it runs when its locks are free"

#: Celery's word for an ``Ignore`` in that line.
_IGNORED = "ignored"
#: The logger of Celery's trace (Celery's, not one this package logs under).
CELERY_TRACE_LOGGER = "celery.app.trace"


class Parked(Ignore):
    """The task was parked (``on_busy="defer"``): it runs later, when its
    locks are handed to it. An ``Ignore`` to Celery (ack, no state)."""

    def __repr__(self) -> str:
        return "Parked()"


class _ParkedWording(logging.Filter):
    """Rewords Celery's ``ignored`` line of a :class:`Parked` task."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            isinstance(args, dict)
            and args.get("description") == _IGNORED
            and str(args.get("exc", "")).startswith("Parked(")
        ):
            record.args = {**args, "description": PARKED_WORDING}
            data = getattr(record, "data", None)
            if isinstance(data, dict):
                record.data = {**data, "description": PARKED_WORDING}
        return True


_FILTER = _ParkedWording()
# Celery's trace logs from the pool process that ran the task: any process
# that can park imported this module first (addFilter adds it once).
logging.getLogger(CELERY_TRACE_LOGGER).addFilter(_FILTER)
