-- defer_tick.lua: one pass of a worker's dispatcher upkeep (docs/defer.md,
-- step 4).
--
-- KEYS (all in {ns}):
--   1 {ns}:dispatchers            set of incarnations that dispatch
--   2 {ns}:dispatcher:<inc>       this dispatcher's liveness (string, TTL)
--   3 {ns}:dispatch               the dispatch list (task ids)
--   4 {ns}:deferred               zset task id -> next re-attempt (ms)
--   5 {ns}:deadlines              zset task id -> park or grant deadline (ms)
-- Other dispatchers' {ns}:dispatcher:<inc> and {ns}:dispatching:<inc> keys
-- are built from ARGV[2] and the incarnations in KEYS[1]; the park records
-- {ns}:defer:<task id> of due tasks, their task owners' keys and the lock,
-- queue and waiter keys a withdrawal touches (defer_withdraw_task) from
-- ARGV[2]; all stay in {ns}.
--
-- ARGV:
--   1 this incarnation id
--   2 key prefix '{ns}:'
--   3 dispatcher liveness TTL, ms
--   4 most due re-attempts returned
--   5 ms until a returned re-attempt is due again (the caller looks at it
--     meanwhile)
--   6 most due deadlines looked at
--   7 request TTL, ms (wake lists of waiters a withdrawal wakes)
--   8 queue scan limit
--
-- Atomic steps: refresh this dispatcher's liveness and membership; move
-- anything left in its own dispatching list back onto {ns}:dispatch (the
-- caller runs this between dispatches: an id left there is one whose
-- dispatch was cut short by an error); look at up
-- to 4 random other members: one whose liveness expired (its worker died)
-- has its dispatching list moved back onto {ns}:dispatch and leaves the set
-- (constant work per tick, whatever the number of workers: every dead
-- dispatcher is found after a few ticks of the fleet). Then the deadlines
-- due, at most ARGV[6], earliest first: a task whose record is no longer
-- 'parked' or 'granted' (adopted, done, gone) just leaves {ns}:deadlines; one
-- whose task owner still lives (its liveness was set a moment after the
-- deadline was written) gets its deadline moved to the liveness's end; a
-- dead one is withdrawn here (defer_withdraw_task: its locks are handed on,
-- its queue entries go) and returned. Last, the re-attempts due, at most
-- ARGV[4], each pushed ARGV[5] ms later and returned. Deadlines and
-- re-attempts are two zsets: however many re-attempts are due, they never
-- delay a deadline. The work is O(entries due), never O(tasks parked).
--
-- Reply: {now_ms, moved, {due re-attempt id, ...},
--         {withdrawn id, state, msg, life, ...}, more}
--   more = 1 when a limit was reached (more may be due: run again at once)

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
local more = 0
local withdrawn = {}
local ends = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', '0', ARGV[6])
if #ends >= tonumber(ARGV[6]) then more = 1 end
local limit = tonumber(ARGV[8])
for _, id in ipairs(ends) do
  local got = defer_withdraw_task(prefix, id, ARGV[7], limit, true)
  if got[1] == 'alive' then
    local pttl = tonumber(got[3])
    if pttl < 0 then pttl = tonumber(ARGV[3]) end -- no TTL: look again later
    redis.call('ZADD', KEYS[5], int(tonumber(now) + pttl), id)
  elseif got[1] == 'parked' or got[1] == 'granted' then
    withdrawn[#withdrawn + 1] = id
    for j = 1, 3 do withdrawn[#withdrawn + 1] = got[j] end
  else
    redis.call('ZREM', KEYS[5], id)
  end
end
local due = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', '0', ARGV[4])
if #due > 0 then
  if #due >= tonumber(ARGV[4]) then more = 1 end
  local later = int(tonumber(now) + tonumber(ARGV[5]))
  for _, id in ipairs(due) do redis.call('ZADD', KEYS[4], later, id) end
end
return {now, moved, due, withdrawn, more}
