-- defer_withdraw.lua: take a deferred task out of line: revoked, expired,
-- its park TTL ran out, or its grant was never adopted (docs/defer.md).
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
--   2 {ns}:deferred          zset of deferred task ids
--   3 {ns}:owners            active owners
-- The task owner's keys ({ns}:alive|held|waits:<task owner>, the owner of
-- the record's token,
-- {ns}:req|wake|holder:<its token>), the lock and queue keys of its resources
-- (read from the record), their {ns}:contended:<res> streams and the keys of
-- waiters woken are built from ARGV[2] and stay in {ns}.
--
-- ARGV:
--   1 task id
--   2 key prefix '{ns}:'
--   3 request TTL, ms (wake lists)
--   4 queue scan limit
--   5 'any': withdraw a parked or granted task whatever its liveness
--     (revoke, expiry); 'dead': only if the task owner's liveness is gone
--
-- Atomic steps: a record that is not 'parked' or 'granted' is left alone;
-- with 'dead', so is one whose task owner is alive. Otherwise, per resource:
-- HDEL the request's grant (if it has one; the contended stream goes when
-- the lock is left with no holder), ZREM its queue entry (if queued), and
-- hand the lock on or wake the queue (wake_front), as release.lua does. Then
-- delete the task owner's keys (its registry hash with the holder record,
-- liveness, waits, and the request's state, wake list and any holder record
-- key of an earlier release), drop it from the owners set and the task
-- from {ns}:deferred, and delete the record.
--
-- Reply:
--   {state, msg, life}    withdrawn: state it had ('parked' | 'granted'),
--                         msg its message (JSON), life the record's life
--   {'alive', state, pttl} ('dead' only) the task owner lives: not withdrawn
--   {state} | {'none'}    nothing to withdraw ('adopted', 'done', no record)

local rec, prefix = KEYS[1], ARGV[2]
local req_ttl, limit = ARGV[3], tonumber(ARGV[4])
local st = redis.call('HMGET', rec, 'state', 'token', 'modes', 'res', 'msg', 'life')
if not st[1] then return {'none'} end
if st[1] ~= 'parked' and st[1] ~= 'granted' then return {st[1]} end
local towner = owner_of(st[2])
if ARGV[5] == 'dead' then
  local pttl = redis.call('PTTL', prefix .. 'alive:' .. towner)
  if pttl ~= -2 then return {'alive', st[1], pttl} end
end
local token, modes = st[2], st[3]
local names = split_names(st[4])
redis.call('DEL', rec)
for i = 1, #names do
  local lock, q = prefix .. 'lock:' .. names[i], prefix .. 'q:' .. names[i]
  local holders = nil
  local r = redis.call('HDEL', lock, token)
  if r == 1 then
    holders = redis.call('HLEN', lock)
    if holders == 0 then
      redis.call('DEL', prefix .. 'contended:' .. names[i])
    end
  end
  local d = redis.call('ZREM', q, string.sub(modes, i, i) .. token)
  if r == 1 or d == 1 then
    wake_front(prefix, q, lock, limit, req_ttl, false, holders)
  end
end
redis.call('DEL', prefix .. 'req:' .. token, prefix .. 'wake:' .. token,
  prefix .. 'holder:' .. token, prefix .. 'held:' .. towner, prefix .. 'alive:' .. towner, prefix .. 'waits:' .. towner)
redis.call('SREM', KEYS[3], towner)
redis.call('ZREM', KEYS[2], ARGV[1])
return {st[1], st[5] or '', st[6] or '0'}
