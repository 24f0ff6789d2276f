"""A lock request: its resources, their modes and their keys, validated once.

No I/O. :class:`RequestCache` validates the names of each ``acquire`` call
(:func:`~celery_redislock.protocol.keys.validate_resource`) and keeps the usual
shapes (a str, or a list or tuple of str) so that a repeated request costs
a dictionary lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from ..exceptions import InvalidResource
from .keys import MAX_RESOURCES, Keyspace, validate_resource

__all__ = [
    "MAX_LIMIT",
    "Limits",
    "Request",
    "RequestCache",
    "ResourceNames",
    "limited_resources",
    "mode_spec",
    "resource_names",
]

#: What a request's ``exclusive`` and ``shared`` take: one resource name,
#: an iterable of them, or None (none).
ResourceNames: TypeAlias = str | Iterable[str] | None
#: What a request's ``limited`` takes: resource name -> its limit N (an
#: int from 1 to :data:`MAX_LIMIT`), or None (none).
Limits: TypeAlias = Mapping[str, int] | None

#: Most validated requests a manager keeps.
CACHE_SIZE = 1024
#: The highest limit a limited resource may be given (``limited={name: N}``).
MAX_LIMIT = 10_000
#: The cache key of resource names that are not cached (another iterable).
_UNCACHED: Any = object()


@dataclass(frozen=True)
class Request:
    """A validated request: resources, their modes and their keys."""

    exclusive: tuple[str, ...]
    shared: tuple[str, ...]
    #: One character per resource, in :attr:`resources` order: ``x``, ``s``
    #: or ``l`` (one slot of a limited resource).
    modes: str
    lock_keys: tuple[str, ...]
    queue_keys: tuple[str, ...]
    #: :attr:`spec` and ``lock_keys`` encoded once, as the scripts receive them.
    wire_modes: bytes = b""
    wire_locks: tuple[bytes, ...] = ()
    #: The limited resources, after the shared ones.
    limited: tuple[str, ...] = ()
    #: The limit of each limited resource, same order; 0 where a stored
    #: spec did not name it.
    limits: tuple[int, ...] = ()

    @property
    def resources(self) -> tuple[str, ...]:
        """Every resource, the exclusive ones first, then shared, then limited."""
        return self.exclusive + self.shared + self.limited

    @property
    def spec(self) -> str:
        """The modes as the scripts and park records store them: ``modes``,
        then, with limited resources, ``:`` and their limits (``xl:5``)."""
        return mode_spec(self.modes, self.limits)

    @property
    def limit_map(self) -> dict[str, int]:
        """The limited resources and their limits, as a dict."""
        return dict(zip(self.limited, self.limits))


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


def resource_names(value: ResourceNames, kind: str) -> tuple[str, ...]:
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


def mode_spec(modes: str, limits: Iterable[int]) -> str:
    """``modes`` with the ``limits`` of its ``l`` resources, as the scripts
    take them: ``xl`` and ``(5,)`` give ``xl:5``; no limits, ``modes``."""
    tail = ",".join(str(n) for n in limits)
    return modes + ":" + tail if tail else modes


def limited_resources(value: Limits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``value`` (a mapping of resource name to its limit, or None) as
    validated names and limits; raises :class:`InvalidResource`."""
    if value is None:
        return (), ()
    if not isinstance(value, Mapping):
        raise InvalidResource(
            "limited must be a mapping of resource name to its limit "
            f"(an int from 1 to {MAX_LIMIT}), not {type(value).__name__} {value!r}",
            value,
        )
    names: list[str] = []
    limits: list[int] = []
    for name, limit in value.items():
        name = validate_resource(name)
        if type(limit) is not int or not 1 <= limit <= MAX_LIMIT:
            raise InvalidResource(
                f"the limit of limited resource {name!r} must be an int from 1 to "
                f"{MAX_LIMIT}, not {limit!r}",
                name,
            )
        names.append(name)
        limits.append(limit)
    return tuple(names), tuple(limits)


def _limited_key(value: Any) -> Any:
    """The request cache's key for ``limited`` (None, or a dict of str to
    int: a tuple of its items), or :data:`_UNCACHED`."""
    if value is None:
        return None
    if type(value) is not dict:
        return _UNCACHED
    for name, limit in value.items():
        if type(name) is not str or type(limit) is not int:
            return _UNCACHED
    return tuple(value.items())


class RequestCache:
    """Validated requests of one namespace, by their names (bounded)."""

    def __init__(self, keys: Keyspace) -> None:
        self._keys = keys
        self._requests: dict[tuple[Any, Any, Any], Request] = {}

    def get(
        self, exclusive: ResourceNames, shared: ResourceNames, limited: Limits = None
    ) -> Request:
        """The request for these names; raises :class:`InvalidResource`."""
        # The usual request names its resources as str, None, or a list or
        # tuple of str (and its limited ones as a dict of str to int):
        # validated once and kept (a bounded cache, keyed by tuple copies;
        # a Request is immutable).
        key = (_cache_key(exclusive), _cache_key(shared), _limited_key(limited))
        if _UNCACHED in key:
            return self.validate(exclusive, shared, limited)
        cached = self._requests.get(key)
        if cached is not None:
            return cached
        req = self.validate(exclusive, shared, limited)
        if len(self._requests) >= CACHE_SIZE:
            self._requests.clear()
        self._requests[key] = req
        return req

    def validate(
        self, exclusive: ResourceNames, shared: ResourceNames, limited: Limits = None
    ) -> Request:
        """A new validated request (not cached)."""
        ex = resource_names(exclusive, "exclusive")
        sh = resource_names(shared, "shared")
        lim, limits = limited_resources(limited)
        if not ex and not sh and not lim:
            raise InvalidResource("a lock request needs at least one resource")
        for (a, a_names), (b, b_names) in (
            (("exclusive", ex), ("shared", sh)),
            (("exclusive", ex), ("limited", lim)),
            (("shared", sh), ("limited", lim)),
        ):
            both = set(a_names) & set(b_names)
            if both:
                raise InvalidResource(
                    f"resources requested both {a} and {b}: {sorted(both)}", sorted(both)
                )
        return self._build(ex, sh, lim, limits)

    def from_spec(self, names: Iterable[str], spec: str) -> Request:
        """The request of resource ``names`` whose modes a script or a park
        record stored as ``spec`` (:attr:`Request.spec`; a limit it does
        not name is 0). The names were validated when the request was first
        made."""
        modes, _, tail = spec.partition(":")
        numbers = iter(int(n) for n in tail.split(",") if n)
        ex: list[str] = []
        sh: list[str] = []
        lim: list[str] = []
        limits: list[int] = []
        for name, mode in zip(names, modes):
            if mode == "x":
                ex.append(name)
            elif mode == "l":
                lim.append(name)
                limits.append(next(numbers, 0))
            else:
                sh.append(name)
        return self._build(tuple(ex), tuple(sh), tuple(lim), tuple(limits))

    def _build(
        self,
        ex: tuple[str, ...],
        sh: tuple[str, ...],
        lim: tuple[str, ...],
        limits: tuple[int, ...],
    ) -> Request:
        if len(ex) + len(sh) + len(lim) > MAX_RESOURCES:
            raise InvalidResource(f"a request may name at most {MAX_RESOURCES} resources")
        names = ex + sh + lim
        modes = "x" * len(ex) + "s" * len(sh) + "l" * len(lim)
        lock_keys = tuple(self._keys.lock(r) for r in names)
        return Request(
            exclusive=ex,
            shared=sh,
            modes=modes,
            lock_keys=lock_keys,
            queue_keys=tuple(self._keys.queue(r) for r in names),
            wire_modes=mode_spec(modes, limits).encode(),
            wire_locks=tuple(k.encode() for k in lock_keys),
            limited=lim,
            limits=limits,
        )
