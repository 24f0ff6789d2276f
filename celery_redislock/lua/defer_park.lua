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
--  11 (optional) the message's retry number (Celery's request.retries);
--     '' or absent: 0
--
-- Atomic steps:
--   1. A record exists: it is replaced when it is 'adopted' by an owner
--      whose liveness is gone (the adopting child died mid-body), or when
--      it is 'adopted' or 'done' and this message's retry number ARGV[11]
--      is higher than the record's 'retries' (a record without one, written
--      by an earlier release, counts as 0): the message is a retry the
--      adopted run sent (Celery's self.retry()), a new life of the task.
--      Otherwise reply its state (the caller drops its copy of the message
--      as a duplicate: a 'parked' or 'granted' record is in line, and a
--      copy of the same attempt as an 'adopted' or 'done' one is stale).
--   2. The record's life: ARGV[2], or the replaced record's life + 1. Its
--      task owner is 'defer:<task id>' for life 0, else 'defer+<life>:<task
--      id>' (each life its own owner: an adopted task owner is tombstoned;
--      a name of its own, apart from the 'task:' owners of UniqueTask), its
--      token '<task owner>|task:<task id>'.
--   3. Write the record (state 'parked', life, retries, token, modes, res,
--      msg, gttl), PEXPIRE it, delete that owner's old tombstone, schedule the
--      first re-attempt in {ns}:deferred and the park deadline in
--      {ns}:deadlines.
--
-- Reply: {1, task owner, token, life} written | {0, state} a record holds
-- the task already

local rec = KEYS[1]
local prefix, tid = ARGV[7], ARGV[1]
local life = tonumber(ARGV[2])
local retries = tonumber(ARGV[11] or '') or 0
local cur = redis.call('HMGET', rec, 'state', 'owner', 'life', 'retries')
if cur[1] then
  local ran = cur[1] == 'adopted' or cur[1] == 'done'
  local dead_adopter = cur[1] == 'adopted' and cur[2] and
    redis.call('EXISTS', prefix .. 'alive:' .. cur[2]) == 0
  local retry = ran and retries > (tonumber(cur[4]) or 0)
  if not dead_adopter and not retry then return {0, cur[1]} end
  life = math.max(life, (tonumber(cur[3]) or 0) + 1)
  redis.call('DEL', rec)
end
local owner = 'defer:' .. tid
if life > 0 then owner = 'defer+' .. int(life) .. ':' .. tid end
local token = owner .. '|task:' .. tid
redis.call('HSET', rec, 'state', 'parked', 'life', int(life), 'retries', int(retries),
  'token', token, 'modes', ARGV[3], 'res', ARGV[4], 'msg', ARGV[5], 'gttl', ARGV[6])
redis.call('PEXPIRE', rec, ARGV[9])
redis.call('DEL', prefix .. 'dead:' .. owner)
redis.call('ZADD', KEYS[2], time_ms_plus(ARGV[8]), tid)
redis.call('ZADD', prefix .. 'deadlines', time_ms_plus(ARGV[10]), tid)
return {1, owner, token, int(life)}
