-- forget_idle.lua: forget a task owner that an acquire registered but that
-- holds nothing (its try was refused), so a duplicate enqueue leaves no
-- liveness key behind for the task's whole unique_ttl.
--
-- KEYS (all in {ns}):
--   1 {ns}:held:<owner>   the owner's registry
--   2 {ns}:waits:<owner>  the owner's queued requests
--   3 {ns}:alive:<owner>  the owner's liveness key
-- ARGV: none.
--
-- Atomic steps: if the owner has no registry and no queued request (it
-- holds and waits for nothing), delete its liveness key. An owner granted
-- meanwhile (by another call for the same task) has a registry and is left
-- alone. No tombstone: the owner never held anything, and a later acquire
-- for the same task may register it again.
--
-- Reply: 1 when the liveness key was deleted, else 0.

if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
return redis.call('DEL', KEYS[3])
