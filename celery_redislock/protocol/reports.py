"""Reports returned by cleanup and reconcile (what was freed, kept, failed)
and by :meth:`LockManager.holders` (who holds a resource)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .keys import MODE_NAMES, grant_limit, owner_of_token, parse_grant, text


@dataclass(frozen=True)
class LockHolder:
    """One grant on a resource, as :meth:`LockManager.holders` reads it.

    Attributes:
        resource: the resource name.
        owner_id: the process holding the grant (``<pid>-<random>``), or a
            task owner (``task:<task id>``; ``defer:<task id>`` for a parked
            deferred task) for a task message that is not running anywhere yet.
        mode: ``"exclusive"``, ``"shared"`` or ``"limited"`` (one slot).
        fencing_token: the grant's fencing token (None for a grant written
            without one).
        token: the grant's holder token, ``<owner>|<request id>``.
        limit: for a slot of a limited resource, the limit its request
            asked for; None for the other modes.
    """

    resource: str
    owner_id: str
    mode: str
    fencing_token: int | None
    token: str
    limit: int | None = None

    @classmethod
    def from_grant(cls, resource: str, token: str, value: str) -> LockHolder:
        """The holder of lock hash field ``token`` with value ``value``."""
        mode, fence = parse_grant(value)
        return cls(
            resource,
            owner_of_token(token),
            MODE_NAMES.get(mode, mode),
            fence,
            token,
            grant_limit(value),
        )


def lock_holders(resource: str, raw: Any) -> list[LockHolder]:
    """The holders of ``resource`` from its lock hash (``HGETALL``): exclusive
    first, then by owner. ``raw``: a dict, or RESP2's flat list."""
    if not isinstance(raw, dict):
        items = list(raw or ())
        raw = dict(zip(items[0::2], items[1::2]))
    out = [LockHolder.from_grant(resource, text(t), text(v)) for t, v in raw.items()]
    return sorted(out, key=lambda h: (h.mode != "exclusive", h.owner_id))


@dataclass(frozen=True)
class CleanupReport:
    """Outcome of freeing one owner's locks.

    ``status`` is ``"alive"`` (the owner is live: nothing done), ``"cleaned"``
    (every lock freed; the owner left the active-owners set) or ``"partial"``
    (some registry keys kept: see ``skipped`` and ``errors``; retried on the
    next pass).
    """

    owner_id: str
    status: str
    released: int = 0
    #: (key, type) of registry members of an unexpected type, kept.
    skipped: tuple[tuple[str, str], ...] = ()
    #: (key, message) of registry members whose cleanup failed, kept.
    errors: tuple[tuple[str, str], ...] = ()
    #: Registry size afterwards.
    remaining: int = 0
    #: Grants of *other* dead owners freed on the way (serving this owner's
    #: waiters reclaims dead holders that stand before an exclusive waiter).
    reclaimed: int = 0

    @classmethod
    def from_reply(cls, owner_id: str, reply: Any) -> CleanupReport:
        """The report of cleanup_owner.lua's reply (see its header)."""
        status, released, skipped, errors, remaining, reclaimed = reply
        skipped_l = [text(x) for x in skipped]
        errors_l = [text(x) for x in errors]
        return cls(
            owner_id=owner_id,
            status=text(status),
            released=int(released),
            skipped=tuple(zip(skipped_l[::2], skipped_l[1::2])),
            errors=tuple(zip(errors_l[::2], errors_l[1::2])),
            remaining=int(remaining),
            reclaimed=int(reclaimed),
        )


@dataclass
class ReconcileReport:
    """Outcome of one reconcile pass over the active-owners set."""

    owners_seen: int = 0
    alive: int = 0
    cleaned: int = 0
    partial: int = 0
    #: Grants freed, every cleaned owner's own and those of other dead
    #: owners reclaimed while serving their waiters (``CleanupReport.reclaimed``).
    released: int = 0
    #: owner id -> error message, for owners whose cleanup raised.
    errors: dict[str, str] = field(default_factory=dict)
    reports: list[CleanupReport] = field(default_factory=list)

    def add(self, report: CleanupReport) -> None:
        self.reports.append(report)
        self.released += report.released + report.reclaimed
        if report.status == "cleaned":
            self.cleaned += 1
        elif report.status == "partial":
            self.partial += 1
        elif report.status == "alive":
            self.alive += 1

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly summary (the reconcile task's result)."""
        return {
            "owners_seen": self.owners_seen,
            "alive": self.alive,
            "cleaned": self.cleaned,
            "partial": self.partial,
            "released": self.released,
            "errors": dict(self.errors),
            "skipped": [[r.owner_id, key, kind] for r in self.reports for key, kind in r.skipped],
            "key_errors": [[r.owner_id, key, msg] for r in self.reports for key, msg in r.errors],
        }
