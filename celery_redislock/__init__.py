"""Crash-safe, fork-safe, fair Redis resource locks for Celery tasks.

The engine (:class:`LockManager`, :class:`Lease`) works without Celery;
importing this package does not import Celery. :class:`Inspector` reads
who holds and who waits for what (what the CLI shows). The Celery face is
:class:`RedisLock` (the extension), :func:`locked` (the task decorator),
:func:`current_lease` (the lease of the running ``@locked`` body) and
:class:`UniqueTask` (a Task base: one queued-or-running task per key) with
:func:`normalise_key_value` (a key encoder for it); both are imported on
first access, so that importing the package alone does not import Celery.
"""

from .engine.lease import Lease
from .engine.manager import Adoption, LockManager, TaskGrant
from .exceptions import (
    ConfigurationError,
    DuplicateTask,
    FormatMismatch,
    InvalidResource,
    LockError,
    LockLost,
    LockTimeout,
    LockUpgradeError,
    PermissionDenied,
    RedisUnavailable,
    ReplicationTimeout,
    ShuttingDown,
)
from .integration.app import RedisLock
from .integration.body import current_lease
from .integration.locked import locked
from .integration.templates import TemplateError
from .ops.inspector import Inspector
from .protocol.keys import FORMAT_VERSION
from .protocol.reports import CleanupReport, LockHolder, ReconcileReport
from .store.checks import EvictionCheck, check_eviction

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "UniqueTask":
        from .integration.unique import UniqueTask

        return UniqueTask
    if name == "normalise_key_value":
        from .integration.unique import normalise_key_value

        return normalise_key_value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "Adoption",
    "CleanupReport",
    "ConfigurationError",
    "DuplicateTask",
    "EvictionCheck",
    "FormatMismatch",
    "Inspector",
    "InvalidResource",
    "Lease",
    "LockError",
    "LockHolder",
    "LockLost",
    "LockManager",
    "LockTimeout",
    "LockUpgradeError",
    "PermissionDenied",
    "ReconcileReport",
    "RedisLock",
    "RedisUnavailable",
    "ReplicationTimeout",
    "ShuttingDown",
    "TaskGrant",
    "TemplateError",
    "UniqueTask",
    "check_eviction",
    "current_lease",
    "locked",
    "normalise_key_value",
]
