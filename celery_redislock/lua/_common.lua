-- _common.lua: helpers prepended to every script by celery_redislock/scripts.py.
-- Not a script of its own. Every key these helpers build is
-- PREFIX .. kind .. ':' .. id, where PREFIX is '{namespace}:' (hash tag
-- included), so a key read from a lock, a queue or a registry stays in the
-- namespace's slot (Redis Cluster safe). Each script names such keys in its
-- header.
--
-- Encodings:
--   token        '<owner>|<request id>'   (one acquisition; owner ids never contain '|')
--   lock hash    field token -> '<mode><fence>': 'x' (exclusive) or 's'
--                (shared), then the grant's fencing token in decimal,
--                e.g. 'x1764456000123456'; mode_of() reads the mode
--   queue zset   member '<mode><token>', score = arrival sequence
--                (nested requests: sequence - 1e15, so they sort first)
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

-- Two modes conflict unless both are shared.
local function conflicts(a, b)
  return a == 'x' or b == 'x'
end

-- Milliseconds the owner's liveness has left: -2 when dead (no key),
-- a large number when the key has no TTL (treated as alive).
local function owner_pttl(prefix, owner)
  local t = redis.call('PTTL', prefix .. 'alive:' .. owner)
  if t == -1 then return 2147483647 end
  return t
end

-- Push a wake-up to one request's wake list: at most one element, expiring.
-- TTL_MS: a string (see above), as in every helper below.
local function wake(prefix, token, ttl_ms)
  local k = prefix .. 'wake:' .. token
  redis.call('LPUSH', k, '1')
  redis.call('LTRIM', k, '0', '0')
  redis.call('PEXPIRE', k, ttl_ms)
end

-- Tell the holder of TOKEN that a request waits for it.
local function contended(prefix, token, ttl_ms)
  local k = prefix .. 'contend:' .. token
  redis.call('LPUSH', k, '1')
  redis.call('LTRIM', k, '0', '0')
  redis.call('PEXPIRE', k, ttl_ms)
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
local function next_fence(key)
  local t = redis.call('TIME')
  local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  local last = redis.call('SET', key, now, 'GET')
  if last and (#last > #now or (#last == #now and last >= now)) then
    local f = int(tonumber(last) + 1)
    redis.call('SET', key, f)
    return f
  end
  return now
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

local wake_front

-- Hand-off: grant the queued request TOKEN every lock it asked for, here and
-- now, if nothing blocks it: no conflicting holder on any of its resources
-- and (unless nested) no earlier conflicting queue entry. Its owner must be
-- alive. The grant is what acquire.lua step 5 does; the fencing token is
-- stored with the grant in each lock hash and pushed to the request's wake
-- list as 'g<fence>', so the waiter learns it from its BLPOP without
-- another round trip. The push does not expire: a waiter blocked on the
-- list pops it at once, and otherwise the list goes with the grant (the
-- lease's release, or whoever frees the lock of a dead holder, deletes
-- it). Dead holders or entries are not reclaimed here: the request is left
-- to its own script (plain wake).
-- Keys touched: {ns}:req|wake:<token>, {ns}:lock|q:<its resources>,
-- {ns}:held:<its owner>, {ns}:fence — all in the namespace's hash tag.
-- SERVED is the queue wake_front is serving: the caller has already checked
-- that the owner is alive, that LOCK's holders allow the entry and that no
-- earlier entry of that queue conflicts with it, so those checks are not
-- repeated for that resource (hand-off sits on the release's critical path).
-- ST is the request's state as wake_front read it (HMGET state, seq, modes,
-- res, nested). It is left as it is: once granted, the request is in no
-- queue, and a retry of its acquire finds its token in the lock hash.
-- Returns true when granted.
local function try_handoff(prefix, token, ttl_ms, limit, served, st)
  if st[1] ~= 'q' or not st[3] or not st[4] then return false end
  local owner = owner_of(token)
  local modes, names = st[3], split_names(st[4])
  local n = #modes
  if #names ~= n then return false end
  for i = 1, n do
    if prefix .. 'q:' .. names[i] ~= served then
      local lock, mode = prefix .. 'lock:' .. names[i], string.sub(modes, i, i)
      local hn = redis.call('HLEN', lock)
      if hn > 0 then
        if mode == 'x' then return false end
        if hn == 1 and mode_of(redis.call('HVALS', lock)[1]) == 'x' then return false end
      end
      if st[5] ~= '1' then
        local ahead = redis.call('ZRANGEBYSCORE', prefix .. 'q:' .. names[i], '-inf',
          '(' .. st[2], 'LIMIT', '0', int(limit))
        if #ahead >= limit then return false end
        for _, m in ipairs(ahead) do
          if conflicts(mode, string.sub(m, 1, 1)) then return false end
        end
      end
    end
  end
  local fence = next_fence(prefix .. 'fence')
  local held = prefix .. 'held:' .. owner
  for i = 1, n do
    local lock, mode = prefix .. 'lock:' .. names[i], string.sub(modes, i, i)
    redis.call('HSET', lock, token, mode .. fence)
    redis.call('SADD', held, lock)
    redis.call('ZREM', prefix .. 'q:' .. names[i], mode .. token)
  end
  -- LPUSH puts the grant at the head, where BLPOP pops first; a stale plain
  -- wake behind it is deleted with the request's other keys at release.
  redis.call('LPUSH', prefix .. 'wake:' .. token, 'g' .. fence)
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

-- The state of queue entry token T (HMGET state, seq, modes, res, nested),
-- or nil when the entry is dead: its owner's liveness is gone or its
-- request state expired.
local function entry_state(prefix, t)
  if owner_pttl(prefix, owner_of(t)) < 0 then return nil end
  local st = redis.call('HMGET', prefix .. 'req:' .. t, 'state', 'seq', 'modes', 'res', 'nested')
  if not st[1] then return nil end
  return st
end

-- Hand queue entry M (state ST) its locks, or wake it to run its own script.
local function serve(prefix, queue, m, st, limit, ttl_ms, plain)
  local t = string.sub(m, 2)
  if plain or not try_handoff(prefix, t, ttl_ms, limit, queue, st) then
    wake(prefix, t, ttl_ms)
  end
end

-- Serve the head of QUEUE now that LOCK changed: every queued request that
-- the holders of LOCK no longer block and that no earlier queued request
-- blocks on this resource (the first entry if exclusive, only when the lock
-- is free; else the run of shared entries at the head, only when there is
-- no exclusive holder) is handed its locks (try_handoff) or, if it is
-- blocked elsewhere, woken to run its own script. A dead entry met on the
-- way (owner liveness gone, or request state expired) is removed with its
-- req and wake keys, and the next one is considered, so a dead head never
-- swallows the wake-up. Looks at no more than LIMIT entries. PLAIN = true
-- only wakes (no hand-off). HOLDERS is HLEN of LOCK when the caller already
-- has it (nil: read here).
-- The head is read first, alone: a live exclusive head (the usual case)
-- decides by itself, and the rest of the window is read only when the scan
-- must go past it (a dead head, a run of shared entries).
wake_front = function(prefix, queue, lock, limit, ttl_ms, plain, holders)
  local n = holders or redis.call('HLEN', lock)
  if n == 1 and mode_of(redis.call('HVALS', lock)[1]) == 'x' then return 0 end
  local first = redis.call('ZRANGE', queue, '0', '0')
  if #first == 0 then return 0 end
  if string.sub(first[1], 1, 1) == 'x' then
    local st = entry_state(prefix, string.sub(first[1], 2))
    if st then
      if n > 0 then return 0 end
      serve(prefix, queue, first[1], st, limit, ttl_ms, plain)
      return 1
    end
  end
  local woken = 0
  for _, m in ipairs(redis.call('ZRANGE', queue, '0', int(limit - 1))) do
    local t = string.sub(m, 2)
    local st = entry_state(prefix, t)
    if st == nil then
      -- dead entry (Lua 5.1 has no goto: the live cases are the else branches)
      redis.call('ZREM', queue, m)
      redis.call('DEL', prefix .. 'req:' .. t, prefix .. 'wake:' .. t)
    elseif string.sub(m, 1, 1) == 'x' then
      if n == 0 and woken == 0 then
        serve(prefix, queue, m, st, limit, ttl_ms, plain)
        woken = woken + 1
      end
      return woken
    else
      serve(prefix, queue, m, st, limit, ttl_ms, plain)
      woken = woken + 1
    end
  end
  return woken
end
