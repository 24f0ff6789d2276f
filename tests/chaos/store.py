"""The protected store: one hash per resource on its own redis-server.

It is what a lock protects in real life (a database row, a file), reduced
to a counter per resource, and it enforces fencing the way such a store
would: an access carrying a fencing token lower than one it has already
seen is refused. It never shares a server with the locks, so no fault of
the lock server (restart, stall, client kill) touches it.

``store:<resource>`` (hash):

- ``v``      the counter (decimal string), incremented by each accepted write;
- ``writes`` number of accepted writes (so ``v == writes`` unless an
  accepted write was based on a stale read: a lost update);
- ``xmax``   highest fence of an exclusive access (read or write) accepted;
- ``smax``   highest fence of a shared read accepted.

An exclusive access needs ``fence >= max(xmax, smax)``: a shared reader
with a higher fence was granted later, so an exclusive holder with a lower
one has lost its lock. A shared read needs ``fence >= xmax``.

``store:anomalies`` (list): one JSON entry per accepted write whose
expected value (what the writer read) was no longer the stored one: the
fence rule let a lost update through, which only happens when fencing
tokens were reused or went backwards.
"""

from __future__ import annotations

from typing import Any

import redis

ANOMALIES = "store:anomalies"

# KEYS[1] store:<res>; ARGV[1] fence; ARGV[2] 'x' | 's'
# reply: {1, value} accepted | {0, highest fence seen} refused (stale)
_READ = """
local f = tonumber(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'v', 'xmax', 'smax')
local xmax = tonumber(h[2] or '0')
local smax = tonumber(h[3] or '0')
-- Fences (~1.8e15) are exact in Lua's doubles; replies use the stored
-- strings, as tostring() would print them in exponent form.
local top = (xmax >= smax) and (h[2] or '0') or h[3]
if ARGV[2] == 'x' then
  if f < xmax or f < smax then return {0, top} end
  if f > xmax then redis.call('HSET', KEYS[1], 'xmax', ARGV[1]) end
else
  if f < xmax then return {0, h[2]} end
  if f > smax then redis.call('HSET', KEYS[1], 'smax', ARGV[1]) end
end
return {1, h[1] or '0'}
"""

# KEYS[1] store:<res>; KEYS[2] store:anomalies
# ARGV[1] fence; ARGV[2] expected value (what the writer read); ARGV[3] new
# value; ARGV[4] writer's op id; ARGV[5] resource
# reply: {1, value before} accepted | {0, highest fence seen} refused (stale)
_WRITE = """
local f = tonumber(ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'v', 'xmax', 'smax')
local xmax = tonumber(h[2] or '0')
local smax = tonumber(h[3] or '0')
if f < xmax or f < smax then return {0, (xmax >= smax) and h[2] or h[3]} end
local before = h[1] or '0'
if before ~= ARGV[2] then
  redis.call('RPUSH', KEYS[2], cjson.encode({res = ARGV[5], op = ARGV[4], fence = ARGV[1],
    expected = ARGV[2], found = before}))
end
redis.call('HSET', KEYS[1], 'v', ARGV[3], 'xmax', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'writes', '1')
return {1, before}
"""


def key(resource: str) -> str:
    return f"store:{resource}"


class Store:
    """Fenced reads and writes on the store server (one round trip each)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self._read = self.client.register_script(_READ)
        self._write = self.client.register_script(_WRITE)

    def read(self, resource: str, fence: int, mode: str) -> tuple[bool, int]:
        """``(accepted, value)``, or ``(False, highest fence seen)`` if stale."""
        ok, value = self._read(keys=[key(resource)], args=[str(fence), mode])
        return bool(int(ok)), int(value)

    def write(
        self, resource: str, fence: int, expected: int, new: int, op: str
    ) -> tuple[bool, int]:
        """``(accepted, value before)``, or ``(False, highest fence seen)`` if stale."""
        ok, value = self._write(
            keys=[key(resource), ANOMALIES],
            args=[str(fence), str(expected), str(new), op, resource],
        )
        return bool(int(ok)), int(value)

    def snapshot(self, resources: list[str]) -> dict[str, dict[str, Any]]:
        """Every resource's hash, for the checker."""
        pipe = self.client.pipeline(transaction=False)
        for res in resources:
            pipe.hgetall(key(res))
        return dict(zip(resources, pipe.execute()))

    def anomalies(self) -> list[str]:
        return list(self.client.lrange(ANOMALIES, 0, -1))

    def close(self) -> None:
        self.client.close()
