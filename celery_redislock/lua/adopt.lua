-- adopt.lua: move every lock a task owner holds to the process that runs the
-- task, in one step. A task owner ('task:<task id>') holds locks on behalf of
-- a task message while it travels through the broker, with a liveness of its
-- own; the process that starts the task adopts them, and from then on they
-- live and die with that process's owner like any lock it acquired.
--
-- KEYS (all in {ns}):
--   1 {ns}:held:<task owner>     the task owner's registry
--   2 {ns}:alive:<task owner>    the task owner's liveness key
--   3 {ns}:owners                the active-owners set
--   4 {ns}:held:<owner>          the adopting owner's registry
--   5 {ns}:alive:<owner>         the adopting owner's liveness key
--   6 {ns}:adopted:<task owner>  record of the adoption (hash: 'by' -> owner,
--                                new token -> '<modes>\n<res 1>\n<res 2>...')
--   7 {ns}:dead:<task owner>     the task owner's tombstone
--   8 (optional) {ns}:group:<id> the adopting owner's group hash, written on
--                                registration as acquire.lua does
-- Lock keys come from the task owner's registry; the request state, wake
-- lists, queues and {ns}:waits:<task owner> are built from ARGV[3], as are
-- a deferred task's park record {ns}:defer:<ARGV[10]>, {ns}:deferred and
-- {ns}:deadlines.
--
-- ARGV:
--   1 task owner id 'task:<task id>'
--   2 adopting owner id
--   3 key prefix '{ns}:'
--   4 adopting owner's liveness TTL in ms
--   5 value of the adopting owner's liveness key when registering (owner
--     description), '' when it is registered already
--   6 process tag for the group hash (only read when KEYS[8] is given)
--   7 TTL in ms of the tombstone and of the adoption record
--   8 queue scan limit
--   9 (optional) holder info 'task name\ntask id\nnode' to record for the
--     adopted grants (their holder record in the adopter's registry, after
--     the request id); '' or absent: the task owner's record, if any, moves
--     with the grant
--  10 (optional) a deferred task's id (docs/defer.md): its park record
--     decides whether this task owner's grants may be adopted; '' or
--     absent: no park record (a UniqueTask's key, a plain task owner)
--  11 (with 10) the token the park record must name (the task owner's
--     request, '<task owner>|task:<task id>')
--  12 (with 10) TTL in ms of the park record once adopted
--
-- Atomic steps:
--   1. The adopting owner's liveness, exactly as acquire.lua step 1
--      (registering: refused if tombstoned, else SET NX PX or PEXPIRE, and
--      the group entry; registered: PEXPIRE, a missing key refuses).
--   2. Idempotency: an adoption record exists. By this owner: reply its
--      grants again, each read back from its first lock hash (a grant
--      released since is left out). By another owner: reply so.
--   3. The task owner must be alive (its liveness key exists); otherwise
--      reply why not ('expired': no key; 'tombstoned': cleaned up). Its
--      locks are left to the usual reclaim (acquire, cleanup, reconcile).
--      With a park record (ARGV[10]): it must be 'parked' or 'granted' and
--      name token ARGV[11]; otherwise nothing is adopted ('superseded':
--      the task was withdrawn and parked again, or another copy runs it).
--   4. Move: for each resource of the task owner's registry (a hash of
--      resource names, see _common.lua), every field of the task owner is
--      rewritten to '<owner>|<same request id>' with the same value (mode
--      and fence), the resource joins the adopter's registry with the
--      grant's holder record as its value (ARGV[9] after the request id
--      when given, else the task owner's registry value, else the
--      {ns}:holder:<token> key an earlier release wrote, which is deleted),
--      and the old token's request state and wake list are deleted. The
--      task owner's queued requests, if any, leave their queues (their
--      waiters are woken).
--   5. Retire the task owner: DEL its registry, liveness and waits hash,
--      SREM it from the owners set, tombstone it (KEYS[7], PX ARGV[7]: a
--      late acquire for it is refused), write the adoption record (PX
--      ARGV[7]), SADD the adopter to the owners set. With a park record:
--      it becomes 'adopted' by the adopter (message dropped, PEXPIRE
--      ARGV[12]) and the task leaves {ns}:deferred and {ns}:deadlines, in
--      this same step, so
--      the upkeep never finds a grant whose task owner is gone in a record
--      still 'granted' (docs/defer.md, D8).
--
-- Reply:
--   {1, {token, fence, modes, res 1, ...}, ...}  adopted (or adopted earlier
--                by this owner): one entry per grant, fence a decimal string,
--                modes one char per resource, then the limits of its slots
--                as acquire.lua takes them ('xl:5')
--   {0, why, by} nothing adopted: why = 'expired' | 'tombstoned' |
--                'adopted' | 'superseded' (by = the owner that adopted
--                it, else '')
--   {-1}         the adopting owner's liveness is gone, or it is tombstoned

local task_owner, owner, prefix = ARGV[1], ARGV[2], ARGV[3]
local reg_ttl, tomb_ttl, limit = ARGV[4], ARGV[7], tonumber(ARGV[8])
local lock_prefix = prefix .. 'lock:'

-- The registry's layout is _common.lua's (registry_read, registry_add).
local function registry_locks()
  local out = {}
  for i, name in ipairs(registry_read(prefix, task_owner)) do out[i] = lock_prefix .. name end
  return out
end

-- 1. the adopter's liveness
if ARGV[5] ~= '' then
  if redis.call('EXISTS', prefix .. 'dead:' .. owner) == 1 then return {-1} end
  if not redis.call('SET', KEYS[5], ARGV[5], 'NX', 'PX', reg_ttl) then
    redis.call('PEXPIRE', KEYS[5], reg_ttl)
  end
  if KEYS[8] then redis.call('HSET', KEYS[8], owner, ARGV[6]) end
elseif redis.call('PEXPIRE', KEYS[5], reg_ttl) == 0 then
  return {-1}
end

-- Grant entry of the reply for one new token, read from its lock hashes.
local function grant_of(token, shape)
  local cut = string.find(shape, '\n', 1, true)
  if not cut then return nil end
  local modes, names = string.sub(shape, 1, cut - 1), split_names(string.sub(shape, cut + 1))
  local v = redis.call('HGET', lock_prefix .. names[1], token)
  if not v then return nil end
  local entry = {token, fence_of(v), modes}
  for i = 1, #names do entry[#entry + 1] = names[i] end
  return entry
end

-- 2. idempotency
local by = redis.call('HGET', KEYS[6], 'by')
if by then
  if by ~= owner then return {0, 'adopted', by} end
  local out = {1}
  local kv = redis.call('HGETALL', KEYS[6])
  for j = 1, #kv, 2 do
    if kv[j] ~= 'by' then
      local entry = grant_of(kv[j], kv[j + 1])
      if entry then out[#out + 1] = entry end
    end
  end
  return out
end

-- 3. the task owner must be alive
if redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('EXISTS', KEYS[7]) == 1 then return {0, 'tombstoned', ''} end
  return {0, 'expired', ''}
end
local tid = ARGV[10]
local rec = nil
if tid and tid ~= '' then
  rec = prefix .. 'defer:' .. tid
  local st = redis.call('HMGET', rec, 'state', 'token')
  if (st[1] ~= 'parked' and st[1] ~= 'granted') or st[2] ~= ARGV[11] then
    return {0, 'superseded', ''}
  end
end

-- 4. move
-- The task owner's holder record of resource NAME (its registry value, in
-- the main hash or in the name's bucket), or nil.
local function record_of(name)
  local held = prefix .. 'held:' .. task_owner
  local v = redis.call('HGET', held, name)
  if not v or v == '' then
    local _, bucket = reg_buckets({name})
    v = redis.call('HGET', held .. '|' .. bucket[1], name)
  end
  if v == '' then return nil end
  return v
end

local p = task_owner .. '|'
local grants, order = {}, {} -- old token -> {fence, modes, names}
for _, lock in ipairs(registry_locks()) do
  if string.sub(lock, 1, #lock_prefix) == lock_prefix then
    local name = string.sub(lock, #lock_prefix + 1)
    local kv = redis.call('HGETALL', lock)
    local record = nil
    for j = 1, #kv, 2 do
      local t, v = kv[j], kv[j + 1]
      if string.sub(t, 1, #p) == p then
        local rid = string.sub(t, #p + 1)
        local new = owner .. '|' .. rid
        redis.call('HDEL', lock, t)
        redis.call('HSET', lock, new, v)
        -- The request id is kept, so the record still names the grant:
        -- the new info, else the task owner's record, else the record key
        -- an earlier release wrote (which goes with the old token's keys).
        if ARGV[9] and ARGV[9] ~= '' then
          record = rid .. '\n' .. ARGV[9]
        else
          record = record_of(name)
          if not record then
            local old = redis.call('GET', prefix .. 'holder:' .. t)
            if old then record = rid .. '\n' .. old end
          end
        end
        redis.call('DEL', prefix .. 'req:' .. t, prefix .. 'wake:' .. t, prefix .. 'holder:' .. t)
        local g = grants[new]
        if not g then
          g = {fence_of(v), {}, {}, {}}
          grants[new] = g
          order[#order + 1] = new
        end
        g[2][#g[2] + 1] = mode_of(v)
        g[3][#g[3] + 1] = name
        -- a slot's value carries its limit (_common.lua Encodings)
        local cap = string.match(v, ':(%d+)$')
        if cap then g[4][#g[4] + 1] = cap end
      end
    end
    registry_add(prefix, owner, {name}, false, record)
  end
end
local waits = prefix .. 'waits:' .. task_owner
for _, t in ipairs(redis.call('HKEYS', waits)) do
  for _, q in ipairs(drop_request(prefix, t)) do
    wake_front(prefix, q, lock_prefix .. string.sub(q, #prefix + 3), limit, tomb_ttl)
  end
end

-- 5. retire the task owner, record the adoption
registry_drop(prefix, task_owner)
redis.call('DEL', KEYS[2], waits)
redis.call('SREM', KEYS[3], task_owner)
redis.call('SET', KEYS[7], '1', 'PX', tomb_ttl)
local out = {1}
redis.call('HSET', KEYS[6], 'by', owner)
for _, new in ipairs(order) do
  local g = grants[new]
  local modes = table.concat(g[2])
  if #g[4] > 0 then modes = modes .. ':' .. table.concat(g[4], ',') end
  redis.call('HSET', KEYS[6], new, modes .. '\n' .. table.concat(g[3], '\n'))
  local entry = {new, g[1], modes}
  for i = 1, #g[3] do entry[#entry + 1] = g[3][i] end
  out[#out + 1] = entry
end
redis.call('PEXPIRE', KEYS[6], tomb_ttl)
if #order > 0 then redis.call('SADD', KEYS[3], owner) end
if rec then
  redis.call('HDEL', rec, 'msg')
  redis.call('HSET', rec, 'state', 'adopted', 'owner', owner)
  redis.call('PEXPIRE', rec, ARGV[12])
  redis.call('ZREM', prefix .. 'deferred', tid)
  redis.call('ZREM', prefix .. 'deadlines', tid)
end
return out
