-- node_evict.lua: take over a node record from a predecessor incarnation
-- whose heartbeat stopped, compare-and-set on what the caller saw.
--
-- KEYS (in {ns}):
--   1 {ns}:node:<nodename>  node record (hash)
-- The predecessor's {ns}:tomb:<inc>, {ns}:group:<inc> and the liveness keys
-- {ns}:alive:<owner> of its group's owners are built from ARGV[1], the
-- record's incarnation and the group's owner ids: all in the same hash tag.
--
-- ARGV:
--   1 key prefix '{ns}:'
--   2 the predecessor's incarnation id, as the caller saw it
--   3 its hb counter, as the caller saw it
--   4 threshold, ms: its last beat (hb_ms) must be at least this old by TIME
--   5 'evict' (tombstone + delete its owners' liveness) or 'takeover'
--     (only replace the record: its owners are left to expire)
--   6 our incarnation id; 7 pid; 8 host; 9 start time; 10 our interval, ms
--   11 TTL of the node record, ms
--   12 TTL of the tombstone, ms
--   13 TTL of each evicted owner's tombstone {ns}:dead:<owner>, ms (3 x
--      owner_ttl: acquire.lua refuses to register a tombstoned owner)
--
-- Atomic steps: refuse if inc or hb differ from ARGV[2], ARGV[3] (it beat:
-- nothing is touched) or if its last beat is younger than ARGV[4]; else, in
-- 'evict' mode, SET the tombstone and, for every owner of its group, SET the
-- owner's tombstone and DEL its liveness key; then replace the record with
-- ours.
--
-- Reply:
--   {'changed', inc, hb}      the record moved on (inc '' if it vanished)
--   {'not-yet', ms_left}      its last beat is too recent
--   {'evicted', {owner...}}   done; the predecessor's owners, to clean up

local cur = redis.call('HMGET', KEYS[1], 'inc', 'hb', 'hb_ms')
if cur[1] ~= ARGV[2] or (cur[2] or '0') ~= ARGV[3] then
  return {'changed', cur[1] or '', cur[2] or ''}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local age = now - tonumber(cur[3] or '0')
local threshold = tonumber(ARGV[4])
if age < threshold then
  return {'not-yet', threshold - age}
end
local prefix, old = ARGV[1], ARGV[2]
local owners = redis.call('HKEYS', prefix .. 'group:' .. old)
if ARGV[5] == 'evict' then
  redis.call('SET', prefix .. 'tomb:' .. old, ARGV[6], 'PX', ARGV[12])
  for _, owner in ipairs(owners) do
    redis.call('SET', prefix .. 'dead:' .. owner, '1', 'PX', ARGV[13])
    redis.call('DEL', prefix .. 'alive:' .. owner)
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'inc', ARGV[6], 'hb', '0', 'hb_ms', string.format('%.0f', now),
  'iv', ARGV[10], 'pid', ARGV[7], 'host', ARGV[8], 'started', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[11])
return {'evicted', owners}
