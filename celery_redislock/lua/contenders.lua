-- contenders.lua: how many other requests wait for any of a lease's resources.
--
-- KEYS: 1..n  {ns}:q:<res>  the lease's wait queues
-- ARGV: 1 the lease's token; 2 scan limit (entries looked at per queue)
--
-- Atomic steps: read the head of each queue, count distinct tokens other
-- than the lease's own (a request waiting for two of the lease's resources
-- counts once). Dead entries are counted until a script removes them.
-- Reply: count (integer), at most n * limit.

local token, limit = ARGV[1], tonumber(ARGV[2])
local seen, count = {}, 0
for i = 1, #KEYS do
  for _, m in ipairs(redis.call('ZRANGE', KEYS[i], '0', int(limit - 1))) do
    local t = string.sub(m, 2)
    if t ~= token and not seen[t] then
      seen[t] = true
      count = count + 1
    end
  end
end
return count
