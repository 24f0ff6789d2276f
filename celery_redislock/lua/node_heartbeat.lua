-- node_heartbeat.lua: one tick of a worker incarnation's heartbeat. Refreshes
-- every owner of the incarnation (main process and pool children) in one
-- round trip, reports dead and lost owners, and beats the node record.
--
-- KEYS (in {ns}):
--   1 {ns}:node:<nodename>  node record (hash)
--   2 {ns}:group:<inc>      our group: owner id -> process tag
--                           ('<pid>.<starttime>', or a bare '<pid>')
--   3 {ns}:tomb:<inc>       our tombstone (set by a successor that evicted us)
--   4 (optional) {ns}:group:<previous inc>  the group of the incarnation we
--     gave up because Redis lost its state: owners that pool children
--     registered there since (they read the new id a moment late) are moved
--     into ours
-- Liveness keys {ns}:alive:<owner> are built from ARGV[3] and the owner ids
-- read from KEYS[2]; they stay in the same hash tag.
--
-- ARGV:
--   1 our incarnation id
--   2 owner liveness TTL, ms
--   3 key prefix '{ns}:'
--   4 TTL of the node record and the group hash, ms
--   5 '1' if the record should be ours (state 'owner'), else '0'
--   6 our heartbeat interval, ms (stored in the record)
--   7 the main process's own owner id if it registered one, else '': it
--     must be in our group (checked to notice a group that Redis lost)
--   8.. live processes (the main process and live pool children), each
--        as its process tag '<pid>.<starttime>' and as its bare '<pid>' (the
--        latter matches only group values registered as a bare pid; a
--        tag with another start time, a dead process whose pid was reused,
--        matches neither)
--
-- Atomic steps:
--   1. Tombstone set: refresh nothing, reply {'evicted'}.
--   1b. Redis lost our state (restart without persistence, FLUSHALL, a
--      failover to a replica that missed it, eviction): the record should be
--      ours (ARGV[5] = '1') but is missing, or ARGV[7] is not in our group.
--      Refresh nothing, re-create nothing (delete the record if it is still
--      ours), reply {'gone', 'record' | 'group'}: the caller fences and
--      starts a fresh incarnation.
--   1c. KEYS[4] given: its entries move into our group (HSET), it is deleted.
--   2. For each group owner: its value among the live ones -> PEXPIRE its
--      liveness key (a missing key is not re-created: the owner is lost);
--      otherwise -> dead.
--   3. Record ours -> HINCRBY hb, hb_ms = TIME; missing or another
--      incarnation's -> untouched (the caller claims a vanished record with
--      node_start.lua; it never silently re-creates its own, see 1b).
--
-- Reply:
--   {'evicted'}
--   {'gone', what}
--   {'ok', owned (0|1), inc, hb, hb_ms, iv, now_ms, {dead owner, tag, ...},
--    {lost owner, tag, ...}}   inc/hb/hb_ms/iv: the record ('' if none)

if redis.call('EXISTS', KEYS[3]) == 1 then
  return {'evicted'}
end
-- TTLs stay strings (see _common.lua on numbers in redis.call).
local prefix, ttl, rec_ttl = ARGV[3], ARGV[2], ARGV[4]
local live = {}
for i = 8, #ARGV do live[ARGV[i]] = true end

if ARGV[5] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then
  return {'gone', 'record'}
end
if ARGV[7] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[7]) == 0 then
  if redis.call('HGET', KEYS[1], 'inc') == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return {'gone', 'group'}
end

if #KEYS > 3 then
  local moved = redis.call('HGETALL', KEYS[4])
  if #moved > 0 then
    redis.call('HSET', KEYS[2], unpack(moved))
    redis.call('DEL', KEYS[4])
  end
end

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
end
return {'ok', owned, cur[1] or '', cur[2] or '', cur[3] or '', cur[4] or '', now, dead, lost}
