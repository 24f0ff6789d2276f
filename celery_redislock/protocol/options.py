"""The lock engine's options: validated once, frozen, with their script encodings.

Every :class:`~celery_redislock.LockManager` argument that shapes the
protocol (time-to-lives, limits, replica waits) is checked here and kept in
one :class:`EngineOptions`; the Celery settings (``redislock_*``) take their
bounds from the constants below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _validate as _v
from ..exceptions import ConfigurationError

#: Default liveness TTL of an owner, seconds. A crashed owner's locks block
#: others at most this long when nothing else cleans them up (in a Celery
#: worker, the main process frees a dead child's locks within one tick).
DEFAULT_OWNER_TTL = 30.0
#: Default queue scan limit: live entries one script looks at per wait queue
#: (dead entries it removes have a budget of their own, 4 x this limit).
DEFAULT_SCAN_LIMIT = 256
#: Values of ``LockManager(wait_policy=...)``: what an acquire does when
#: fewer than ``wait_replicas`` replicas acknowledge its grant in time.
WAIT_POLICIES = ("fail", "retry")
#: Default ``wait_timeout`` (seconds) and the bounds of ``wait_replicas`` /
#: ``wait_timeout`` (the timeout is also kept below the socket timeout).
DEFAULT_WAIT_TIMEOUT = 1.0
MAX_WAIT_REPLICAS = 100
MIN_WAIT_TIMEOUT = 0.001
MAX_WAIT_TIMEOUT = 60.0
#: Values of ``LockManager(eviction_check=...)``.
EVICTION_CHECK_MODES = ("warn", "raise", "ignore")
#: Safety margin of the local liveness deadline (docs/design.md, "Loss
#: model"): a lease counts as lost this long before its owner's liveness key
#: can expire in Redis, to absorb clock drift between this host's monotonic
#: clock and the Redis server's expiry clock (NTP slewing, a stepped clock):
#: a tenth of owner_ttl, at most LIVENESS_MARGIN_MAX seconds.
LIVENESS_MARGIN_FRACTION = 0.1
LIVENESS_MARGIN_MAX = 2.0
#: Leases an owner holds before its further resource names go to its
#: registry's buckets (``_common.lua`` ``registry_add``): every registry hash
#: then stays a compact listpack/ziplist (at most 128 fields by default),
#: however many locks one process holds. Costs one more command per acquire
#: and release of such an owner.
REGISTRY_SPILL_AT = 64
#: The shortest wait a waiter sends (seconds). BLPOP's timeout 0 waits for
#: ever, and Redis 6.2 truncates 0.001 s to 0 ms, so a wait that computes to
#: a millisecond or less (a deadline about to pass) would block until a
#: push: every server ends a 10 ms wait.
MIN_BLOCK = 0.01


def block_cap(socket_timeout: float | None) -> float:
    """Longest single blocking read (BLPOP, XREAD) for a socket timeout.

    Below the client's socket timeout (a client made from a URL has
    redis-py's 5 s default, absent from its kwargs). Redis ends a blocking
    command up to 1/hz (100 ms) late: half of a short timeout is kept as
    margin (a 0.4 s socket timeout blocks 0.2 s). No timeout: 30 s.
    """
    if not socket_timeout:
        return 30.0
    return max(0.05, socket_timeout - min(1.0, socket_timeout / 2))


@dataclass(frozen=True)
class EngineOptions:
    """A manager's validated options and what the scripts receive of them.

    Build it with :meth:`build`, which raises :class:`ConfigurationError`
    (a ValueError) for any bad value before a manager does any I/O.
    """

    owner_ttl: float
    heartbeat_interval: float
    queue_scan_limit: int
    name: str | None
    heartbeat: bool
    hold_connection: bool
    group: Callable[[], str | None] | None
    wait_replicas: int
    wait_timeout: float
    wait_policy: str
    eviction_check: str
    #: Longest single blocking read (see :func:`block_cap`).
    block_cap: float
    #: Seconds the local liveness deadline keeps from owner_ttl.
    liveness_margin: float = field(init=False)
    #: owner_ttl in ms, as acquire.lua and heartbeat.lua receive it.
    ttl_arg: bytes = field(init=False)
    #: 3 x owner_ttl in ms: the TTL of request state (wake lists, streams).
    req_ttl_ms: int = field(init=False)
    req_ttl_arg: bytes = field(init=False)
    limit_arg: bytes = field(init=False)
    #: wait_timeout in ms, as WAIT receives it.
    wait_ms: int = field(init=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(
            self,
            "liveness_margin",
            min(LIVENESS_MARGIN_MAX, self.owner_ttl * LIVENESS_MARGIN_FRACTION),
        )
        put(self, "ttl_arg", str(int(self.owner_ttl * 1000)).encode())
        put(self, "req_ttl_ms", int(self.owner_ttl * 3000))
        put(self, "req_ttl_arg", str(self.req_ttl_ms).encode())
        put(self, "limit_arg", str(self.queue_scan_limit).encode())
        put(self, "wait_ms", max(1, round(self.wait_timeout * 1000)))

    def wait_bound(self, remaining: float, wait_ms: int, liveness_left: float) -> float:
        """Seconds a queued request blocks on its wake list before it runs its
        acquire script again (docs/design.md, "acquire.lua").

        ``remaining``: seconds until the caller's deadline (``inf``: none);
        ``wait_ms``: the acquire reply's PTTL of the blocking owner's
        liveness (negative: unknown); ``liveness_left``: seconds until this
        owner's local liveness deadline. The wait ends by then: the only
        event Redis cannot push is a blocking owner's liveness running out,
        and the script is re-run (a liveness refresh) while a third of
        ``owner_ttl`` is still left before the local deadline, so that a
        lease handed off during the wait is not born close to its deadline.
        Never more than :attr:`block_cap` or ``owner_ttl``. A waiter sends at
        least :data:`MIN_BLOCK`.
        """
        owner_ttl = self.owner_ttl
        block = min(remaining, self.block_cap, owner_ttl)
        if wait_ms >= 0:
            block = min(block, wait_ms / 1000.0 + 0.01)
        return min(block, liveness_left - owner_ttl / 3)

    def contender_block_ms(self, remaining: float) -> int:
        """Milliseconds a holder waiting for a contender blocks on the
        contended streams before it counts again (``XREAD BLOCK``): at most
        :attr:`block_cap` and ``owner_ttl`` (a watched stream lives
        3 x ``owner_ttl``, renewed by every count); at least 1."""
        block = min(remaining, self.block_cap, self.owner_ttl)
        return max(1, int(block * 1000))

    @classmethod
    def build(
        cls,
        *,
        owner_ttl: Any,
        heartbeat_interval: Any,
        queue_scan_limit: Any,
        name: Any,
        heartbeat: Any,
        hold_connection: Any,
        group: Any,
        wait_replicas: Any,
        wait_timeout: Any,
        wait_policy: Any,
        eviction_check: Any,
        client_facts: Callable[[], tuple[float | None, bool]],
    ) -> EngineOptions:
        """Validate every option (``LockManager``'s arguments of the same names).

        ``client_facts()``, called once the client-independent options are
        valid (it may build the client, whose URL errors come next): the
        client's socket timeout (it bounds ``wait_timeout`` and the blocking
        reads) and whether it is a Redis Cluster client (no
        ``wait_replicas`` there).
        """
        ttl = _v.duration(
            "owner_ttl", owner_ttl, minimum=_v.MIN_OWNER_TTL, maximum=_v.MAX_OWNER_TTL
        )
        interval = _v.duration(
            "heartbeat_interval",
            max(ttl / 3, _v.MIN_HEARTBEAT_INTERVAL)
            if heartbeat_interval is None
            else heartbeat_interval,
            minimum=_v.MIN_HEARTBEAT_INTERVAL,
            maximum=ttl / 2,
        )
        _v.warn_fast_heartbeat("heartbeat_interval", interval)
        limit = _v.integer(
            "queue_scan_limit", queue_scan_limit, minimum=1, maximum=_v.MAX_SCAN_LIMIT
        )
        label = _v.label("name", name)
        beat = _v.flag("heartbeat", heartbeat)
        hold = _v.flag("hold_connection", hold_connection)
        if group is not None and not callable(group):
            raise ConfigurationError("group", f"must be a callable or None, not {group!r}")
        if eviction_check not in EVICTION_CHECK_MODES:
            raise ConfigurationError(
                "eviction_check",
                f"must be one of {', '.join(EVICTION_CHECK_MODES)}, not {eviction_check!r}",
            )
        socket_timeout, cluster = client_facts()
        cap = block_cap(socket_timeout)
        replicas, timeout, policy = _wait_options(
            wait_replicas, wait_timeout, wait_policy, cap, cluster
        )
        return cls(
            owner_ttl=float(ttl),
            heartbeat_interval=float(interval),
            queue_scan_limit=limit,
            name=label,
            heartbeat=bool(beat),
            hold_connection=bool(hold),
            group=group,
            wait_replicas=replicas,
            wait_timeout=timeout,
            wait_policy=policy,
            eviction_check=eviction_check,
            block_cap=cap,
        )


def _wait_options(
    replicas: Any, timeout: Any, policy: Any, cap_seconds: float, cluster: bool
) -> tuple[int, float, str]:
    """Validate ``wait_replicas``, ``wait_timeout`` and ``wait_policy``."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ConfigurationError(
            "wait_replicas", f"must be a non-negative int (0: off), not {replicas!r}"
        )
    if not 0 <= replicas <= MAX_WAIT_REPLICAS:
        raise ConfigurationError(
            "wait_replicas", f"must be within 0..{MAX_WAIT_REPLICAS} (0: off), not {replicas}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ConfigurationError("wait_timeout", f"must be a number of seconds, not {timeout!r}")
    # Below the socket timeout only when WAIT is sent (the default 1 s
    # must not refuse a client with a shorter socket timeout).
    cap = min(MAX_WAIT_TIMEOUT, cap_seconds) if replicas else MAX_WAIT_TIMEOUT
    if not MIN_WAIT_TIMEOUT <= timeout <= cap:  # also refuses nan and inf
        raise ConfigurationError(
            "wait_timeout",
            f"must be within {MIN_WAIT_TIMEOUT}..{cap:.3g} s (at most {MAX_WAIT_TIMEOUT} s "
            f"and below the client's socket timeout), not {timeout}",
        )
    if policy not in WAIT_POLICIES:
        raise ConfigurationError(
            "wait_policy", f"must be one of {', '.join(WAIT_POLICIES)}, not {policy!r}"
        )
    if replicas and cluster:
        raise ConfigurationError(
            "wait_replicas",
            "is not supported on Redis Cluster (WAIT has no key to route it to the "
            "namespace's master); use 0",
        )
    return replicas, float(timeout), policy
