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
--   3 modes, as acquire.lua's ARGV[2] (limits included)
--   4 resource names, '\n'-separated, same order
--   5 the task message (JSON: name, args, kwargs, options)
--   6 grant TTL, ms (how long a handed-over grant waits to be adopted)
--   7 key prefix '{ns}:'
--   8 first look-up delay, ms (the upkeep re-attempts the request then)
--   9 record TTL, ms (longest park + grant time, with margin)
--  10 park TTL, ms (the task owner's liveness once queued: its deadline)
--  11 (optional) the message's retry number (Celery's request.retries);
--     '' or absent: 0
--  12 (optional) token of a queued request to take over: a waiting task
--     parked in its place (docs/defer.md, T3); '' or absent: none
--  13 (with 12) the task owner's liveness value (who it is, for operators)
--  14 (with 12) the moved request's holder record under the task owner's
--     token ('' for none)
-- With ARGV[12], the queues {ns}:q:<res> of ARGV[4], that request's
-- {ns}:req|wake:<token>, its owner's {ns}:waits:<owner>, the task owner's
-- {ns}:req:<token>, {ns}:waits|alive:<task owner> and {ns}:owners are built
-- from ARGV[7] too.
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
--   4. Take over (ARGV[12]; checked before step 2 writes anything: the
--      request must still be in its first queue, else reply
--      {0, 'not-queued'}): in every queue its entry is replaced by the task
--      owner's token with the same score (its arrival number), the request
--      state moves to the task owner's token (state, seq, modes, res,
--      holder record; TTL ARGV[10]), its line moves from its owner's waits
--      hash to the task owner's, its wake list goes, and the task owner
--      gets its liveness (ARGV[10], value ARGV[13]) and joins {ns}:owners.
--      The caller runs acquire.lua as the task owner next, as for any park.
--
-- Reply: {1, task owner, token, life} written | {0, state} a record holds
-- the task already | {0, 'not-queued'} the request to take over is not
-- queued (granted meanwhile, or gone): nothing written

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
end
local from = ARGV[12] or ''
local names
if from ~= '' then
  names = split_names(ARGV[4])
  local q1 = prefix .. 'q:' .. names[1]
  if not redis.call('ZSCORE', q1, string.sub(ARGV[3], 1, 1) .. from) then
    return {0, 'not-queued'}
  end
end
if cur[1] then redis.call('DEL', rec) end
local owner = 'defer:' .. tid
if life > 0 then owner = 'defer+' .. int(life) .. ':' .. tid end
local token = owner .. '|task:' .. tid
redis.call('HSET', rec, 'state', 'parked', 'life', int(life), 'retries', int(retries),
  'token', token, 'modes', ARGV[3], 'res', ARGV[4], 'msg', ARGV[5], 'gttl', ARGV[6])
redis.call('PEXPIRE', rec, ARGV[9])
redis.call('DEL', prefix .. 'dead:' .. owner)
redis.call('ZADD', KEYS[2], time_ms_plus(ARGV[8]), tid)
redis.call('ZADD', prefix .. 'deadlines', time_ms_plus(ARGV[10]), tid)
if from ~= '' then
  -- 4. take over the waiting request, in its place in every queue
  local modes = ARGV[3]
  local seq = nil
  for i = 1, #names do
    local q, mode = prefix .. 'q:' .. names[i], string.sub(modes, i, i)
    local score = redis.call('ZSCORE', q, mode .. from)
    if score then
      seq = seq or score
      redis.call('ZREM', q, mode .. from)
      redis.call('ZADD', q, score, mode .. token)
    end
  end
  local req = prefix .. 'req:' .. token
  redis.call('HSET', req, 'state', 'q', 'seq', seq, 'modes', modes, 'res', ARGV[4],
    'nested', '0')
  if (ARGV[14] or '') ~= '' then redis.call('HSET', req, 'holder', ARGV[14]) end
  redis.call('PEXPIRE', req, ARGV[10])
  redis.call('HDEL', prefix .. 'waits:' .. owner_of(from), from)
  redis.call('HSET', prefix .. 'waits:' .. owner, token, modes .. '\n' .. ARGV[4])
  redis.call('DEL', prefix .. 'req:' .. from, prefix .. 'wake:' .. from)
  redis.call('SET', prefix .. 'alive:' .. owner, ARGV[13], 'PX', ARGV[10])
  redis.call('SADD', prefix .. 'owners', owner)
end
return {1, owner, token, int(life)}
