-- node_start.lua: a worker incarnation claims its node record, or learns
-- whose it is. Constant cost: no SCAN, no key read from a registry.
--
-- KEYS (in {ns}):
--   1 {ns}:node:<nodename>  node record (hash: inc, hb, hb_ms, iv, pid, host, started)
--
-- ARGV:
--   1 our incarnation id
--   2 pid of the worker's main process
--   3 host name
--   4 start time (unix seconds, for operators)
--   5 our heartbeat interval, ms
--   6 TTL of the node record, ms (refreshed by every beat)
--
-- Atomic steps: a missing record is created with our incarnation (hb 0,
-- hb_ms = Redis TIME); an existing one is left untouched and described.
--
-- Reply:
--   {'new'}                                  record created: a brand-new node
--   {'ours'}                                 the record is already ours
--   {'other', inc, hb, hb_ms, iv, now_ms}    another incarnation holds it

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'inc', 'hb', 'hb_ms', 'iv')
if not cur[1] then
  redis.call('HSET', KEYS[1], 'inc', ARGV[1], 'hb', '0', 'hb_ms', string.format('%.0f', now),
    'iv', ARGV[5], 'pid', ARGV[2], 'host', ARGV[3], 'started', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  return {'new'}
end
if cur[1] == ARGV[1] then
  return {'ours'}
end
return {'other', cur[1], cur[2] or '0', cur[3] or '0', cur[4] or '0', string.format('%.0f', now)}
