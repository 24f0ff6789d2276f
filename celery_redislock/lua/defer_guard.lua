-- defer_guard.lua: a deferred task's guard message came due (docs/defer.md,
-- "Guards"): say whether the park record still holds the task and, if so,
-- let exactly one guard message per record go on watching it.
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
--   2 {ns}:deferred          zset of parked task ids (its size: the parked tasks)
--   3 {ns}:guardslot         the namespace's next free guard check time, ms
--                            (Redis TIME; expires once it is past)
--
-- ARGV:
--   1 the guard's id (made when its task parked)
--   2 the guard message's sequence number (a decimal string)
--   3 how long the claim stands without a check, ms (a guard whose claimant
--     has not checked in for that long may take the record over)
--   4 (optional) the attempt the guard watches: its message's retry number
--     (Celery's request.retries); '' or absent: any attempt
--   5 (optional) the guard interval, ms; '' or absent: ARGV[3] / 3
--   6 (optional) the namespace's guard budget, checks a second; '' or absent:
--     none. The next check is booked in the namespace's schedule: at
--     now + interval, or at the next free slot (KEYS[3]) if that is later,
--     and the slot after it is 1000 / budget ms on. So all the namespace's
--     guards together make at most budget checks a second however many
--     tasks are parked: the interval stretches to (parked tasks) / budget
--     seconds. A booking is never later than now + the interval +
--     (parked tasks) / budget (slots booked for guards that ended since are
--     not waited for)
--
-- Atomic steps: read the record's state, life and guard claim ('guard' id,
-- 'gseq' the sequence number it expects next, 'gdue' its deadline, ms
-- Redis TIME). A record that is not 'parked' or 'granted' is left alone.
-- A record of a later attempt than ARGV[4] (its 'retries' higher: the retry
-- of a run that adopted this guard's attempt parked again, and sent a guard
-- of its own) is left alone.
-- A record claimed by another guard whose deadline has not passed is left
-- alone. A record claimed by this guard whose expected sequence number is
-- not ARGV[2] is left alone (a second delivery of a guard message already
-- handled: a broker redelivery). Otherwise the claim becomes this guard's:
-- 'guard' = ARGV[1], 'gseq' = ARGV[2] + 1, 'gdue' = now + the larger of
-- ARGV[3] and 3 x the next check's delay (booked as ARGV[6] says).
--
-- Reply:
--   {'rearm', life, delay}  claimed: send the next guard message (sequence
--                     ARGV[2] + 1) due in delay ms
--   {'other', life}   another guard watches the record: this one ends
--   {'stale', life}   this guard message was handled already: it ends
--   {'superseded', life} the record holds a later attempt: this guard ends
--   {state}           'adopted' or 'done': the task left the park; it ends
--   {'none'}          no record: the caller asks the result backend why

local st = redis.call('HMGET', KEYS[1], 'state', 'life', 'guard', 'gseq', 'gdue', 'retries')
if not st[1] then return {'none'} end
if st[1] ~= 'parked' and st[1] ~= 'granted' then return {st[1]} end
local life = st[2] or '0'
if (ARGV[4] or '') ~= '' and (tonumber(st[6]) or 0) > tonumber(ARGV[4]) then
  return {'superseded', life}
end
local now = tonumber(time_ms_plus('0'))
if st[3] and st[3] ~= ARGV[1] then
  if tonumber(st[5] or '0') > now then return {'other', life} end
elseif st[3] and st[4] ~= ARGV[2] then
  return {'stale', life}
end
local claim = tonumber(ARGV[3])
local delay = tonumber(ARGV[5] or '') or math.floor(claim / 3)
local budget = tonumber(ARGV[6] or '')
if budget and budget > 0 then
  local gap = 1000 / budget
  local latest = delay + math.ceil(redis.call('ZCARD', KEYS[2]) * gap)
  local slot = tonumber(redis.call('GET', KEYS[3]) or '0') - now
  if slot < delay then slot = delay end
  if slot > latest then slot = latest end
  delay = math.ceil(slot)
  redis.call('SET', KEYS[3], int(now + slot + gap), 'PX', int(math.ceil(slot + gap) + 1))
end
if 3 * delay > claim then claim = 3 * delay end
redis.call('HSET', KEYS[1], 'guard', ARGV[1], 'gseq', int(tonumber(ARGV[2]) + 1),
  'gdue', int(now + claim))
return {'rearm', life, int(delay)}
