"""A lock request: its resources, their modes and their keys, validated once.

No I/O. :class:`RequestCache` validates the names of each ``acquire`` call
(:func:`~celery_redislock.protocol.keys.validate_resource`) and keeps the usual
shapes (a str, or a list or tuple of str) so that a repeated request costs
a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..exceptions import InvalidResource
from .keys import MAX_RESOURCES, Keyspace, validate_resource

__all__ = ["Request", "RequestCache", "resource_names"]

#: Most validated requests a manager keeps.
CACHE_SIZE = 1024
#: The cache key of resource names that are not cached (another iterable).
_UNCACHED: Any = object()


@dataclass(frozen=True)
class Request:
    """A validated request: resources, their modes and their keys."""

    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    modes: str
    lock_keys: tuple[str, ...]
    queue_keys: tuple[str, ...]
    #: ``modes`` and ``lock_keys`` encoded once, as the scripts receive them.
    wire_modes: bytes = b""
    wire_locks: tuple[bytes, ...] = ()

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource, exclusive first."""
        return self.exclusive + self.shared


def _cache_key(names: Any) -> Any:
    """The request cache's key for ``names`` (None, a str, or a list or tuple
    of str: a tuple of them), or :data:`_UNCACHED`."""
    if names is None or type(names) is str:
        return names
    kind = type(names)
    if kind is list or kind is tuple:
        for name in names:
            if type(name) is not str:
                return _UNCACHED
        return tuple(names)
    return _UNCACHED


def resource_names(value: str | Iterable[str] | None, kind: str) -> tuple[str, ...]:
    """``value`` (a name, an iterable of names or None) as validated names,
    without repeats; ``kind`` (``"exclusive"``, ``"shared"``) names it in errors."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (validate_resource(value),)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidResource(f"{kind} resources must be str names, not bytes", value)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise InvalidResource(
            f"{kind} must be a resource name (str), an iterable of names or None, "
            f"not {type(value).__name__} {value!r}",
            value,
        )
    out: list[str] = []
    for name in value:
        name = validate_resource(name)
        if name not in out:
            out.append(name)
    return tuple(out)


class RequestCache:
    """Validated requests of one namespace, by their names (bounded)."""

    def __init__(self, keys: Keyspace) -> None:
        self._keys = keys
        self._requests: dict[tuple[Any, Any], Request] = {}

    def get(
        self, exclusive: str | Iterable[str] | None, shared: str | Iterable[str] | None
    ) -> Request:
        """The request for these names; raises :class:`InvalidResource`."""
        # The usual request names its resources as str, None, or a list or
        # tuple of str: validated once and kept (a bounded cache, keyed by
        # a tuple copy of a list; a Request is immutable).
        key = (_cache_key(exclusive), _cache_key(shared))
        if key[0] is _UNCACHED or key[1] is _UNCACHED:
            return self.validate(exclusive, shared)
        cached = self._requests.get(key)
        if cached is not None:
            return cached
        req = self.validate(exclusive, shared)
        if len(self._requests) >= CACHE_SIZE:
            self._requests.clear()
        self._requests[key] = req
        return req

    def validate(
        self, exclusive: str | Iterable[str] | None, shared: str | Iterable[str] | None
    ) -> Request:
        """A new validated request (not cached)."""
        ex = resource_names(exclusive, "exclusive")
        sh = resource_names(shared, "shared")
        if not ex and not sh:
            raise InvalidResource("a lock request needs at least one resource")
        both = set(ex) & set(sh)
        if both:
            raise InvalidResource(
                f"resources requested both exclusive and shared: {sorted(both)}", sorted(both)
            )
        if len(ex) + len(sh) > MAX_RESOURCES:
            raise InvalidResource(f"a request may name at most {MAX_RESOURCES} resources")
        names = ex + sh
        modes = "x" * len(ex) + "s" * len(sh)
        lock_keys = tuple(self._keys.lock(r) for r in names)
        return Request(
            exclusive=ex,
            shared=sh,
            modes=modes,
            lock_keys=lock_keys,
            queue_keys=tuple(self._keys.queue(r) for r in names),
            wire_modes=modes.encode(),
            wire_locks=tuple(k.encode() for k in lock_keys),
        )
