-- defer_tick.lua: one upkeep of a worker's dispatcher (docs/defer.md, step 4).
--
-- KEYS (all in {ns}):
--   1 {ns}:dispatchers            set of incarnations that dispatch
--   2 {ns}:dispatcher:<inc>       this dispatcher's liveness (string, TTL)
--   3 {ns}:dispatch               the dispatch list (task ids)
--   4 {ns}:deferred               zset task id -> next look-up (ms)
-- Other dispatchers' {ns}:dispatcher:<inc> and {ns}:dispatching:<inc> keys
-- are built from ARGV[2] and the incarnations in KEYS[1]; they stay in {ns}.
--
-- ARGV:
--   1 this incarnation id
--   2 key prefix '{ns}:'
--   3 dispatcher liveness TTL, ms
--   4 most due task ids returned
--   5 ms until a returned id is due again (the caller looks at it meanwhile)
--
-- Atomic steps: refresh this dispatcher's liveness and membership; move
-- anything left in its own dispatching list back onto {ns}:dispatch (the
-- caller runs this between dispatches: an id left there is one whose
-- dispatch was cut short by an error); look at up
-- to 4 random other members: one whose liveness expired (its worker died)
-- has its dispatching list moved back onto {ns}:dispatch and leaves the set
-- (constant work per tick, whatever the number of workers: every dead
-- dispatcher is found after a few ticks of the fleet); return the ids whose
-- look-up is due, each pushed ARGV[5] ms later.
--
-- Reply: {now_ms, moved, {due task id, ...}}

local prefix, inc = ARGV[2], ARGV[1]
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
redis.call('SADD', KEYS[1], inc)
local moved = 0
local own = prefix .. 'dispatching:' .. inc
while redis.call('RPOPLPUSH', own, KEYS[3]) do moved = moved + 1 end
for _, o in ipairs(redis.call('SRANDMEMBER', KEYS[1], '4')) do
  if o ~= inc and redis.call('EXISTS', prefix .. 'dispatcher:' .. o) == 0 then
    local list = prefix .. 'dispatching:' .. o
    while redis.call('RPOPLPUSH', list, KEYS[3]) do moved = moved + 1 end
    redis.call('SREM', KEYS[1], o)
  end
end
local now = time_ms_plus('0')
local due = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', '0', ARGV[4])
if #due > 0 then
  local later = int(tonumber(now) + tonumber(ARGV[5]))
  for _, id in ipairs(due) do redis.call('ZADD', KEYS[4], later, id) end
end
return {now, moved, due}
