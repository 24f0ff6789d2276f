-- node_stop.lua: a worker incarnation's final shutdown step.
--
-- KEYS (in {ns}):
--   1 {ns}:node:<nodename>  node record (hash)
--   2 {ns}:group:<inc>      our group: owner id -> process tag
--
-- ARGV:
--   1 our incarnation id
--
-- Atomic steps: delete the node record only if it is still ours (a
-- successor's record is never touched); read our group's owners.
--
-- Reply: {deleted (0|1), {owner...}}

local deleted = 0
if redis.call('HGET', KEYS[1], 'inc') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  deleted = 1
end
return {deleted, redis.call('HKEYS', KEYS[2])}
