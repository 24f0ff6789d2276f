"""Exceptions raised by celery-redislock.

Every error the library raises on purpose derives from :class:`LockError`::

    LockError
     ├── LockTimeout        the locks were not granted within the timeout
     │    └── ReplicationTimeout  granted, but fewer replicas than
     │                       ``wait_replicas`` acknowledged the grant in
     │                       time; the grant was released
     ├── LockLost           a lease's owner lost its liveness; the locks may
     │                      now belong to someone else (``cause`` says why)
     ├── LockUpgradeError   an exclusive request for a resource this thread,
     │                      greenlet or task holds only shared (also a
     │                      ValueError: waiting would deadlock on itself)
     ├── InvalidResource    a resource name or request shape was refused
     │                      (also a ValueError)
     ├── ConfigurationError a setting or argument was refused (also a ValueError)
     ├── RedisUnavailable   Redis could not be reached (names the URL)
 ├── FormatMismatch     the namespace holds lock data of another format
 │                      version (a process of another release uses it)
     ├── ShuttingDown       the worker began a warm shutdown while the request
     │                      waited; it left the queue (``@locked`` hands the
     │                      task back to the broker)
     ├── DuplicateTask      a UniqueTask was sent while another task with the
     │                      same unique key is queued or running
     │                      (``unique_on_duplicate="raise"``)
     └── PermissionDenied   Redis refused a command or key to the lock user
                            (an ACL ``NOPERM``; names the command and the fix)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from redis.exceptions import NoPermissionError, ResponseError

from .redact import redact_url

#: How Redis words a refusal by the ACL: a ``NOPERM`` reply (6.0+), or the
#: error of a script whose ``redis.call`` was refused (6.x/7.0: an ``ERR``).
_DENIED_RE = re.compile(r"NOPERM|no permissions to|user executing the script can't", re.IGNORECASE)
_REFUSED_COMMAND_RE = re.compile(r"'([A-Za-z|_-]+)' command")

#: Where the required ACL is documented (named in every PermissionDenied).
ACL_DOC = "docs/operations.md, 'Least-privilege ACL'"


class LockError(Exception):
    """Root of every error raised by celery-redislock.

    Subclasses keep their constructor arguments as ``args`` and build the
    message in ``__str__``, so an error raised in a task survives pickling
    and Celery's result backend (which rebuilds it as ``cls(*args)``).
    """


class LockTimeout(LockError):
    """The requested locks were not all granted before the timeout.

    Nothing is left behind: no partial grant, no queue entry.
    """

    def __init__(self, resources: Sequence[str], timeout: float | None) -> None:
        self.resources = tuple(resources)
        self.timeout = timeout
        super().__init__(list(self.resources), timeout)

    def __str__(self) -> str:
        return f"locks not granted within {self.timeout}s: {', '.join(self.resources)}"


class ReplicationTimeout(LockTimeout):
    """The locks were granted on the master, but too few replicas confirmed it.

    Raised by a :class:`~celery_redislock.LockManager` made with
    ``wait_replicas=N`` when ``WAIT N`` reported fewer than ``N`` replicas
    within ``wait_timeout``. The grant was released before this was raised
    (nothing is left held), so a failover could not have handed the same
    resources to a second holder while the caller proceeded. A
    :class:`LockTimeout`: code that treats "not granted" alike needs no change.
    """

    def __init__(
        self,
        resources: Sequence[str],
        timeout: float | None,
        wanted: int,
        acknowledged: int,
        wait_timeout: float,
    ) -> None:
        self.resources = tuple(resources)
        self.timeout = timeout
        self.wanted = wanted
        self.acknowledged = acknowledged
        self.wait_timeout = wait_timeout
        LockError.__init__(self, list(self.resources), timeout, wanted, acknowledged, wait_timeout)

    def __str__(self) -> str:
        return (
            f"locks granted but only {self.acknowledged} of {self.wanted} replicas "
            f"acknowledged within {self.wait_timeout}s (the grant was released): "
            f"{', '.join(self.resources)}; check the replicas (INFO replication)"
        )


class LockLost(LockError):
    """The lease's owner lost its liveness, so its locks may have passed on.

    Stop writing to what the lock protects; use the fencing token to let the
    store refuse late writes. ``cause`` says why, when it is known: one of
    ``celery_redislock.exceptions.LOST_CAUSES`` (released by an operator,
    owner declared dead, liveness expired, Redis lost the lock), or None.
    """

    def __init__(
        self,
        resources: Sequence[str],
        owner_id: str,
        fencing_token: int,
        cause: str | None = None,
    ) -> None:
        self.resources = tuple(resources)
        self.owner_id = owner_id
        self.fencing_token = fencing_token
        self.cause = cause
        super().__init__(list(self.resources), owner_id, fencing_token, cause)

    def __str__(self) -> str:
        why = self.cause or "its owner lost its liveness"
        return (
            f"lease lost ({why}; owner {self.owner_id}): "
            f"{', '.join(self.resources)}; fencing token {self.fencing_token} is stale"
        )


#: Why a lease was lost (``LockLost.cause``, ``Lease.lost_cause``, log lines).
CAUSE_OPERATOR = "released by operator via CLI"
CAUSE_DECLARED_DEAD = "owner declared dead"
CAUSE_EXPIRED = "liveness expired"
CAUSE_REDIS_LOST = "Redis lost the lock"
LOST_CAUSES = (CAUSE_OPERATOR, CAUSE_DECLARED_DEAD, CAUSE_EXPIRED, CAUSE_REDIS_LOST)


class LockUpgradeError(LockError, ValueError):
    """An exclusive request for a resource the same execution holds only shared.

    Raised at once, before any I/O, by a nested acquire in the thread,
    greenlet or task that holds ``resources`` in shared mode: waiting for the
    exclusive lock would wait for itself (a deadlock until the timeout).
    Release the shared lease first, or take the resource exclusively from
    the start.
    """

    def __init__(self, resources: Sequence[str]) -> None:
        self.resources = tuple(resources)
        super().__init__(list(self.resources))

    def __str__(self) -> str:
        return (
            f"cannot upgrade to exclusive: this thread/greenlet/task holds "
            f"{', '.join(self.resources)} shared (waiting would deadlock on itself); "
            "release the shared lease first or lock exclusively from the start"
        )


class InvalidResource(LockError, ValueError):
    """A resource name or the shape of a request was refused before any I/O."""

    def __init__(self, message: str, resource: object = None) -> None:
        self.message = message
        self.resource = resource
        super().__init__(message, resource)

    def __str__(self) -> str:
        return self.message


class ConfigurationError(LockError, ValueError):
    """A setting or constructor argument has a value the library refuses."""

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        self.message = message
        super().__init__(setting, message)

    def __str__(self) -> str:
        return f"{self.setting}: {self.message}"


class RedisUnavailable(LockError):
    """Redis could not be reached or answered with a connection error."""

    def __init__(self, url: str, cause: BaseException | str) -> None:
        # Never carry a password into messages and logs.
        self.url = redact_url(url)
        self.cause = cause
        # The cause travels as text: an exception object does not survive JSON.
        super().__init__(self.url, str(cause))

    def __str__(self) -> str:
        return f"Redis at {self.url} is unavailable: {self.cause}"


#: Where the upgrade procedure is documented (named in every FormatMismatch).
UPGRADE_DOC = "docs/operations.md, 'Upgrading across a data-format change'"


class FormatMismatch(LockError):
    """The namespace holds lock data of another format version than this release.

    Processes of two releases whose lock data differ in shape must never
    share a namespace: each would misread the other's locks. Nothing was
    written. Attributes: ``namespace``, ``url`` (password masked),
    ``found`` (the namespace's format, an int) and ``expected`` (this
    release's), ``unversioned`` (True when ``found`` was inferred from data
    written before format versioning, not read from ``{ns}:format``).
    """

    def __init__(
        self, namespace: str, url: str, found: int, expected: int, unversioned: bool = False
    ) -> None:
        self.namespace = namespace
        self.url = redact_url(url)
        self.found = found
        self.expected = expected
        self.unversioned = unversioned
        super().__init__(namespace, self.url, found, expected, unversioned)

    def __str__(self) -> str:
        what = (
            f"lock data written before format versioning (format {self.found})"
            if self.unversioned
            else f"lock data of format {self.found}"
        )
        if self.found > self.expected:
            fix = (
                "a newer celery-redislock uses it: upgrade this process to that release, "
                "or give it another redislock_namespace"
            )
        else:
            fix = (
                "processes of an older celery-redislock may still use it: drain them "
                "(stop every worker of the old release, run its `redislock reconcile`), "
                "then run `celery -A proj redislock format --switch`; or give this "
                "release a new redislock_namespace"
            )
        return (
            f"namespace {self.namespace!r} at {self.url} holds {what}, but this "
            f"celery-redislock uses format {self.expected}; processes of two formats must "
            f"never share a namespace. Fix: {fix} (see {UPGRADE_DOC})."
        )


class ShuttingDown(LockError):
    """The worker began shutting down while this request waited for its locks.

    Nothing is left behind: the request left the wait queue. ``@locked``
    turns it into a requeue (``Reject(requeue=True)`` with ``acks_late``,
    otherwise ``task.retry()``), so another worker runs the task.
    """

    def __init__(self, resources: Sequence[str]) -> None:
        self.resources = tuple(resources)
        super().__init__(list(self.resources))

    def __str__(self) -> str:
        return (
            "the worker is shutting down: stopped waiting for "
            f"{', '.join(self.resources)} (the request left the queue)"
        )


class DuplicateTask(LockError):
    """A unique task was not sent: another one with its key is queued or running.

    Raised by ``UniqueTask.apply_async`` (``delay``, signatures, canvas) when
    ``unique_on_duplicate="raise"``, or whatever the mode when the key is
    held by something that is not a task (a plain lock on ``unique:<key>``).
    Attributes: ``key`` (the unique key, without the ``unique:`` prefix),
    ``task_id`` (the task that holds it, or None when not a task), ``task``
    (the name of the task that was not sent) and ``countdown``: the seconds
    until the key frees at the latest, when that is known, else None.

    ``countdown`` is known while the holder is a message no worker has
    started (its key runs out after its ``unique_ttl``, plus any countdown or
    eta); it is None once a worker runs the holder (the key is freed when
    that task ends, not after a fixed time) or when the holder is not a
    task. So ``self.retry(countdown=exc.countdown or 60)`` retries no later
    than the key's expiry (the key may free sooner, when the task runs).
    """

    def __init__(
        self,
        key: str,
        task_id: str | None,
        task: str = "the task",
        countdown: float | None = None,
    ) -> None:
        self.key = key
        self.task_id = task_id
        self.task = task
        self.countdown = countdown
        super().__init__(key, task_id, task, countdown)

    def __str__(self) -> str:
        held = f"task {self.task_id}" if self.task_id else "a lock that is not a task's"
        if self.countdown is not None:
            when = f"; it frees in {self.countdown:.3g}s at the latest (countdown)"
        elif self.task_id:
            when = "; it frees when that task ends (countdown unknown)"
        else:
            when = ""
        return (
            f"{self.task} not sent: unique key {self.key!r} is held by {held} "
            f"(queued or running){when}"
        )


class PermissionDenied(LockError):
    """Redis refused a command or a key to the lock user (an ACL ``NOPERM``).

    Attributes: ``url`` (password masked), ``command`` (what was sent, e.g.
    ``EVALSHA acquire`` or ``PTTL``), ``refused`` (the command Redis named
    as refused, upper case, or None when it refused a key or did not say)
    and ``detail`` (Redis's own words). Retrying does not help: the user's
    ACL must grant what the library uses (see ``docs/operations.md``).
    """

    def __init__(self, url: str, command: str, detail: str) -> None:
        self.url = redact_url(url)
        self.command = command
        self.detail = str(detail)
        found = _REFUSED_COMMAND_RE.search(self.detail)
        self.refused = found.group(1).upper() if found else None
        super().__init__(self.url, command, self.detail)

    def __str__(self) -> str:
        what = self.command
        if self.refused and self.refused.split("|")[0] != self.command.split()[0].upper():
            what = f"{self.refused} (sent with {self.command})"
        elif self.refused is None and "key" in self.detail:
            what = f"a key used by {self.command}"
        return (
            f"permission denied: Redis at {self.url} refused {what}: "
            f"{self.detail.rstrip('. ')}. "
            f"Grant the lock user the commands and the key pattern ~{{namespace}}:* "
            f"listed in {ACL_DOC}."
        )


def is_permission_error(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a command or key by its ACL."""
    if isinstance(exc, NoPermissionError):
        return True
    return isinstance(exc, ResponseError) and bool(_DENIED_RE.search(str(exc)))


def permission_denied(exc: BaseException, url: str, command: str) -> PermissionDenied | None:
    """``exc`` as a :class:`PermissionDenied` if it is an ACL refusal, else None."""
    if not is_permission_error(exc):
        return None
    return PermissionDenied(url, command, str(exc))
