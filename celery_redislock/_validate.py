"""Type and range checks of public arguments and settings (private helpers).

Each helper returns the normalised value or raises
:class:`~celery_redislock.exceptions.ConfigurationError` (also a
``ValueError``) naming the argument or setting and what it accepts. ``bool``
is never taken for a number (``True`` is not one second), and a number too
large for a float (``10**400``) is refused with a message, not an
``OverflowError``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .exceptions import ConfigurationError

log = logging.getLogger("celery_redislock.heartbeat")

#: Lowest accepted heartbeat interval (seconds): below it one idle owner
#: alone would send thousands of commands a second.
MIN_HEARTBEAT_INTERVAL = 0.05
#: Heartbeat intervals below this (seconds) are accepted with a logged warning.
WARN_HEARTBEAT_INTERVAL = 0.5
#: Owner TTL bounds (seconds); the floor leaves room for two heartbeats.
MIN_OWNER_TTL = 2 * MIN_HEARTBEAT_INTERVAL
MAX_OWNER_TTL = 86400.0
#: ``queue_scan_limit`` bounds: entries one script inspects per wait queue.
MAX_SCAN_LIMIT = 100_000
#: Longest ``name`` label of a manager (characters).
MAX_LABEL = 200


def _refuse(name: str, message: str) -> ConfigurationError:
    return ConfigurationError(name, message)


def seconds(
    name: str,
    value: Any,
    *,
    allow_none: bool = False,
    allow_inf: bool = False,
    minimum: float = 0.0,
    maximum: float | None = None,
) -> float | None:
    """A duration in seconds: an ``int`` or ``float`` (never ``bool``), not NaN.

    ``None`` passes when ``allow_none``; infinity when ``allow_inf`` (the
    caller decides what it means). Raises ConfigurationError otherwise or when
    out of ``minimum..maximum``.
    """
    what = "a number of seconds" + (" or None" if allow_none else "")
    if value is None:
        if allow_none:
            return None
        raise _refuse(name, f"must be {what}, not None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(name, f"must be {what}, not {value!r}")
    try:
        number = float(value)
    except OverflowError:
        limit = f"at most {maximum:g} seconds" if maximum is not None else "too large for a float"
        raise _refuse(name, f"is a {int(value).bit_length()}-bit number ({limit})") from None
    if math.isnan(number):
        raise _refuse(name, f"must be {what}, not NaN")
    if math.isinf(number) and number > 0 and allow_inf:
        return number
    if number < minimum or (maximum is not None and number > maximum) or math.isinf(number):
        upper = f"..{maximum:g}" if maximum is not None else " or more"
        raise _refuse(name, f"must be within {minimum:g}{upper} seconds, not {number:g}")
    return number


def duration(name: str, value: Any, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    """:func:`seconds` for a required, finite value."""
    out = seconds(name, value, minimum=minimum, maximum=maximum)
    assert out is not None
    return out


def integer(name: str, value: Any, *, minimum: int, maximum: int) -> int:
    """An ``int`` (never ``bool``) within ``minimum..maximum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, f"must be an int, not {value!r}")
    if not minimum <= value <= maximum:
        raise _refuse(name, f"must be within {minimum}..{maximum}, not {value}")
    return value


def flag(name: str, value: Any) -> bool:
    """A ``bool`` (``True``/``False``, nothing else)."""
    if not isinstance(value, bool):
        raise _refuse(name, f"must be True or False, not {value!r}")
    return value


def optional_flag(name: str, value: Any) -> bool | None:
    """``None``, ``True`` or ``False``."""
    if value is None:
        return None
    return flag(name, value)


def label(name: str, value: Any) -> str | None:
    """``None`` or a printable ``str`` (spaces allowed) of at most :data:`MAX_LABEL` characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _refuse(name, f"must be a str or None, not {value!r}")
    if not value or len(value) > MAX_LABEL or not value.isprintable():
        raise _refuse(
            name, f"must be 1..{MAX_LABEL} printable characters (no newline), not {value!r}"
        )
    return value


#: (setting, interval) pairs already warned about in this process.
_warned_fast: set[tuple[str, float]] = set()


def warn_fast_heartbeat(name: str, interval: float) -> None:
    """Warn (once per process and value) when ``interval`` is below :data:`WARN_HEARTBEAT_INTERVAL`.

    Every manager validates its settings; a process making many managers
    with one fast interval gets one line, not one per manager.
    """
    if interval < WARN_HEARTBEAT_INTERVAL and (name, interval) not in _warned_fast:
        _warned_fast.add((name, interval))
        log.warning(
            "heartbeat.fast-interval %s=%gs: every idle owner sends about %d commands "
            "a second to Redis; %gs or more is enough for any owner TTL of a few seconds",
            name,
            interval,
            round(1 / interval),
            WARN_HEARTBEAT_INTERVAL,
        )
