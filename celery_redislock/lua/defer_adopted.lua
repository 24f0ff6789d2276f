-- defer_adopted.lua: a pool child adopted a deferred task's grant (the
-- engine's adopt.lua moved it to its owner): the park record says so.
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
--   2 {ns}:deferred          zset of deferred task ids
--
-- ARGV:
--   1 task id
--   2 the adopted task owner's token (the record must name it)
--   3 the adopting owner id
--   4 TTL of the record from now on, ms
--
-- Atomic steps: only a 'parked' or 'granted' record naming token ARGV[2]
-- changes: state 'adopted', owner ARGV[3], message dropped, PEXPIRE ARGV[4];
-- the task leaves {ns}:deferred.
--
-- Reply: 1 marked | 0 the record is another life's, or gone

local st = redis.call('HMGET', KEYS[1], 'state', 'token')
if (st[1] ~= 'parked' and st[1] ~= 'granted') or st[2] ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], 'msg')
redis.call('HSET', KEYS[1], 'state', 'adopted', 'owner', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
