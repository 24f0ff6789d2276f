-- defer_nudge.lua: a grant in transit was published: tell the waiting
-- requests that wait for it, so that a waiting task can give its pool slot
-- up for it (docs/defer.md, "Waiting tasks behind a grant in transit", T2).
--
-- KEYS (all in {ns}):
--   1 {ns}:defer:<task id>   the park record
-- The queues {ns}:q:<res> of the record's resources and the wake lists
-- {ns}:wake:<token> of the requests told are built from ARGV[1] and stay in
-- {ns}.
--
-- ARGV:
--   1 key prefix '{ns}:'
--   2 fence of the grant published
--   3 request TTL, ms (wake lists)
--   4 queue scan limit (entries looked at per queue)
--
-- Atomic steps: nothing unless the record is still 'granted' with fence
-- ARGV[2] (not adopted, not withdrawn). Then, for each of its resources, the
-- first ARGV[4] entries of its queue are read: every entry that waits for
-- the grant (all of them where the grant is exclusive or limited: a slot
-- it holds may be the one they wait for; where it is shared,
-- those from the first exclusive entry on) and belongs to a process, not a
-- task owner (a parked request holds no pool slot), gets 't' on its wake
-- list (one element, expiring like any wake-up).
--
-- Reply: the number of wake lists pushed to

local prefix, limit = ARGV[1], tonumber(ARGV[4])
local st = redis.call('HMGET', KEYS[1], 'state', 'modes', 'res', 'fence')
if st[1] ~= 'granted' or st[4] ~= ARGV[2] or not st[3] then return 0 end
local names = split_names(st[3])
local told = 0
for i = 1, #names do
  -- an exclusive or limited grant may block any waiter behind it
  local waits = string.sub(st[2], i, i) ~= 's'
  local page = redis.call('ZRANGE', prefix .. 'q:' .. names[i], '0', int(limit - 1))
  for _, m in ipairs(page) do
    waits = waits or string.sub(m, 1, 1) ~= 's'
    local t = string.sub(m, 2)
    if waits and not is_task_owner(owner_of(t)) then
      local k = prefix .. 'wake:' .. t
      redis.call('LPUSH', k, 't')
      redis.call('LTRIM', k, '0', '0')
      redis.call('PEXPIRE', k, ARGV[3])
      told = told + 1
    end
  end
end
return told
