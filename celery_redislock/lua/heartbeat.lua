-- heartbeat.lua: extend the liveness of one or more owners in one round trip.
-- The heartbeat only extends a liveness key, never re-creates it: an owner
-- whose key is gone was declared dead (paused past its TTL, partitioned,
-- evicted, or evicted by a successor) and must fence itself.
--
-- KEYS: 1..m  {ns}:alive:<owner>  liveness keys
-- ARGV: 1     liveness TTL in ms
--
-- Atomic steps: PEXPIRE each key (PEXPIRE on a missing key does nothing).
-- Reply: {r1, ..., rm}: 1 extended, 0 gone (that owner is dead).

local ttl = ARGV[1]  -- kept a string: see _common.lua on numbers in redis.call
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('PEXPIRE', KEYS[i], ttl)
end
return out
