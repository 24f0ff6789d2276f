-- node_heartbeat.lua: one tick of a worker incarnation's heartbeat. Refreshes
-- every owner of the incarnation (main process and pool children) in one
-- round trip, reports dead and lost owners, and beats the node record.
--
-- KEYS (in {ns}):
--   1 {ns}:node:<nodename>  node record (hash)
--   2 {ns}:group:<inc>      our group: owner id -> process tag
--                           ('<pid>.<starttime>', or a bare '<pid>')
--   3 {ns}:tomb:<inc>       our tombstone (set by a successor that evicted us)
-- Liveness keys {ns}:alive:<owner> are built from ARGV[3] and the owner ids
-- read from KEYS[2]; they stay in the same hash tag.
--
-- ARGV:
--   1 our incarnation id
--   2 owner liveness TTL, ms
--   3 key prefix '{ns}:'
--   4 TTL of the node record and the group hash, ms
--   5 '1' if the record should be ours (re-created if it vanished), else '0'
--   6 our heartbeat interval, ms (stored in the record)
--   7 pid, 8 host, 9 start time: fields for a re-created record
--   10.. live processes (the main process and live pool children), each
--        as its process tag '<pid>.<starttime>' and as its bare '<pid>' (the
--        latter matches only group values registered as a bare pid; a
--        tag with another start time, a dead process whose pid was reused,
--        matches neither)
--
-- Atomic steps:
--   1. Tombstone set: refresh nothing, reply {'evicted'}.
--   2. For each group owner: its value among the live ones -> PEXPIRE its
--      liveness key (a missing key is not re-created: the owner is lost);
--      otherwise -> dead.
--   3. Record ours -> HINCRBY hb, hb_ms = TIME; missing and ARGV[5] = '1'
--      -> re-created as ours; another incarnation's -> untouched.
--
-- Reply:
--   {'evicted'}
--   {'ok', owned (0|1), inc, hb, hb_ms, iv, now_ms, {dead owner, tag, ...},
--    {lost owner, tag, ...}}   inc/hb/hb_ms/iv: the record ('' if none)

if redis.call('EXISTS', KEYS[3]) == 1 then
  return {'evicted'}
end
-- TTLs stay strings (see _common.lua on numbers in redis.call).
local prefix, ttl, rec_ttl = ARGV[3], ARGV[2], ARGV[4]
local live = {}
for i = 10, #ARGV do live[ARGV[i]] = true end

local dead, lost = {}, {}
local g = redis.call('HGETALL', KEYS[2])
for i = 1, #g, 2 do
  local owner, pid = g[i], g[i + 1]
  if live[pid] then
    if redis.call('PEXPIRE', prefix .. 'alive:' .. owner, ttl) == 0 then
      lost[#lost + 1] = owner
      lost[#lost + 1] = pid
    end
  else
    dead[#dead + 1] = owner
    dead[#dead + 1] = pid
  end
end
if #g > 0 then redis.call('PEXPIRE', KEYS[2], rec_ttl) end

local t = redis.call('TIME')
local now = string.format('%.0f', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local cur = redis.call('HMGET', KEYS[1], 'inc', 'hb', 'hb_ms', 'iv')
local owned = 0
if cur[1] == ARGV[1] then
  local hb = redis.call('HINCRBY', KEYS[1], 'hb', '1')
  redis.call('HSET', KEYS[1], 'hb_ms', now, 'iv', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], rec_ttl)
  cur = {ARGV[1], tostring(hb), now, ARGV[6]}
  owned = 1
elseif not cur[1] and ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'inc', ARGV[1], 'hb', '1', 'hb_ms', now, 'iv', ARGV[6],
    'pid', ARGV[7], 'host', ARGV[8], 'started', ARGV[9])
  redis.call('PEXPIRE', KEYS[1], rec_ttl)
  cur = {ARGV[1], '1', now, ARGV[6]}
  owned = 1
end
return {'ok', owned, cur[1] or '', cur[2] or '', cur[3] or '', cur[4] or '', now, dead, lost}
