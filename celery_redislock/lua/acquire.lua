-- acquire.lua: try to take every lock of one request at once, in FIFO order.
--
-- KEYS (all in the namespace's hash tag {ns}):
--   1..n     {ns}:lock:<res>     lock hashes, one per resource
--   n+1      (optional) {ns}:group:<id>  hash owner -> process tag of a
--            group of owners (a Celery worker incarnation), written on
--            registration
-- Every other key is built from the prefix ARGV[5], the token and the
-- resource names, and stays in the same hash tag (one argument per key
-- costs the caller more than building it here): {ns}:fence (fencing
-- counter), {ns}:seq (arrival counter), {ns}:owners (owners that may hold
-- or wait for locks), this owner's {ns}:held:<owner> (registry: resource
-- name -> ''; with flag 's' its bucket index {ns}:held:<owner>| and buckets
-- {ns}:held:<owner>|<b>), {ns}:alive:<owner> (liveness, TTL), {ns}:waits:<owner> and
-- tombstone {ns}:dead:<owner>, this request's {ns}:req:<token> (state
-- while it queues: state 'q', seq, modes, res, nested, what a hand-off
-- needs) and {ns}:wake:<token> (wake list), the wait queues {ns}:q:<res>
-- (zsets, same order as KEYS), the resources' {ns}:contended:<res>
-- streams, and the keys read from locks and queues (other owners' alive,
-- req, wake, waits and held keys); {ns}:format is written (SET NX) when
-- the grant creates the fence (_common.lua next_fence).
--
-- ARGV:
--   1 token '<owner>|<request id>' (unique per acquisition; the owner id is
--     read from it)
--   2 modes: one char per resource, 'x' exclusive, 's' shared or 'l' one
--     slot of a limited resource, then, with an 'l', ':' and each limited
--     resource's limit in order, ',' separated ('xl:5'; _common.lua
--     Encodings)
--   3 flags, any of: 'q' join the wait queue when blocked (else try once),
--     'n' a nested request (waits only for holders, queued first), 'l' this
--     owner is in {ns}:owners already (an earlier grant or queued request
--     of it added it, and only the cleanup that declares it dead or
--     retires it takes it out: the SADD is skipped), 's' this owner holds
--     many locks: the resource names go to its registry's buckets
--     (_common.lua registry_add; one more HSET, for the bucket index),
--     'f' the first send of this token (the client made it and never sent
--     it: it has no grant and no request state, so step 3 reads nothing;
--     a resend of the call never carries 'f')
--   4 liveness TTL in ms (every attempt refreshes the owner's liveness)
--   5 key prefix '{ns}:'
--   6 request TTL in ms (queued request state, wake list)
--   7 queue scan limit (entries looked at per queue)
--   8 (optional) value of the liveness key when registering (owner
--     description); '' or absent when the owner is registered already
--   9 (optional) process tag recorded in the group hash: '<pid>.<starttime>'
--     (field 22 of /proc/<pid>/stat, so a reused pid does not match), or
--     '<pid>' where /proc is unavailable (only read with KEYS[n+1])
--  10 (optional) holder record '<request id>\ntask name\ntask id\nnode'
--     when a Celery task acquires (the request id is the token's, after
--     '|'); '' or absent otherwise. It is the value of the resource names
--     in the owner's registry (a plain engine lock writes '')
--
-- Atomic steps:
--   1. Liveness. Registering (ARGV[8] not ''): an owner with a tombstone
--      (cleaned up: declared dead) is refused, {-1}; else SET NX PX, or
--      PEXPIRE when the key exists (another request registered it), and the
--      group entry. Registered: PEXPIRE; a missing key means this owner was
--      declared dead (or Redis lost it): reply {-1}. Never re-creates a key
--      that existed: a dead owner stays dead.
--   2. Uncontended: when no lock hash and no queue of the request's
--      resources exists (one EXISTS), nobody holds or waits for them and
--      this token is neither granted nor queued (a grant or a queue entry
--      of it would exist): grant at once as in step 6 (no queue to leave,
--      no request state or wake list to delete, nobody to wake), reply
--      {1, fence, 0}.
--   3. Idempotency (skipped with flag 'f'): a request already granted (its
--      token is in its first lock hash: grants are all or nothing) replies
--      its grant again, with the fence stored there.
--   4. Holders (_common.lua reclaim_holders): conflicting holders are read
--      until the first live one; one whose owner is dead is reclaimed (token
--      removed from the lock, its request state and wake list deleted, and,
--      if it was the owner's last token there, the resource removed from
--      that owner's registry); the live one blocks, and the resource's
--      contended stream, if a holder watches it (wait_for_contender), gets
--      an entry. A blocking task owner's park record is read: a grant in
--      transit is named in the reply. A limited resource ('l'; its own
--      limit from ARGV[2]) blocks while its limit or more live holders hold
--      it (_common.lua reclaim_slots: one HLEN while a slot is free, else
--      the holders' liveness, dead ones freed, bounded by ARGV[7]).
--   5. Queue (not for nested requests): earlier entries are read in pages.
--      One that conflicts blocks, unless its owner is dead or its state has
--      expired, in which case the request is removed from every queue
--      (_common.lua drop_entry). Compatible entries are checked only when
--      they fill the window while nothing blocks; dead ones are then removed
--      the same way and the scan reads on. Removed entries do not count
--      against ARGV[7], which bounds the live entries looked at (past it:
--      blocked, conservatively); at most 4 x ARGV[7] are removed per queue
--      (past it: blocked with wait_ms 0, to run again at once). On a
--      limited resource every live entry ahead takes a slot first: the
--      request is blocked unless its live holders, the live entries ahead
--      and itself are at most its own limit (scan_slots).
--      A resource held or queued for in the other kind (limited against
--      exclusive or shared) ends the script: reply {-2, name, mode}. A
--      nested request passes the queue but reads its head entry (one
--      ZRANGE per resource): every entry of a queue is of one kind, so the
--      head tells it, and the other kind is refused the same way.
--   6. Not blocked: grant every lock (token -> mode and fence), add the
--      resource names to the registry (one HSET; its buckets with flag 's'),
--      each with the holder record (ARGV[10]) or '' as its value, SADD the
--      owner to {ns}:owners (unless flag 'l'), leave the queues and the
--      owner's waits hash, delete the request's state and wake list (a
--      granted request needs neither: a retry finds its grant in step 3),
--      wake whoever can follow (wake_front: this also carries on a wake-up
--      that a release's budget stopped).
--   7. Blocked: join the queues once (flag 'q'), keyed by the token,
--      record the request (modes, resource names, nested, holder record
--      when given) in its state so a release can hand it the locks
--      (_common.lua try_handoff, which writes the holder record into the
--      registry), and in the owner's waits hash so its cleanup finds every
--      entry.
--
-- Reply:
--   {1, fence, reclaimed}
--                      granted by this call (steps 2 and 6; the fence is a
--                      decimal string): the request has no state, wake list
--                      or queue entry left
--   {1, fence}         granted earlier (step 3: same fence); a hand-off's
--                      grant keeps its request state and wake list until
--                      release.lua deletes them
--   {0, wait_ms, why, reclaimed, transit}
--                      blocked; wait_ms = soonest a blocking owner's liveness
--                      runs out (-1 if unknown); why = 'held' | 'queued';
--                      transit = the task id of a grant in transit (a
--                      parked task's grant not adopted yet: _common.lua
--                      transit_task) that step 4 met as a live conflicting
--                      holder, else '' (docs/defer.md, T1)
--   reclaimed = dead holders' grants step 4 freed (for the metrics)
--   {-1}               this owner's liveness is gone, or it is tombstoned:
--                      use a new identity
--   {-2, name, mode}   resource NAME is held or queued for as MODE ('x',
--                      's' or 'l'), which this request's mode for it may not
--                      meet (limited against exclusive or shared): this
--                      call granted and queued nothing

local prefix = ARGV[5]
local token, modes, flags = ARGV[1], ARGV[2], ARGV[3]
local owner = owner_of(token)
local known = string.find(flags, 'l', 1, true) ~= nil
local spill = string.find(flags, 's', 1, true) ~= nil
local reg_ttl = ARGV[4]
local register, holder = ARGV[8] or '', ARGV[10] or ''
-- (_common.lua mode_count, inline: the fast path makes no closure for it)
local colon = string.find(modes, ':', 1, true)
local n = colon and colon - 1 or #modes
local alive_key = prefix .. 'alive:' .. owner
-- probe: the lock keys, then their queues (probe[n + i] is lock i's queue)
local names, probe = {}, {}
for i = 1, n do
  local name = name_of(prefix, KEYS[i])
  names[i] = name
  probe[i] = KEYS[i]
  probe[n + i] = prefix .. 'q:' .. name
end

-- 1. liveness
if register ~= '' then
  if redis.call('EXISTS', prefix .. 'dead:' .. owner) == 1 then return {-1} end
  if not redis.call('SET', alive_key, register, 'NX', 'PX', reg_ttl) then
    redis.call('PEXPIRE', alive_key, reg_ttl)
  end
  if #KEYS > n then
    redis.call('HSET', KEYS[n + 1], owner, ARGV[9] or '')
  end
elseif redis.call('PEXPIRE', alive_key, reg_ttl) == 0 then
  return {-1}
end

-- 2. uncontended: no lock hash and no queue of any resource exists, so
-- nobody holds or waits and this token is neither granted nor queued.
if redis.call('EXISTS', unpack(probe)) == 0 then
  local fence = next_fence(prefix .. 'fence')
  -- a slot's value carries its limit (_common.lua Encodings)
  local nums = colon and string.gmatch(string.sub(modes, colon + 1), '%d+')
  for i = 1, n do
    local mode = string.sub(modes, i, i)
    local v = mode .. fence
    if mode == 'l' then v = v .. ':' .. nums() end
    redis.call('HSET', KEYS[i], token, v)
  end
  registry_add(prefix, owner, names, spill, holder)
  if not known then redis.call('SADD', prefix .. 'owners', owner) end
  return {1, fence, 0}
end

-- @helpers

-- What only the paths below need (each string.find is a C call).
local want_queue = string.find(flags, 'q', 1, true) ~= nil
local nested = string.find(flags, 'n', 1, true) ~= nil
local first = string.find(flags, 'f', 1, true) ~= nil
local req_ttl, limit = ARGV[6], tonumber(ARGV[7])
local req_key, wake_key = prefix .. 'req:' .. token, prefix .. 'wake:' .. token

-- 3. idempotency (a token's first send has nothing to find)
local state, queued = nil, false
if not first then
  local granted = redis.call('HGET', KEYS[1], token)
  if granted then return {1, fence_of(granted)} end
  state = redis.call('HMGET', req_key, 'state', 'seq')
  queued = state[1] == 'q'
end

-- A limited request's limits (resource index -> its own limit)
local caps = {}
if colon then caps = limits_of(modes) end
local live_held = {} -- resource index -> live holders of a limited lock

local blocked, why = false, 'held'
local wait_ms = -1
local function note_wait(ms)
  if ms >= 0 and (wait_ms < 0 or ms < wait_ms) then wait_ms = ms end
end
local rewake = {}
local reclaimed = 0
local transit = ''

-- 4. holders
for i = 1, n do
  local lock, mode = KEYS[i], string.sub(modes, i, i)
  local ms, freed, by, other
  if mode == 'l' then
    local live
    ms, freed, by, live, other = reclaim_slots(prefix, lock, caps[i], limit)
    live_held[i] = live
  else
    ms, freed, by, other = reclaim_holders(prefix, lock, mode, limit)
  end
  if other then return {-2, names[i], other} end
  if freed > 0 then
    rewake[i] = true
    reclaimed = reclaimed + freed
  end
  if ms ~= nil then
    blocked = true
    note_wait(ms)
    contended(prefix, lock)
    -- A grant in transit blocks: a waiting task may give its slot up.
    if transit == '' and by then transit = transit_task(prefix, by) or '' end
  end
end

-- 5. queue
local function entry_dead(t)
  local ms = owner_pttl(prefix, owner_of(t))
  return ms < 0 or redis.call('EXISTS', prefix .. 'req:' .. t) == 0, ms
end
-- A limited resource: the live entries ahead take slots before this
-- request; it fits while its live holders, the entries ahead and itself are
-- at most its limit. Step 4 counted the holders with HLEN when they were
-- fewer than the limit, dead ones included: once the entries ahead would
-- block, their liveness is read (reclaim_slots with CHECK, once), dead
-- ones are freed, and the room is counted again, so a dead holder never
-- keeps a request out of a slot it may have. Returns the mode of an entry
-- that is not limited (the name is queued for otherwise), else nil.
local function scan_slots(i, q, max, budget)
  local room = caps[i] - (live_held[i] or 0) - 1
  if room < 0 then return nil end -- the holders block it (step 4 read them)
  local checked = (live_held[i] or 0) == 0
  local ahead, purged, cursor = 0, 0, '-inf'
  while true do
    local want = math.min(room + 1, limit) - ahead
    local page = redis.call('ZRANGEBYSCORE', q, cursor, max, 'WITHSCORES', 'LIMIT', '0', int(want))
    for j = 1, #page, 2 do
      local m = page[j]
      cursor = '(' .. page[j + 1]
      if string.sub(m, 1, 1) ~= 'l' then return string.sub(m, 1, 1) end
      local t = string.sub(m, 2)
      if t ~= token then
        local dead, ms = entry_dead(t)
        if dead then
          drop_entry(prefix, q, m)
          rewake[i] = true
          purged = purged + 1
          if purged >= budget then
            blocked, why = true, 'queued'
            note_wait(0)
            return nil
          end
        else
          ahead = ahead + 1
          if ahead > room and not checked then
            checked = true
            local _, freed, _, live = reclaim_slots(prefix, KEYS[i], caps[i], limit, true)
            if freed > 0 then
              rewake[i] = true
              reclaimed = reclaimed + freed
            end
            live_held[i] = live
            room = caps[i] - live - 1
          end
          if ahead > room or ahead >= limit then
            blocked, why = true, 'queued'
            note_wait(ms)
            return nil
          end
        end
      end
    end
    if #page < 2 * want then return nil end
  end
end
if not nested then
  local max = '+inf'
  if queued then max = '(' .. state[2] end
  local budget = purge_budget(limit)
  for i = 1, n do
    local q, mode = probe[n + i], string.sub(modes, i, i)
    if mode == 'l' then
      local other = scan_slots(i, q, max, budget)
      if other then return {-2, names[i], other} end
    end
    local kept, purged, cursor, stop = 0, 0, '-inf', mode == 'l'
    local unchecked = {} -- compatible entries kept without a liveness check
    local function purge(m)
      drop_entry(prefix, q, m)
      rewake[i] = true
      purged = purged + 1
      if purged >= budget then
        -- more dead entries than one call removes: run again at once
        blocked, why, stop = true, 'queued', true
        note_wait(0)
      end
    end
    while not stop do
      local want = limit - kept
      local page = redis.call('ZRANGEBYSCORE', q, cursor, max, 'WITHSCORES', 'LIMIT', '0', int(want))
      for j = 1, #page, 2 do
        local m = page[j]
        cursor = '(' .. page[j + 1]
        local t = string.sub(m, 2)
        if string.sub(m, 1, 1) == 'l' then return {-2, names[i], 'l'} end
        if t == token then
          kept = kept + 1
        elseif not conflicts(mode, string.sub(m, 1, 1)) then
          kept = kept + 1
          unchecked[#unchecked + 1] = m
        else
          local dead, ms = entry_dead(t)
          if not dead then
            blocked, why, stop = true, 'queued', true
            note_wait(ms)
          else
            purge(m)
          end
          if stop then break end
        end
      end
      if not stop then
        if #page < 2 * want then
          stop = true
        elseif kept >= limit and not blocked then
          -- The window is full of compatible entries: dead ones among them
          -- must not keep us behind the rest. Check them (once) and read on.
          for _, m in ipairs(unchecked) do
            if entry_dead(string.sub(m, 2)) then
              kept = kept - 1
              purge(m)
              if stop then break end
            end
          end
          unchecked = {}
          if not stop and kept >= limit then
            -- LIMIT live earlier entries looked at: stay behind the rest
            blocked, why, stop = true, 'queued', true
          end
        elseif kept >= limit then
          stop = true
        end
      end
    end
  end
else
  -- A nested request waits only for holders, but never of the other kind
  -- than the queue's: granted next to waiters of the other kind, it would
  -- leave a hand-off to serve them both kinds at once.
  for i = 1, n do
    local head = redis.call('ZRANGE', probe[n + i], '0', '0')[1]
    if head and mixed(string.sub(modes, i, i), string.sub(head, 1, 1)) then
      return {-2, names[i], string.sub(head, 1, 1)}
    end
  end
end

if not blocked then
  -- 6. grant
  local fence = next_fence(prefix .. 'fence')
  for i = 1, n do
    local lock, mode = KEYS[i], string.sub(modes, i, i)
    local v = mode .. fence
    if mode == 'l' then v = v .. ':' .. int(caps[i]) end
    redis.call('HSET', lock, token, v)
    if queued then
      redis.call('ZREM', probe[n + i], mode .. token)
      rewake[i] = true
    end
  end
  registry_add(prefix, owner, names, spill, holder)
  if queued then redis.call('HDEL', prefix .. 'waits:' .. owner, token) end
  if not known then redis.call('SADD', prefix .. 'owners', owner) end
  redis.call('DEL', wake_key, req_key)
  for i, _ in pairs(rewake) do
    wake_front(prefix, probe[n + i], KEYS[i], limit, req_ttl)
  end
  return {1, fence, reclaimed}
end

-- 7. blocked
for i, _ in pairs(rewake) do
  wake_front(prefix, probe[n + i], KEYS[i], limit, req_ttl)
end
if want_queue then
  if not queued then
    local seq = redis.call('INCR', prefix .. 'seq')
    if nested then seq = seq - 1e15 end
    for i = 1, n do
      local mode = string.sub(modes, i, i)
      redis.call('ZADD', probe[n + i], int(seq), mode .. token)
    end
    local res = table.concat(names, '\n')
    redis.call('HSET', req_key, 'state', 'q', 'seq', int(seq),
      'modes', modes, 'res', res, 'nested', nested and '1' or '0')
    if holder ~= '' then
      redis.call('HSET', req_key, 'holder', holder)
    end
    redis.call('HSET', prefix .. 'waits:' .. owner, token, modes .. '\n' .. res)
    if not known then redis.call('SADD', prefix .. 'owners', owner) end
  end
  redis.call('PEXPIRE', req_key, req_ttl)
end
return {0, wait_ms, why, reclaimed, transit}
