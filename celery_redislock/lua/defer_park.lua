-- defer_park.lua: write the park record of a task about to be parked
-- (on_busy="defer", docs/defer.md), unless a record already holds the task.
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>        the park record (hash)
--   2 {ns}:deferred               zset task id -> next re-attempt (ms, Redis TIME)
-- {ns}:deadlines (zset task id -> park or grant deadline, ms) is built from
-- ARGV[7] and stays in {ns}.
-- The task owner's tombstone {ns}:dead:<task owner> and the adopting owner's
-- liveness key {ns}:alive:<owner> (an 'adopted' record) are built from
-- ARGV[7] and stay in {ns}.
--
-- ARGV:
--   1 task id
--   2 lowest life number to use (a dispatcher parking a task again: the
--     withdrawn record's life + 1; else '0')
--   3 modes, one char per resource ('x' | 's')
--   4 resource names, '\n'-separated, same order
--   5 the task message (JSON: name, args, kwargs, options)
--   6 grant TTL, ms (how long a handed-over grant waits to be adopted)
--   7 key prefix '{ns}:'
--   8 first look-up delay, ms (the upkeep re-attempts the request then)
--   9 record TTL, ms (longest park + grant time, with margin)
--  10 park TTL, ms (the task owner's liveness once queued: its deadline)
--
-- Atomic steps:
--   1. A record exists: if it is 'adopted' by an owner whose liveness is
--      gone (the adopting child died mid-body) or 'done', it is replaced
--      only when 'adopted' and dead; otherwise reply its state (the caller
--      drops its copy of the message as a duplicate).
--   2. The record's life: ARGV[2], or the replaced record's life + 1. Its
--      task owner is 'task:<task id>' for life 0, else 'task+<life>:<task
--      id>' (each life its own owner: an adopted task owner is tombstoned),
--      its token '<task owner>|task:<task id>'.
--   3. Write the record (state 'parked', life, token, modes, res, msg,
--      gttl), PEXPIRE it, delete that owner's old tombstone, schedule the
--      first re-attempt in {ns}:deferred and the park deadline in
--      {ns}:deadlines.
--
-- Reply: {1, task owner, token, life} written | {0, state} a record holds
-- the task already

local rec = KEYS[1]
local prefix, tid = ARGV[7], ARGV[1]
local life = tonumber(ARGV[2])
local cur = redis.call('HMGET', rec, 'state', 'owner', 'life')
if cur[1] then
  local dead_adopter = cur[1] == 'adopted' and cur[2] and
    redis.call('EXISTS', prefix .. 'alive:' .. cur[2]) == 0
  if not dead_adopter then return {0, cur[1]} end
  life = math.max(life, (tonumber(cur[3]) or 0) + 1)
  redis.call('DEL', rec)
end
local owner = 'task:' .. tid
if life > 0 then owner = 'task+' .. int(life) .. ':' .. tid end
local token = owner .. '|task:' .. tid
redis.call('HSET', rec, 'state', 'parked', 'life', int(life), 'token', token,
  'modes', ARGV[3], 'res', ARGV[4], 'msg', ARGV[5], 'gttl', ARGV[6])
redis.call('PEXPIRE', rec, ARGV[9])
redis.call('DEL', prefix .. 'dead:' .. owner)
redis.call('ZADD', KEYS[2], time_ms_plus(ARGV[8]), tid)
redis.call('ZADD', prefix .. 'deadlines', time_ms_plus(ARGV[10]), tid)
return {1, owner, token, int(life)}
