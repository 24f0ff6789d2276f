-- defer_done.lua: the body of an adopted deferred task ended: keep a 'done'
-- record for a while, so that a stale copy of its message is dropped.
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
--
-- ARGV:
--   1 the adopting owner id
--   2 TTL of the done record, ms
--
-- Atomic steps: only a record 'adopted' by ARGV[1] changes: state 'done',
-- PEXPIRE ARGV[2].
--
-- Reply: 1 marked | 0 not (another life of the task owns the record)

local st = redis.call('HMGET', KEYS[1], 'state', 'owner')
if st[1] ~= 'adopted' or st[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
