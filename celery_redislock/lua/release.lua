-- release.lua: end one request whatever its state: release its grant,
-- leave the wait queues, or both (a grant that landed as its waiter gave up).
-- Every exit path of an acquisition calls this with the request's own token,
-- so it is safe to call twice and never touches another acquisition's locks.
--
-- KEYS (all in {ns}):
--   1        {ns}:held:<owner>   this owner's registry (hash: resource name -> '')
--   2        {ns}:req:<token>    the request's state hash
--   3        {ns}:wake:<token>   the request's wake list
--   4        {ns}:waits:<owner>  this owner's queued requests (hash)
--   5..4+n   {ns}:lock:<res>     lock hashes
--   5+n..4+2n {ns}:q:<res>       wait queues, same order
-- Keys of waiters to wake, of holders freed on the way (see _common.lua
-- reclaim_holders) and {ns}:contended:<res> are built from ARGV[3] and stay
-- in {ns}.
--
-- ARGV:
--   1 token '<owner>|<request id>' (the owner id is read from it)
--   2 modes, one char per resource ('x' | 's')
--   3 key prefix '{ns}:'
--   4 request TTL in ms (for wake lists)
--   5 queue scan limit
--   6 '1' when the request was returned as a lease (granted, so it has no
--     queue entries: the queue ZREM is skipped); '0' on exit paths, where
--     it may still be queued
--
-- Atomic steps, per resource: HDEL the token (delete-if-holder: only this
-- token's field goes); drop the resource from the registry once the owner
-- holds no other token there (at once when the hash is left empty; HKEYS
-- only when other holders remain); ZREM the request's queue entry (not for a
-- lease, ARGV[6]); if anything changed, hand the locks to the head of the
-- queue (try_handoff: the waiter gets 'g<fence>' on its wake list) or wake
-- it, every shared waiter it unblocked included (wake_front); when the lock
-- is left with no holder, delete its contended stream. Then delete the
-- request's state, wake list and holder info ({ns}:holder:<token>), and
-- (not for a lease) its line in the owner's waits hash.
--
-- Reply: {released, dequeued}: how many locks this token still held and how
-- many queue entries it still had. released < n on a granted lease means
-- some lock had already been taken from it (its owner was declared dead).

local token, modes, prefix = ARGV[1], ARGV[2], ARGV[3]
local owner = owner_of(token)
local req_ttl, limit = ARGV[4], tonumber(ARGV[5])
local granted = ARGV[6] == '1'
local n = #modes
local released, dequeued = 0, 0
for i = 1, n do
  local lock, q, mode = KEYS[4 + i], KEYS[4 + n + i], string.sub(modes, i, i)
  local r = redis.call('HDEL', lock, token)
  local holders = nil
  if r == 1 then
    released = released + 1
    holders = redis.call('HLEN', lock)
    local name = name_of(prefix, lock)
    if holders == 0 or not owner_holds(lock, owner) then
      redis.call('HDEL', KEYS[1], name)
    end
    if holders == 0 then
      redis.call('DEL', prefix .. 'contended:' .. name)
    end
  end
  local d = 0
  if not granted then d = redis.call('ZREM', q, mode .. token) end
  dequeued = dequeued + d
  if r == 1 or d == 1 then
    wake_front(prefix, q, lock, limit, req_ttl, false, holders)
  end
end
redis.call('DEL', KEYS[2], KEYS[3], prefix .. 'holder:' .. token)
if not granted then redis.call('HDEL', KEYS[4], token) end
return {released, dequeued}
