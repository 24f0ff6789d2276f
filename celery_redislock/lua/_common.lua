-- _common.lua: helpers for the scripts. celery_redislock/scripts.py puts
-- in front of each script only the helpers it names (and those they name),
-- in this file's order: a helper is a closure Lua makes on every call. Where
-- a script has a '-- @helpers' line, the helpers its code above that line
-- (its fast path) does not name go there instead.
-- Not a script of its own. Every key these helpers build is
-- PREFIX .. kind .. ':' .. id, where PREFIX is '{namespace}:' (hash tag
-- included), so a key read from a lock, a queue or a registry stays in the
-- namespace's slot (Redis Cluster safe). Each script names such keys in its
-- header.
--
-- Encodings:
--   token        '<owner>|<request id>'   (one acquisition; owner ids never contain '|')
--   lock hash    field token -> '<mode><fence>': 'x' (exclusive), 's'
--                (shared) or 'l' (one slot of a limited resource), then the
--                grant's fencing token in decimal, e.g. 'x1764456000123456';
--                a slot then has ':' and the limit its request asked for
--                ('l1764456000123456:5', for operators). mode_of() reads the
--                mode, fence_of() the fencing token. The holders of one lock are one
--                'x', or all 's', or all 'l' (a name is never taken both
--                limited and exclusive or shared: the scripts refuse it)
--   modes        a request's modes: one char per resource ('x', 's', 'l'),
--                then, when a resource is 'l', ':' and the limit of each
--                'l' resource in order, ',' separated ('xl:5', 'll:3,8');
--                mode_count() and limits_of() read it. Stored as it came
--                in the request state, the waits hash and a park record
--   registry     {ns}:held:<owner>: a hash, field = resource name (not the
--                lock key) -> '' for every lock the owner holds a token in,
--                or, for a grant a Celery task took, its holder record
--                '<request id>\ntask name\ntask id\nnode' (the request id
--                names the one token of the owner the record is about)
--                (a hash of up to 128 short fields is a compact listpack or
--                ziplist; before Redis 7.2 a set of strings never is). An
--                owner holding many locks spills: its client asks for it
--                (acquire.lua ARGV[13]) once the owner holds 64 grants
--                (manager.REGISTRY_SPILL_AT), and further names go to bucket hashes
--                {ns}:held:<owner>|<b> (b = the name's bucket, '0'..'63', reg_buckets;
--                owner ids never contain '|'), which the bucket index
--                {ns}:held:<owner>| (hash: b -> '') lists, so every hash
--                stays a listpack up to about 8,000 locks. See the registry
--                helpers below.
--   queue zset   member '<mode><token>', score = arrival sequence
--                (nested requests: sequence - 1e15, so they sort first)
--   waits hash   {ns}:waits:<owner>: token -> '<modes>\n<res 1>\n<res 2>...'
--                for each queued request of the owner (what cleanup_owner
--                needs to find its entries in every queue)
--   contended    {ns}:contended:<res>: a stream of at most one entry that
--                exists only while a holder of <res> waits in
--                lease.wait_for_contender() (contenders.lua creates it, with
--                a TTL); added to when a live holder of <res> blocks a
--                request, which wakes every holder reading it. A contended
--                resource that no holder watches costs no memory (a stream
--                node is about 4.7 KB)
--
-- Budgets: a scan of a queue (or of a lock's holders) looks at no more than
-- LIMIT live entries (queue_scan_limit) and removes no more than
-- purge_budget(LIMIT) dead ones: removing a dead entry costs O(1) commands
-- and does not use up the scan limit, so dead entries never make a request
-- stay behind a free lock, and each call's work stays bounded.
--
-- Arguments to redis.call are strings: a Lua number there is converted with
-- sprintf('%.14g') on every call, which costs more than most of the
-- commands these scripts run. TTLs are passed on as the ARGV strings they
-- arrived in, and integers are formatted with int() ('%d', no floating
-- point formatting).

local function int(n)
  return string.format('%d', n)
end

local function owner_of(token)
  local i = string.find(token, '|', 1, true)
  if i == nil then return token end
  return string.sub(token, 1, i - 1)
end

-- The mode of a lock hash value ('x' or 's').
local function mode_of(v)
  return string.sub(v, 1, 1)
end

-- The fencing token of a lock hash value (see Encodings), a string.
local function fence_of(v)
  return string.match(v, '^.(%d+)')
end

-- Two modes conflict unless both are shared. Two limited requests do not
-- conflict: they count (limits_of).
local function conflicts(a, b)
  return a == 'x' or b == 'x'
end

-- Whether modes A and B may not meet on one resource: one is limited and
-- the other is not.
local function mixed(a, b)
  return (a == 'l') ~= (b == 'l')
end

-- The number of resources of a request's MODES (see Encodings).
local function mode_count(modes)
  local c = string.find(modes, ':', 1, true)
  if c then return c - 1 end
  return #modes
end

-- The limits of a request's MODES: a table resource index -> limit, for
-- its 'l' resources (an empty table when it has none).
local function limits_of(modes)
  local out = {}
  local c = string.find(modes, ':', 1, true)
  if not c then return out end
  local it = string.gmatch(string.sub(modes, c + 1), '%d+')
  for i = 1, c - 1 do
    if string.sub(modes, i, i) == 'l' then out[i] = tonumber(it()) end
  end
  return out
end

-- The resource name of a lock key '{ns}:lock:<res>'.
local function name_of(prefix, lock)
  return string.sub(lock, #prefix + 6)
end

-- Does OWNER still hold any token in LOCK?
local function owner_holds(lock, owner)
  local fields = redis.call('HKEYS', lock)
  local p = owner .. '|'
  for _, f in ipairs(fields) do
    if string.sub(f, 1, #p) == p then return true end
  end
  return false
end

-- Next fencing token: one above the last, never below the server clock in
-- microseconds, so it stays monotonic across a restart without persistence.
-- (SET ... GET, Redis >= 6.2: one call in the usual case, where the clock
-- is ahead of the counter; a second SET when it is not.) The clock's token
-- is TIME's seconds followed by its microseconds padded to six digits, and
-- the usual case compares it with the last token as strings (digit strings
-- of equal length order like their numbers), so no number is formatted.
-- Returns the token as the decimal string stored.
-- Creating the fence (a new namespace, or a Redis that lost its data) also
-- records this release's data format ({ns}:format, SET NX; FORMAT_VERSION
-- is prepended to the source by scripts.py): a fence without a format key
-- means data of a release from before format versioning, so the script that
-- re-creates one must never leave it without its format. It also records
-- when this data set began ({ns}:born, SET NX: this first token): an owner
-- whose liveness key is gone tells a Redis that lost its data (born after
-- its grants) from a key that alone expired (born before), whoever created
-- the fence again since (manager.py _loss_reason).
local function next_fence(key)
  local t = redis.call('TIME')
  local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  local last = redis.call('SET', key, now, 'GET')
  if not last then
    local base = string.sub(key, 1, #key - #'fence')
    redis.call('SET', base .. 'format', FORMAT_VERSION, 'NX')
    redis.call('SET', base .. 'born', now, 'NX')
  end
  if last and (#last > #now or (#last == #now and last >= now)) then
    local f = int(tonumber(last) + 1)
    redis.call('SET', key, f)
    return f
  end
  return now
end

-- Registry helpers: the only code that knows the registry's layout.
-- The resource NAMES by their registry bucket. A name's bucket, '0'..'63',
-- comes from its SHA-1, so names that differ only in a digit or two
-- (res-000001, res-000002, ...) still spread evenly and no bucket outgrows
-- the compact encoding before the others. Returns BY (bucket -> its names,
-- each followed by VALUE unless VALUE is nil) and the buckets, in the order
-- they were first met.
local function reg_buckets(names, value)
  local by, order = {}, {}
  for _, name in ipairs(names) do
    local b = int(tonumber(string.sub(redis.sha1hex(name), 1, 2), 16) % 64)
    local kv = by[b]
    if not kv then
      kv = {}
      by[b] = kv
      order[#order + 1] = b
    end
    kv[#kv + 1] = name
    if value then kv[#kv + 1] = value end
  end
  return by, order
end

-- Record the resource NAMES in OWNER's registry: one HSET into the main
-- hash, or, when SPILL (the owner's client holds many locks), into each
-- name's bucket hash, which the bucket index then lists (one more HSET).
-- Each name's value is VALUE: a task's holder record, or '' (nil).
-- An owner may hold one resource twice (two tokens); the name may then be
-- in the main hash and in its bucket: registry_del removes both.
local function registry_add(prefix, owner, names, spill, value)
  local held = prefix .. 'held:' .. owner
  value = value or ''
  if not spill then
    if #names == 1 then
      -- the usual case: no table to build and unpack
      redis.call('HSET', held, names[1], value)
      return
    end
    local kv = {}
    for i, name in ipairs(names) do
      kv[2 * i - 1] = name
      kv[2 * i] = value
    end
    redis.call('HSET', held, unpack(kv))
    return
  end
  local by, order = reg_buckets(names, value)
  local index = {}
  for i, b in ipairs(order) do
    index[2 * i - 1] = b
    index[2 * i] = ''
  end
  redis.call('HSET', held .. '|', unpack(index))
  for b, kv in pairs(by) do redis.call('HSET', held .. '|' .. b, unpack(kv)) end
end

-- Remove the resource NAMES from OWNER's registry (the owner holds no
-- token on them any more): one HDEL on the main hash, and on their buckets
-- when the owner spilled. SPILLED: true when the caller knows the owner
-- has spilled, false when it knows it has not, nil when unknown (the
-- bucket index tells: one HMGET).
local function registry_del(prefix, owner, names, spilled)
  local held = prefix .. 'held:' .. owner
  redis.call('HDEL', held, unpack(names))
  if spilled == false then return end
  local by, order = reg_buckets(names)
  if spilled == nil then
    local listed = redis.call('HMGET', held .. '|', unpack(order))
    for i, b in ipairs(order) do
      if listed[i] then redis.call('HDEL', held .. '|' .. b, unpack(by[b])) end
    end
  else
    for _, b in ipairs(order) do redis.call('HDEL', held .. '|' .. b, unpack(by[b])) end
  end
end

-- Milliseconds the owner's liveness has left: -2 when dead (no key),
-- a large number when the key has no TTL (treated as alive).
local function owner_pttl(prefix, owner)
  local t = redis.call('PTTL', prefix .. 'alive:' .. owner)
  if t == -1 then return 2147483647 end
  return t
end

-- Every resource name in OWNER's registry (a name in the main hash and in
-- its bucket is listed twice), and whether it has spilled. Reads the main
-- hash, the bucket index and each listed bucket: O(names + buckets).
local function registry_read(prefix, owner)
  local held = prefix .. 'held:' .. owner
  local names = redis.call('HKEYS', held)
  local buckets = redis.call('HKEYS', held .. '|')
  for _, b in ipairs(buckets) do
    for _, f in ipairs(redis.call('HKEYS', held .. '|' .. b)) do names[#names + 1] = f end
  end
  return names, #buckets > 0
end

-- Delete OWNER's whole registry (main hash, bucket index and buckets).
local function registry_drop(prefix, owner)
  local held = prefix .. 'held:' .. owner
  for _, b in ipairs(redis.call('HKEYS', held .. '|')) do
    redis.call('DEL', held .. '|' .. b)
  end
  redis.call('DEL', held, held .. '|')
end

-- Deferred tasks (docs/defer.md): a parked request belongs to a task owner
-- ('defer:<task id>', or 'defer+<n>:<task id>' for the n-th life of the
-- task's park record; an earlier release wrote 'task:' / 'task+<n>:') with
-- the token '<task owner>|task:<task id>', and has a
-- park record {ns}:defer:<task id> naming that token. Nobody blocks on its
-- wake list: its wake-ups and grants go to the namespace's dispatch list
-- {ns}:dispatch (task ids), which the workers' dispatchers BLMOVE from.
-- Returns the task id of a parked request's TOKEN, or nil (any other token,
-- including a task owner's grant that no park record names).
local function parked_task(prefix, token)
  local i = string.find(token, '|task:', 1, true)
  if not i then return nil end
  local tid = string.sub(token, i + 6)
  if redis.call('HGET', prefix .. 'defer:' .. tid, 'token') ~= token then return nil end
  return tid
end

-- Whether OWNER is a task owner, not a process: a parked task's
-- ('defer:<task id>', 'defer+<n>:<task id>'; an earlier release's 'task:',
-- 'task+<n>:') or UniqueTask's ('task:<task id>', 'task+<n>:<task id>'). A
-- process's owner id starts with its pid.
local function is_task_owner(owner)
  local head = string.sub(owner, 1, 5)
  return head == 'task:' or head == 'task+' or head == 'defer'
end

-- The task id of a grant in transit: TOKEN holds a lock as a parked
-- request's task owner whose task has not adopted the grant yet (its park
-- record names TOKEN and is 'granted'); nil for any other holder. Costs one
-- HMGET, only for a task owner's token.
local function transit_task(prefix, token)
  if not is_task_owner(owner_of(token)) then return nil end
  local i = string.find(token, '|task:', 1, true)
  if not i then return nil end
  local tid = string.sub(token, i + 6)
  local rec = redis.call('HMGET', prefix .. 'defer:' .. tid, 'token', 'state')
  if rec[1] ~= token or rec[2] ~= 'granted' then return nil end
  return tid
end

-- Redis TIME in milliseconds plus ADD_MS (a string), as a decimal string.
local function time_ms_plus(add_ms)
  local t = redis.call('TIME')
  return int(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(add_ms))
end

-- The parked request of task TID was granted with FENCE: the record becomes
-- 'granted', the task owner OWNER lives for the grant TTL (the record's
-- gttl, ms), its deadline ({ns}:deadlines) is that of the grant, it needs no
-- more re-attempts (it leaves {ns}:deferred), and the task id goes to the
-- dispatch list.
local function defer_granted(prefix, tid, owner, fence)
  local rec = prefix .. 'defer:' .. tid
  local gttl = redis.call('HGET', rec, 'gttl') or '300000'
  redis.call('HSET', rec, 'state', 'granted', 'fence', fence)
  redis.call('PEXPIRE', prefix .. 'alive:' .. owner, gttl)
  redis.call('ZADD', prefix .. 'deadlines', time_ms_plus(gttl), tid)
  redis.call('ZREM', prefix .. 'deferred', tid)
  redis.call('LPUSH', prefix .. 'dispatch', tid)
end

-- Push a wake-up to one request's wake list: at most one element, expiring.
-- A parked request's wake-up goes to the dispatch list instead (its
-- dispatcher runs its acquire script for it).
-- TTL_MS: a string (see above), as in every helper below.
local function wake(prefix, token, ttl_ms)
  local tid = parked_task(prefix, token)
  if tid then
    redis.call('LPUSH', prefix .. 'dispatch', tid)
    return
  end
  local k = prefix .. 'wake:' .. token
  redis.call('LPUSH', k, '1')
  redis.call('LTRIM', k, '0', '0')
  redis.call('PEXPIRE', k, ttl_ms)
end

-- Most dead entries (or dead holders) one scan removes: a budget of its
-- own, larger than the scan limit, so that removing dead entries does not
-- use up the scan limit. Past it, the scan stops and a later call goes on.
local function purge_budget(limit)
  return 4 * limit
end

-- Tell the holders of the resource of LOCK that watch for contenders that a
-- request waits for it: one entry on the resource's contended stream (XREAD
-- wakes every reader), if it exists (a holder watches: it keeps the TTL).
local function contended(prefix, lock)
  local k = prefix .. 'contended:' .. name_of(prefix, lock)
  if redis.call('EXISTS', k) == 1 then
    redis.call('XADD', k, 'MAXLEN', '1', '*', 'c', '1')
  end
end

-- Resource names stored in a request's state, '\n'-separated (names never
-- contain control characters).
local function split_names(s)
  -- One name (the usual request) needs no pattern matching.
  if s ~= '' and not string.find(s, '\n', 1, true) then return {s} end
  local out = {}
  for name in string.gmatch(s, '[^\n]+') do out[#out + 1] = name end
  return out
end

-- Remove queued request T from every queue it joined (but DONE, a queue
-- the caller already removed it from, or nil), with its request state,
-- wake list and its line in its owner's waits hash (which names its
-- queues). Returns the queue keys it still had an entry in.
local function drop_request(prefix, t, done)
  local waits = prefix .. 'waits:' .. owner_of(t)
  local shape = redis.call('HGET', waits, t)
  local left = {}
  if shape then
    local cut = string.find(shape, '\n', 1, true)
    if cut then
      local modes, names = string.sub(shape, 1, cut - 1), split_names(string.sub(shape, cut + 1))
      for i = 1, #names do
        local q = prefix .. 'q:' .. names[i]
        if q ~= done and redis.call('ZREM', q, string.sub(modes, i, i) .. t) == 1 then
          left[#left + 1] = q
        end
      end
    end
    redis.call('HDEL', waits, t)
  end
  redis.call('DEL', prefix .. 'req:' .. t, prefix .. 'wake:' .. t)
  return left
end

-- Remove the dead entry M of QUEUE, and its request's entries in its other
-- queues (a dead multi-resource waiter leaves every queue at once). Those
-- other queues are not woken: whoever waits there behind it re-runs its own
-- script by the dead owner's liveness deadline at the latest.
local function drop_entry(prefix, queue, m)
  redis.call('ZREM', queue, m)
  drop_request(prefix, string.sub(m, 2), queue)
end

-- Free holder T of LOCK, whose owner O is dead: its field, request state,
-- wake list and holder record go, and O is noted in DEAD (unlist_dead).
-- Returns 1, or 0 when T no longer held LOCK (nothing done).
local function free_dead_holder(prefix, lock, t, o, dead)
  if redis.call('HDEL', lock, t) == 0 then return 0 end
  redis.call('DEL', prefix .. 'req:' .. t, prefix .. 'wake:' .. t, prefix .. 'holder:' .. t)
  dead[o] = true
  return 1
end

-- LOCK leaves the registry of each owner in DEAD (free_dead_holder) that
-- holds no other token there.
local function unlist_dead(prefix, lock, dead)
  for o, _ in pairs(dead) do
    if not owner_holds(lock, o) then
      registry_del(prefix, o, {name_of(prefix, lock)})
    end
  end
end

-- Free the holders of LOCK that conflict with MODE and whose owner is dead,
-- until a live conflicting holder is met: O(1 + holders freed), not
-- O(holders). An exclusive holder is always alone, so a shared MODE stops
-- at the second holder it sees (all holders are then shared); an exclusive
-- MODE reads the hash in HSCAN pages of LIMIT until a live one. A freed
-- holder's request state and wake list go with it, and the lock leaves its
-- owner's registry when the owner holds no other token there. N is HLEN of
-- LOCK when the caller has it; nil: the first HSCAN page is read at once
-- (one call where HLEN, then the page, would be two; a hash of up to 128
-- fields, a listpack, comes whole in one page).
-- Returns (ms, freed, by, other): ms = the live holder's remaining liveness
-- (it blocks MODE), 0 when the purge budget ran out first (treat as
-- blocked, try again soon), or nil when no conflicting holder is left; by =
-- that live holder's token (nil when none was met); other = 'l' when the
-- lock's holders are limited, which MODE may not meet (nothing freed then).
local function reclaim_holders(prefix, lock, mode, limit, n)
  if n == 0 or (mode == 's' and n ~= nil and n > 1) then return nil, 0 end
  local budget = purge_budget(limit)
  local freed, dead_owners, seen = 0, {}, 0
  local cursor, ms, by = '0', nil, nil
  repeat
    local kv
    if n == 1 then
      kv = redis.call('HGETALL', lock)
      cursor = '0'
      if kv[2] and mode_of(kv[2]) == 'l' then return nil, 0, nil, 'l' end
    else
      local page = redis.call('HSCAN', lock, cursor, 'COUNT', int(limit))
      cursor, kv = page[1], page[2]
      seen = seen + #kv / 2
      -- The holders of a lock are all limited or none is.
      if seen > 0 and seen == #kv / 2 and mode_of(kv[2]) == 'l' then return nil, 0, nil, 'l' end
      -- Two holders or more are all shared: none conflicts with a shared MODE.
      if mode == 's' and seen > 1 then break end
    end
    for j = 1, #kv, 2 do
      local t = kv[j]
      if conflicts(mode, mode_of(kv[j + 1])) then
        local o = owner_of(t)
        local left = owner_pttl(prefix, o)
        if left >= 0 then
          ms, by = left, t
          break
        end
        freed = freed + free_dead_holder(prefix, lock, t, o, dead_owners)
        if freed >= budget then
          ms = 0
          break
        end
      end
    end
  until ms ~= nil or cursor == '0'
  unlist_dead(prefix, lock, dead_owners)
  return ms, freed, by
end

-- The holders of the limited LOCK, for a request that may take a slot
-- while fewer than CAP (its own limit) hold it. Fewer than CAP hold it (HLEN)
-- and not CHECK: not blocked, live = HLEN (dead holders not told apart), and
-- one holder (HRANDFIELD) tells their mode. CAP or more hold it, or CHECK
-- (the caller needs the live count): their owners' liveness is read in
-- HSCAN pages of LIMIT, dead
-- ones are freed as reclaim_holders frees them, until CAP live ones are
-- seen (blocked), or LIMIT live ones (blocked, conservatively), or the
-- purge budget runs out (blocked, ms 0: try again at once), or the hash
-- ends (not blocked). O(1) commands while a slot is free; O(CAP + holders
-- freed) PTTLs, bounded by LIMIT, while the resource is full.
-- Returns (ms, freed, by, live, other): ms = the soonest liveness end
-- among the live holders seen when blocked, else nil; by = the token of the
-- first live holder seen that is a task owner's (it may be a grant in
-- transit: acquire.lua names it), else that of the soonest one; live = the
-- live holders counted (all of them when not blocked);
-- other = the holders' mode when they are not limited ('x' or 's': a name
-- the request may not take limited; nothing freed then).
local function reclaim_slots(prefix, lock, cap, limit, check)
  local n = redis.call('HLEN', lock)
  if n == 0 then return nil, 0, nil, 0 end
  if n < cap and not check then
    local one = redis.call('HRANDFIELD', lock, '1', 'WITHVALUES')
    if one[2] and mode_of(one[2]) ~= 'l' then return nil, 0, nil, n, mode_of(one[2]) end
    return nil, 0, nil, n
  end
  local budget = purge_budget(limit)
  local freed, live, dead_owners = 0, 0, {}
  local cursor, ms, by, stop, first = '0', nil, nil, false, true
  local task_by = nil
  repeat
    local page = redis.call('HSCAN', lock, cursor, 'COUNT', int(limit))
    cursor = page[1]
    local kv = page[2]
    if first and kv[2] and mode_of(kv[2]) ~= 'l' then return nil, 0, nil, n, mode_of(kv[2]) end
    first = false
    for j = 1, #kv, 2 do
      local t = kv[j]
      local o = owner_of(t)
      local left = owner_pttl(prefix, o)
      if left >= 0 then
        live = live + 1
        if ms == nil or left < ms then ms, by = left, t end
        if task_by == nil and is_task_owner(o) then task_by = t end
        if live >= cap or live >= limit then
          stop = true
          break
        end
      else
        freed = freed + free_dead_holder(prefix, lock, t, o, dead_owners)
        if freed >= budget then
          ms, stop = 0, true
          break
        end
      end
    end
  until stop or cursor == '0'
  unlist_dead(prefix, lock, dead_owners)
  if not stop then return nil, freed, nil, live end
  return ms, freed, task_by or by, live
end

local wake_front
-- Grants of dead holders that wake_front reclaimed to serve an exclusive
-- head, summed over the script's run (cleanup_owner reports them: they
-- belong to other dead owners, whose own cleanup then finds them gone).
local serve_reclaimed = 0

-- Hand-off: grant the queued request TOKEN every lock it asked for, here and
-- now, if nothing blocks it: no conflicting holder on any of its resources
-- and (unless nested) no earlier conflicting queue entry. Its owner must be
-- alive. The grant is what acquire.lua step 6 does; the fencing token is
-- stored with the grant in each lock hash and pushed to the request's wake
-- list as 'g<fence>', so the waiter learns it from its BLPOP without
-- another round trip. The push does not expire: a waiter blocked on the
-- list pops it at once, and otherwise the list goes with the grant (the
-- lease's release, or whoever frees the lock of a dead holder, deletes
-- it). Dead holders or entries are not reclaimed here: the request is left
-- to its own script (plain wake).
-- Keys touched: {ns}:req|wake:<token>, {ns}:lock|q:<its resources>,
-- {ns}:held|waits:<its owner>, {ns}:fence — all in the namespace's hash tag.
-- SERVED is the queue wake_front is serving: the caller has already checked
-- that the owner is alive, that LOCK's holders allow the entry and that no
-- earlier entry of that queue conflicts with it, so those checks are not
-- repeated for that resource (hand-off sits on the release's critical path).
-- ST is the request's state as wake_front read it (HMGET state, seq, modes,
-- res, nested, holder). It is left as it is: once granted, the request is in no
-- queue, and a retry of its acquire finds its token in the lock hash.
-- Returns true when granted.
local function try_handoff(prefix, token, ttl_ms, limit, served, st)
  if st[1] ~= 'q' or not st[3] or not st[4] then return false end
  local owner = owner_of(token)
  local modes, names = st[3], split_names(st[4])
  local n = mode_count(modes)
  if #names ~= n then return false end
  local caps = limits_of(modes)
  for i = 1, n do
    if prefix .. 'q:' .. names[i] ~= served then
      local lock, mode = prefix .. 'lock:' .. names[i], string.sub(modes, i, i)
      local hn = redis.call('HLEN', lock)
      local cap = caps[i]
      if mode == 'l' then
        if cap == nil or hn + 1 > cap then return false end
      elseif hn > 0 then
        if mode == 'x' then return false end
        if hn == 1 and mode_of(redis.call('HVALS', lock)[1]) == 'x' then return false end
      end
      if st[5] ~= '1' then
        local ahead = redis.call('ZRANGEBYSCORE', prefix .. 'q:' .. names[i], '-inf',
          '(' .. st[2], 'LIMIT', '0', int(limit))
        if #ahead >= limit then return false end
        -- A limited request counts the entries ahead of it as slots taken.
        if cap and hn + #ahead + 1 > cap then return false end
        for _, m in ipairs(ahead) do
          local em = string.sub(m, 1, 1)
          if conflicts(mode, em) or mixed(mode, em) then return false end
        end
      end
    end
  end
  local fence = next_fence(prefix .. 'fence')
  for i = 1, n do
    local lock, mode = prefix .. 'lock:' .. names[i], string.sub(modes, i, i)
    local v = mode .. fence
    if mode == 'l' then v = v .. ':' .. int(caps[i]) end
    redis.call('HSET', lock, token, v)
    redis.call('ZREM', prefix .. 'q:' .. names[i], mode .. token)
  end
  -- A task's request carries who it is (its holder record): the registry
  -- keeps it with the grant, for operators.
  registry_add(prefix, owner, names, false, st[6])
  redis.call('HDEL', prefix .. 'waits:' .. owner, token)
  local tid = parked_task(prefix, token)
  if tid then
    -- A parked task: its grant goes to the dispatch list (docs/defer.md).
    defer_granted(prefix, tid, owner, fence)
  else
    -- LPUSH puts the grant at the head, where BLPOP pops first; a stale plain
    -- wake behind it is deleted with the request's other keys at release.
    redis.call('LPUSH', prefix .. 'wake:' .. token, 'g' .. fence)
  end
  -- Leaving its other queues may let requests behind it follow (shared
  -- behind shared): wake those, without a further hand-off (bounded work).
  -- The served queue is the caller's to go on with.
  for i = 1, n do
    local q = prefix .. 'q:' .. names[i]
    if q ~= served then
      wake_front(prefix, q, prefix .. 'lock:' .. names[i], limit, ttl_ms, true)
    end
  end
  return true
end

-- The state of queue entry token T (HMGET state, seq, modes, res, nested,
-- holder),
-- or nil when the entry is dead: its owner's liveness is gone or its
-- request state expired.
local function entry_state(prefix, t)
  if owner_pttl(prefix, owner_of(t)) < 0 then return nil end
  local st = redis.call('HMGET', prefix .. 'req:' .. t, 'state', 'seq', 'modes', 'res', 'nested',
    'holder')
  if not st[1] then return nil end
  return st
end

-- A read of QUEUE's entries in arrival order, page by page (scan_page,
-- scan_next): the position after the last entry read, and the dead entries
-- removed on the way, out of purge_budget(LIMIT).
local function queue_scan(prefix, queue, limit)
  return {prefix = prefix, queue = queue, cursor = '-inf', purged = 0,
    budget = purge_budget(limit), spent = false}
end

-- Read the next page of scan S: at most WANT entries after its cursor.
-- Returns whether the queue ends within it (fewer came).
local function scan_page(s, want)
  s.page = redis.call('ZRANGEBYSCORE', s.queue, s.cursor, '+inf', 'WITHSCORES', 'LIMIT', '0', int(want))
  s.j = 1
  return #s.page < 2 * want
end

-- The next live entry of scan S's page and its state (entry_state), or nil
-- at the end of the page; an iterator (for m, st in scan_next, s do). A dead
-- entry met is removed (drop_entry); when that spends the purge budget,
-- S.spent is set and nil returned.
local function scan_next(s)
  local page = s.page
  while s.j < #page do
    local m = page[s.j]
    s.cursor = '(' .. page[s.j + 1]
    s.j = s.j + 2
    local st = entry_state(s.prefix, string.sub(m, 2))
    if st then return m, st end
    drop_entry(s.prefix, s.queue, m)
    s.purged = s.purged + 1
    if s.purged >= s.budget then
      s.spent = true
      return nil
    end
  end
  return nil
end

-- Wake the first entry of scan S's queue not read yet, if there is one.
local function scan_wake_next(s, ttl_ms)
  local nxt = redis.call('ZRANGEBYSCORE', s.queue, s.cursor, '+inf', 'LIMIT', '0', '1')
  if #nxt > 0 then wake(s.prefix, string.sub(nxt[1], 2), ttl_ms) end
end

-- Hand queue entry M (state ST) its locks, or wake it to run its own script.
local function serve(prefix, queue, m, st, limit, ttl_ms, plain)
  local t = string.sub(m, 2)
  if plain or not try_handoff(prefix, t, ttl_ms, limit, queue, st) then
    wake(prefix, t, ttl_ms)
  end
end

-- The limit queued request state ST (entry_state) asked for on the
-- resource of QUEUE, or nil (not a limited request there).
local function entry_cap(prefix, queue, st)
  if not st[3] or not st[4] then return nil end
  local names = split_names(st[4])
  local caps = limits_of(st[3])
  for i = 1, #names do
    if prefix .. 'q:' .. names[i] == queue then return caps[i] end
  end
  return nil
end

-- Serve the head of the limited QUEUE now that N hold its lock: in arrival
-- order, each live entry that fits (N, plus the entries served before it
-- here, plus itself, is at most its own limit) is handed its locks
-- (try_handoff) or, blocked elsewhere, woken; the first entry that does
-- not fit ends it, so no later one goes past it here. Dead entries met are
-- removed (drop_entry). The first page is one entry; later pages are no
-- longer than the slots its limit leaves free, so a release that frees one
-- slot reads one entry. Past LIMIT entries served or the purge budget, the
-- next entry is woken: its own script carries on (acquire.lua step 6).
-- Returns the number of entries served.
local function serve_slots(prefix, queue, n, limit, ttl_ms, plain)
  local s = queue_scan(prefix, queue, limit)
  local pos, room = 0, 1
  while true do
    local want = math.min(limit, room) - pos
    if want <= 0 then break end
    local ended = scan_page(s, want)
    for m, st in scan_next, s do
      local cap = entry_cap(prefix, queue, st)
      if cap == nil or n + pos + 1 > cap then return pos end
      serve(prefix, queue, m, st, limit, ttl_ms, plain)
      pos = pos + 1
      if cap - n > room then room = cap - n end
    end
    if s.spent then
      scan_wake_next(s, ttl_ms)
      return pos
    end
    if ended then return pos end
  end
  if pos >= limit then scan_wake_next(s, ttl_ms) end
  return pos
end

-- Serve the head of QUEUE now that LOCK changed: every queued request that
-- the holders of LOCK no longer block and that no earlier queued request
-- blocks on this resource (the first entry if exclusive, only when the lock
-- is free; else the run of shared entries at the head, only when there is
-- no exclusive holder) is handed its locks (try_handoff) or, if it is
-- blocked elsewhere, woken to run its own script. PLAIN = true only wakes
-- (no hand-off). HOLDERS is HLEN of LOCK when the caller already has it
-- (nil: read here). Returns the number of entries served.
--
-- The head is read first, alone: a live exclusive head (the usual case)
-- decides by itself. If shared holders remain, their dead ones are freed
-- until a live one is met (reclaim_holders), so the head is not left
-- waiting behind holders that died.
--
-- Otherwise the queue is read in pages. A dead entry met on the way (owner
-- liveness gone, or request state expired) is removed (drop_entry) and does
-- not count against LIMIT; at most purge_budget(LIMIT) are removed. At
-- most LIMIT live entries are looked at. When either budget stops the scan
-- inside a run of shared entries, the wake-up is carried on: the last
-- single-resource shared entry served gets a plain wake instead of a
-- hand-off, and its own acquire script, granting it, runs wake_front on
-- this queue again (acquire.lua step 6); with no such entry, the next entry
-- not read gets a plain wake.
wake_front = function(prefix, queue, lock, limit, ttl_ms, plain, holders)
  local n = holders or redis.call('HLEN', lock)
  if n == 1 and mode_of(redis.call('HVALS', lock)[1]) == 'x' then return 0 end
  local first = redis.call('ZRANGE', queue, '0', '0')
  if #first == 0 then return 0 end
  if string.sub(first[1], 1, 1) == 'l' then
    return serve_slots(prefix, queue, n, limit, ttl_ms, plain)
  end
  if string.sub(first[1], 1, 1) == 'x' then
    local st = entry_state(prefix, string.sub(first[1], 2))
    if st then
      if n > 0 then
        local ms, freed = reclaim_holders(prefix, lock, 'x', limit, n)
        serve_reclaimed = serve_reclaimed + freed
        if ms ~= nil then return 0 end
      end
      serve(prefix, queue, first[1], st, limit, ttl_ms, plain)
      return 1
    end
  end
  local s = queue_scan(prefix, queue, limit)
  local live, served = 0, 0
  local carry, carry_st = nil, nil -- the last single-resource shared entry, not served yet
  local ended, stop = false, false
  while not stop do
    local want = limit - live
    local short = scan_page(s, want)
    for m, st in scan_next, s do
      if string.sub(m, 1, 1) == 'x' then
        if n == 0 and served == 0 and carry == nil then
          serve(prefix, queue, m, st, limit, ttl_ms, plain)
          served = 1
        end
        ended, stop = true, true
        break
      end
      live = live + 1
      if st[4] and not string.find(st[4], '\n', 1, true) then
        if carry then
          serve(prefix, queue, carry, carry_st, limit, ttl_ms, plain)
          served = served + 1
        end
        carry, carry_st = m, st
      else
        serve(prefix, queue, m, st, limit, ttl_ms, plain)
        served = served + 1
      end
    end
    if s.spent then
      stop = true
    elseif not stop then
      if short then
        ended, stop = true, true
      elseif live >= limit then
        stop = true
        ended = #redis.call('ZRANGEBYSCORE', queue, s.cursor, '+inf', 'LIMIT', '0', '1') == 0
      end
    end
  end
  if carry then
    if ended then
      serve(prefix, queue, carry, carry_st, limit, ttl_ms, plain)
    else
      wake(prefix, string.sub(carry, 2), ttl_ms)
    end
    served = served + 1
  elseif not ended then
    scan_wake_next(s, ttl_ms)
  end
  return served
end

-- Take the deferred task TID out of line (docs/defer.md): its park record
-- {ns}:defer:<tid> must be 'parked' or 'granted'; with ONLY_DEAD, its task
-- owner's liveness must also be gone. Per resource: HDEL the request's grant
-- (if it has one; the contended stream goes when the lock is left with no
-- holder), ZREM its queue entry (if queued), and hand the lock on or wake the
-- queue (wake_front), as release.lua does: the next waiter is the holder when
-- this returns. Then the task owner's keys (registry hash with the holder
-- record, liveness, waits; the request's state, wake list and any holder
-- record key of an earlier release), its place in {ns}:owners, the task's
-- entries in {ns}:deferred and {ns}:deadlines and the record go.
-- Returns {state, msg, life} withdrawn; {'alive', state, pttl} (ONLY_DEAD,
-- the task owner lives); {state} or {'none'} nothing to withdraw.
local function defer_withdraw_task(prefix, tid, req_ttl, limit, only_dead)
  local rec = prefix .. 'defer:' .. tid
  local st = redis.call('HMGET', rec, 'state', 'token', 'modes', 'res', 'msg', 'life')
  if not st[1] then return {'none'} end
  if st[1] ~= 'parked' and st[1] ~= 'granted' then return {st[1]} end
  local towner = owner_of(st[2])
  if only_dead then
    local pttl = redis.call('PTTL', prefix .. 'alive:' .. towner)
    if pttl ~= -2 then return {'alive', st[1], pttl} end
  end
  local token, modes = st[2], st[3]
  local names = split_names(st[4])
  redis.call('DEL', rec)
  for i = 1, #names do
    local lock, q = prefix .. 'lock:' .. names[i], prefix .. 'q:' .. names[i]
    local holders = nil
    local r = redis.call('HDEL', lock, token)
    if r == 1 then
      holders = redis.call('HLEN', lock)
      if holders == 0 then
        redis.call('DEL', prefix .. 'contended:' .. names[i])
      end
    end
    local d = redis.call('ZREM', q, string.sub(modes, i, i) .. token)
    if r == 1 or d == 1 then
      wake_front(prefix, q, lock, limit, req_ttl, false, holders)
    end
  end
  redis.call('DEL', prefix .. 'req:' .. token, prefix .. 'wake:' .. token,
    prefix .. 'holder:' .. token, prefix .. 'held:' .. towner, prefix .. 'alive:' .. towner,
    prefix .. 'waits:' .. towner)
  redis.call('SREM', prefix .. 'owners', towner)
  redis.call('ZREM', prefix .. 'deferred', tid)
  redis.call('ZREM', prefix .. 'deadlines', tid)
  return {st[1], st[5] or '', st[6] or '0'}
end
