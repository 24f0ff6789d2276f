-- release.lua: end one request whatever its state: release its grant,
-- leave the wait queues, or both (a grant that landed as its waiter gave up).
-- Every exit path of an acquisition calls this with the request's own token,
-- so it is safe to call twice and never touches another acquisition's locks.
--
-- KEYS (all in {ns}):
--   1..n     {ns}:lock:<res>     lock hashes
-- Every other key is built from the prefix ARGV[3], the token and the
-- resource names, and stays in {ns}: this owner's registry
-- {ns}:held:<owner> (hash: resource name -> ''; if it spilled, its bucket
-- index and buckets, _common.lua registry_del) and queued requests
-- {ns}:waits:<owner> (hash), the request's state {ns}:req:<token>, wake
-- list {ns}:wake:<token> and (written by an earlier release only) holder
-- record {ns}:holder:<token>, the wait
-- queues {ns}:q:<res> (same order as KEYS), the {ns}:contended:<res>
-- streams, and the keys of waiters to wake and of holders freed on the
-- way (see _common.lua reclaim_holders).
--
-- ARGV:
--   1 token '<owner>|<request id>' (the owner id is read from it)
--   2 modes, one char per resource ('x' | 's' | 'l'), as acquire.lua's ARGV[2]
--   3 key prefix '{ns}:'
--   4 request TTL in ms (for wake lists)
--   5 queue scan limit
--   6 '1' when the request was returned as a lease (granted, so it has no
--     queue entries: the queue ZREM is skipped); '2' for a lease whose grant
--     acquire.lua made in the call that replied it ({1, fence, reclaimed}):
--     it has no request state or wake list (a task's holder record is the
--     value of its registry fields), so their DEL is skipped too; '0' on
--     exit paths, where it may still be queued
--   7 (optional) '1' when the owner's registry has spilled into buckets,
--     '0' when it has not (the client knows), absent: unknown (one HMGET of
--     the bucket index)
--
-- Atomic steps: first one EXISTS over the queues and contended streams of
-- every resource (before any write, so a key the Redis user may not touch
-- fails the call before it changed anything): when none exists, nobody
-- waits and nobody watches. Then per resource, HDEL the token
-- (delete-if-holder: only this token's field goes), read how many holders
-- are left (none after an exclusive grant: an exclusive holder is alone;
-- HLEN for a shared one), and ZREM the request's queue entry (not for a
-- lease, ARGV[6]). Then, in one HDEL (plus one per bucket with ARGV[7] =
-- '1'), drop from the registry the resources
-- where the owner holds no other token now (at once when the hash is left
-- empty; HKEYS only when other holders remain). When the probe found
-- nothing, the release ends here (the uncontended release). Otherwise,
-- per changed resource: delete its contended stream when the lock has no
-- holder, and hand the locks to the head of the queue (try_handoff: the
-- waiter gets 'g<fence>' on its wake list) or wake it, every shared waiter
-- it unblocked included (wake_front; the holders of a later lock are read
-- again once a waiter was served, since a hand-off may have granted that
-- lock too). Every lock of the request is free before any waiter is
-- served. Last, delete the request's state, wake list and any holder
-- record key of an earlier release ({ns}:holder:<token>) unless ARGV[6] =
-- '2', and (not for a lease) its line in the owner's waits hash.
--
-- Reply: {released, dequeued}: how many locks this token still held and how
-- many queue entries it still had. released < n on a granted lease means
-- some lock had already been taken from it (its owner was declared dead).

local token, modes, prefix = ARGV[1], ARGV[2], ARGV[3]
local owner = owner_of(token)
local req_ttl, limit = ARGV[4], tonumber(ARGV[5])
local granted = ARGV[6] ~= '0'
local n = mode_count(modes)
local spilled = nil -- unknown: the bucket index tells (_common.lua registry_del)
if ARGV[7] == '1' then spilled = true elseif ARGV[7] == '0' then spilled = false end
local released, dequeued = 0, 0
local unlisted = {} -- resource names leaving the registry
local changed = {} -- i -> holders left (false: not read), for resources that changed
-- The queues and contended streams of every resource, probed before any
-- write: when none exists, nobody waits and nobody watches. (Probed first,
-- a key the Redis user may not touch fails the call before it wrote.)
local probe = {}
for i = 1, n do
  local name = name_of(prefix, KEYS[i])
  probe[i] = prefix .. 'q:' .. name
  probe[n + i] = prefix .. 'contended:' .. name
end
local busy = redis.call('EXISTS', unpack(probe)) > 0
for i = 1, n do
  local lock, mode = KEYS[i], string.sub(modes, i, i)
  local r = redis.call('HDEL', lock, token)
  local holders = false
  if r == 1 then
    released = released + 1
    -- An exclusive holder is alone: nobody is left.
    if mode == 'x' then holders = 0 else holders = redis.call('HLEN', lock) end
    if holders == 0 or not owner_holds(lock, owner) then
      unlisted[#unlisted + 1] = name_of(prefix, lock)
    end
  end
  local d = 0
  if not granted then d = redis.call('ZREM', probe[i], mode .. token) end
  dequeued = dequeued + d
  if r == 1 or d == 1 then changed[i] = holders end
end
if #unlisted > 0 then registry_del(prefix, owner, unlisted, spilled) end
local function finish()
  if ARGV[6] ~= '2' then
    redis.call('DEL', prefix .. 'req:' .. token, prefix .. 'wake:' .. token,
      prefix .. 'holder:' .. token)
  end
  if not granted then redis.call('HDEL', prefix .. 'waits:' .. owner, token) end
  return {released, dequeued}
end
if not busy then return finish() end

-- @helpers

for i = 1, n do
  if changed[i] == 0 then redis.call('DEL', probe[n + i]) end
end
-- A waiter served on one resource may have been handed others of this
-- request too: once anyone is served, later locks' holders are read again.
local served = 0
for i = 1, n do
  local holders = changed[i]
  if holders ~= nil then
    if served > 0 or holders == false then holders = nil end
    served = served + wake_front(prefix, probe[i], KEYS[i], limit, req_ttl, false, holders)
  end
end
return finish()
