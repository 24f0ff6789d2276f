-- defer_claim.lua: a dispatcher's look at one deferred task it popped from
-- the dispatch list (or found due in {ns}:deferred): claim the publishing of
-- a fresh grant, or say what else to do (docs/defer.md, step 3).
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
-- The task owner's liveness key {ns}:alive:<task owner> (the owner of the
-- record's token) is built from ARGV[2] and stays in {ns}.
--
-- ARGV:
--   1 task id
--   2 key prefix '{ns}:'
--
-- Atomic steps: read the record; a 'granted' record whose fence was not yet
-- published gets 'sent' = its fence (a second dispatcher, or a second pop of
-- the same id, then publishes nothing: at most one copy per grant).
--
-- Reply:
--   {'publish', fence, msg, life}                 publish this grant now
--   {'parked', token, modes, res, pttl, msg}      still queued: run its
--                                                 acquire for it (pttl: its
--                                                 liveness left, ms; -2 dead)
--   {'granted', pttl} | {'adopted'} | {'done'} | {'none'}   nothing to do
--                                                 here (granted: published
--                                                 already, pttl of the grant)

local rec, prefix = KEYS[1], ARGV[2]
local st = redis.call('HMGET', rec, 'state', 'token', 'modes', 'res', 'msg', 'fence', 'sent',
  'life')
if not st[1] then return {'none'} end
if st[1] ~= 'parked' and st[1] ~= 'granted' then return {st[1]} end
local pttl = redis.call('PTTL', prefix .. 'alive:' .. owner_of(st[2]))
if st[1] == 'parked' then
  return {'parked', st[2], st[3], st[4], pttl, st[5]}
end
if st[1] == 'granted' then
  if st[7] ~= st[6] and pttl ~= -2 then
    redis.call('HSET', rec, 'sent', st[6])
    return {'publish', st[6], st[5], st[8] or '0'}
  end
  return {'granted', pttl}
end
return {st[1]}
