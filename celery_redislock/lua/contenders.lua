-- contenders.lua: how many other requests wait for any of a lease's
-- resources, and where each resource's contended stream stands; optionally
-- start watching the streams.
--
-- KEYS: 1..n     {ns}:q:<res>          the lease's wait queues
--       n+1..2n  {ns}:contended:<res>  their contended streams, same order
-- ARGV: 1 the lease's token; 2 scan limit (entries looked at per queue);
--       3 (optional) TTL in ms of the streams to watch (lease.
--         wait_for_contender()), absent or '' to count only
--
-- Atomic steps: read the head of each queue, count distinct tokens other
-- than the lease's own (a request waiting for two of the lease's resources
-- counts once). Dead entries are counted until a script removes them. When
-- the count is 0 and ARGV[3] is given: create each missing contended stream
-- (XADD of one entry: a stream exists only while a holder watches it, and
-- acquire.lua adds to it only then) and PEXPIRE every one by ARGV[3]. Read
-- the last entry id of each contended stream ('0-0' when there is none):
-- lease.wait_for_contender() then XREADs the streams from these ids, so a
-- request that blocks after this count wakes it, and none before is missed.
-- Reply: {count, id_1, ..., id_n}; count is at most n * limit.

local token, limit = ARGV[1], tonumber(ARGV[2])
local n = #KEYS / 2
local seen, count = {}, 0
for i = 1, n do
  for _, m in ipairs(redis.call('ZRANGE', KEYS[i], '0', int(limit - 1))) do
    local t = string.sub(m, 2)
    if t ~= token and not seen[t] then
      seen[t] = true
      count = count + 1
    end
  end
end
if count == 0 and ARGV[3] and ARGV[3] ~= '' then
  for i = 1, n do
    if redis.call('EXISTS', KEYS[n + i]) == 0 then
      redis.call('XADD', KEYS[n + i], 'MAXLEN', '1', '*', 'w', '1')
    end
    redis.call('PEXPIRE', KEYS[n + i], ARGV[3])
  end
end
local reply = {count}
for i = 1, n do
  local last = redis.call('XREVRANGE', KEYS[n + i], '+', '-', 'COUNT', '1')
  if #last > 0 then reply[i + 1] = last[1][1] else reply[i + 1] = '0-0' end
end
return reply
