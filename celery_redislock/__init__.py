"""Crash-safe, fork-safe, fair Redis resource locks for Celery tasks.

The engine (:class:`LockManager`, :class:`Lease`) works without Celery.
"""

from .checks import EvictionCheck, check_eviction
from .exceptions import (
    ConfigurationError,
    InvalidResource,
    LockError,
    LockLost,
    LockTimeout,
    RedisUnavailable,
)
from .lease import Lease
from .manager import LockManager
from .reports import CleanupReport, ReconcileReport

__version__ = "0.1.0"

__all__ = [
    "CleanupReport",
    "ConfigurationError",
    "EvictionCheck",
    "InvalidResource",
    "Lease",
    "LockError",
    "LockLost",
    "LockManager",
    "LockTimeout",
    "ReconcileReport",
    "RedisUnavailable",
    "check_eviction",
]
