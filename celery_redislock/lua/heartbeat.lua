-- heartbeat.lua: extend the liveness of one or more owners in one round trip,
-- and optionally verify that some grants are still recorded.
-- The heartbeat only extends a liveness key, never re-creates it: an owner
-- whose key is gone was declared dead (paused past its TTL, partitioned,
-- evicted, or evicted by a successor) and must fence itself.
--
-- KEYS: 1..m    {ns}:alive:<owner>  liveness keys (m = ARGV[2], or all KEYS
--               when ARGV[2] is absent)
--       m+1..   {ns}:lock:<res>     lock hashes to verify, one per ARGV[2+i]
-- ARGV: 1       liveness TTL in ms
--       2       (optional) m, the number of liveness keys
--       3..     holder tokens, one per lock key KEYS[m+i]
--
-- Atomic steps: PEXPIRE each liveness key (PEXPIRE on a missing key does
-- nothing); HEXISTS each (lock, token) pair (a grant Redis no longer records:
-- its lock hash was evicted or the data lost).
-- Reply: {r1, ..., rm, g1, ..., gk}: r = 1 extended, 0 gone (that owner is
-- dead); g = 1 grant recorded, 0 gone (that lease is lost).

local ttl = ARGV[1]  -- kept a string: see _common.lua on numbers in redis.call
local m = #KEYS
if ARGV[2] then m = tonumber(ARGV[2]) end
local out = {}
for i = 1, m do
  out[i] = redis.call('PEXPIRE', KEYS[i], ttl)
end
for i = m + 1, #KEYS do
  out[i] = redis.call('HEXISTS', KEYS[i], ARGV[2 + i - m])
end
return out
