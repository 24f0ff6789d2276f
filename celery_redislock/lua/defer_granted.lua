-- defer_granted.lua: a dispatcher ran a parked request's acquire for it and
-- it was granted: mark the record 'granted' and dispatch it (docs/defer.md).
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
-- The task owner's {ns}:alive:<task owner> (its owner read from the
-- record's token), {ns}:deferred and {ns}:dispatch are built from ARGV[2]
-- and stay in {ns}.
--
-- ARGV:
--   1 task id
--   2 key prefix '{ns}:'
--   3 fence of the grant
--
-- Atomic steps: only a 'parked' record changes: it becomes 'granted' with the
-- fence, the task owner lives for the grant TTL, the task's next look-up is
-- the grant deadline and its id is pushed to {ns}:dispatch (as try_handoff
-- does for a hand-off).
--
-- Reply: {1} | {0, state or 'none'}

local st = redis.call('HMGET', KEYS[1], 'state', 'token')
if st[1] ~= 'parked' then return {0, st[1] or 'none'} end
defer_granted(ARGV[2], ARGV[1], owner_of(st[2]), ARGV[3])
return {1}
