-- cleanup_owner.lua: free every lock a dead owner still holds, walking only
-- that owner's registry (never the keyspace).
--
-- KEYS (all in {ns}):
--   1 {ns}:held:<owner>   the owner's registry (hash: resource name -> '';
--                         its bucket index and buckets, if it spilled, are
--                         built from it: _common.lua registry_read)
--   2 {ns}:alive:<owner>  the owner's liveness key
--   3 {ns}:owners         the active-owners set
-- Lock keys {ns}:lock:<res> are built from ARGV[2] and the resource names
-- in the registry, as are queue, request, waits ({ns}:waits:<owner>),
-- contended keys and the owner's tombstone {ns}:dead:<owner>: a name is
-- only ever a key's suffix, so every key stays in {ns}.
--
-- ARGV:
--   1 owner id
--   2 key prefix '{ns}:'
--   3 '1' to force: the caller proved the owner dead by other means (its
--     process is gone, or its node was evicted); its liveness key is deleted
--     first so that the owner, if it is somehow still running, fences itself
--   4 request TTL in ms (wake lists, the lost list and the tombstone)
--   5 queue scan limit
--   6 (optional) '1' when the owner cleans itself up (LockManager.close: it
--     holds nothing and its identity is retired): no tombstone, no lost push
--   7 (optional) why, stored as the tombstone's value and pushed to the lost
--     list so the owner can say who freed its locks: 'operator' (the CLI's
--     release) or 'dead' (default: its worker, reconcile). A tombstone that
--     exists already keeps its value (the first cleanup's reason), which is
--     what is pushed
--
-- Atomic steps: refuse a live owner unless forced; tombstone the owner
-- ({ns}:dead:<owner>, TTL ARGV[4]: acquire.lua refuses to register it again,
-- so a request of it still in flight cannot revive it) and push to
-- {ns}:lost:<owner> (built from ARGV[2]) so a still-running owner learns it
-- is dead (neither when ARGV[6] = '1'); remove every queued request of the
-- owner (its waits hash names each one's resources) from every queue it
-- joined, with its request state and wake list, then delete the waits hash;
-- then, in two passes over the resources in the registry: first, a
-- missing lock key is dropped from the registry (nothing held), a hash has
-- every field of this owner deleted with its request state, wake list and
-- any holder record key an earlier release wrote ({ns}:holder:<token>; a
-- holder record is now a registry value), and its contended stream deleted when
-- no holder is left, and a key of any other type is kept and reported (by
-- its lock key); second, the waiters of each freed lock are woken
-- (wake_front) and the resource leaves the registry. Every lock of the
-- owner is free before any waiter is served, so a hand-off never meets
-- (and reclaims) the owner's other grants, and 'released' counts them all.
-- A failing key is reported and kept; the others go on. Last, the waiters
-- of every other queue that lost an entry of the owner are woken.
-- An owner with an empty registry and no queued request left leaves the
-- owners set (its registry's keys are deleted).
--
-- Reply: {status, released, skipped, errors, remaining, reclaimed}
--   status  'alive' (nothing done) | 'cleaned' (owner gone from the owners
--           set) | 'partial' (some keys kept, or some queued requests not
--           removed: see skipped and errors)
--   released  number of lock grants freed
--   skipped   {key, type, ...} pairs of keys of an unexpected type
--   errors    {key, message, ...} pairs of keys whose cleanup failed
--   remaining registry size afterwards
--   reclaimed grants of other dead owners freed while serving this owner's
--             waiters (wake_front reclaims dead holders ahead of an
--             exclusive head): counted here, since their own cleanup will
--             find them gone

local owner, prefix = ARGV[1], ARGV[2]
local force = ARGV[3] == '1'
local req_ttl, limit = ARGV[4], tonumber(ARGV[5])

if redis.call('EXISTS', KEYS[2]) == 1 then
  if not force then
    local names = registry_read(prefix, owner)
    return {'alive', 0, {}, {}, #names, 0}
  end
  redis.call('DEL', KEYS[2])
end

-- Tell the owner, should it still run (a stalled or force-cleaned process
-- whose liveness someone else refreshes), that it is dead: a watcher thread
-- of that process BLPOPs this list and marks its leases lost.
if ARGV[6] ~= '1' then
  local why = ARGV[7] or 'dead'
  if why == '' then why = 'dead' end
  local tomb = prefix .. 'dead:' .. owner
  if not redis.call('SET', tomb, why, 'NX', 'PX', req_ttl) then
    -- cleaned before (e.g. an operator's release, then its worker's tick):
    -- the first reason stands, so the owner is told who really freed it
    why = redis.call('GET', tomb) or why
    redis.call('PEXPIRE', tomb, req_ttl)
  end
  local lost = prefix .. 'lost:' .. owner
  redis.call('LPUSH', lost, why)
  redis.call('LTRIM', lost, '0', '0')
  redis.call('PEXPIRE', lost, req_ttl)
end

local lock_prefix = prefix .. 'lock:'
local p = owner .. '|'
local released = 0
local skipped, errors = {}, {}
local to_wake, wake_order = {}, {} -- queue key -> lock key, in the order met
local woken = {}

-- Queued requests first, so that the freed locks below are not served to
-- the owner's own entries.
local waits = prefix .. 'waits:' .. owner
local queued = redis.call('HKEYS', waits)
for _, t in ipairs(queued) do
  local ok, res = pcall(drop_request, prefix, t)
  if ok then
    for _, q in ipairs(res) do
      if not to_wake[q] then
        to_wake[q] = lock_prefix .. string.sub(q, #prefix + 3)
        wake_order[#wake_order + 1] = q
      end
    end
  else
    if type(res) == 'table' then res = res.err or res['err'] end
    errors[#errors + 1] = waits
    errors[#errors + 1] = tostring(res)
  end
end
if #errors == 0 then redis.call('DEL', waits) end

local names, spilled = registry_read(prefix, owner)

-- Pass 1: free the owner's grants in one lock ('freed'), or say why not.
local function free_one(name)
  local lock = lock_prefix .. name
  local t = redis.call('TYPE', lock)['ok']
  if t == 'none' then
    registry_del(prefix, owner, {name}, spilled)
    return 'gone'
  end
  if t ~= 'hash' then
    return 'skip', t
  end
  for _, f in ipairs(redis.call('HKEYS', lock)) do
    if string.sub(f, 1, #p) == p then
      redis.call('HDEL', lock, f)
      redis.call('DEL', prefix .. 'req:' .. f, prefix .. 'wake:' .. f, prefix .. 'holder:' .. f)
      released = released + 1
    end
  end
  if redis.call('HLEN', lock) == 0 then
    redis.call('DEL', prefix .. 'contended:' .. name)
  end
  return 'freed'
end

-- Pass 2: serve the waiters of a freed lock; only then does it leave the
-- registry.
local function serve_one(name)
  local q = prefix .. 'q:' .. name
  woken[q] = true
  wake_front(prefix, q, lock_prefix .. name, limit, req_ttl)
  registry_del(prefix, owner, {name}, spilled)
end

local function failed(key, res)
  if type(res) == 'table' then res = res.err or res['err'] end
  errors[#errors + 1] = key
  errors[#errors + 1] = tostring(res)
end

local freed = {}
for _, name in ipairs(names) do
  local ok, res, detail = pcall(free_one, name)
  if not ok then
    failed(lock_prefix .. name, res)
  elseif res == 'skip' then
    skipped[#skipped + 1] = lock_prefix .. name
    skipped[#skipped + 1] = detail
  elseif res == 'freed' then
    freed[#freed + 1] = name
  end
end
for _, name in ipairs(freed) do
  local ok, res = pcall(serve_one, name)
  if not ok then failed(lock_prefix .. name, res) end
end

-- Queues that lost an entry of the owner but whose lock it did not hold.
for _, q in ipairs(wake_order) do
  if not woken[q] then
    local ok, res = pcall(wake_front, prefix, q, to_wake[q], limit, req_ttl)
    if not ok then
      if type(res) == 'table' then res = res.err or res['err'] end
      errors[#errors + 1] = q
      errors[#errors + 1] = tostring(res)
    end
  end
end

local remaining = #registry_read(prefix, owner)
local status = 'partial'
if remaining == 0 then registry_drop(prefix, owner) end
if remaining == 0 and redis.call('EXISTS', waits) == 0 then
  redis.call('SREM', KEYS[3], owner)
  status = 'cleaned'
end
return {status, released, skipped, errors, remaining, serve_reclaimed}
