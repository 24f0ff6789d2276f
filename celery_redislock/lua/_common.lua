-- _common.lua: helpers prepended to every script by celery_redislock/scripts.py.
-- Not a script of its own. Every key these helpers build is
-- PREFIX .. kind .. ':' .. id, where PREFIX is '{namespace}:' (hash tag
-- included), so a key read from a lock, a queue or a registry stays in the
-- namespace's slot (Redis Cluster safe). Each script names such keys in its
-- header.
--
-- Encodings:
--   token        '<owner>|<request id>'   (one acquisition; owner ids never contain '|')
--   lock hash    field token -> 'x' | 's'
--   queue zset   member '<mode><token>', score = arrival sequence
--                (nested requests: sequence - 1e15, so they sort first)

local function owner_of(token)
  local i = string.find(token, '|', 1, true)
  if i == nil then return token end
  return string.sub(token, 1, i - 1)
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
local function wake(prefix, token, ttl_ms)
  local k = prefix .. 'wake:' .. token
  redis.call('LPUSH', k, '1')
  redis.call('LTRIM', k, 0, 0)
  redis.call('PEXPIRE', k, ttl_ms)
end

-- Tell the holder of TOKEN that a request waits for it.
local function contended(prefix, token, ttl_ms)
  local k = prefix .. 'contend:' .. token
  redis.call('LPUSH', k, '1')
  redis.call('LTRIM', k, 0, 0)
  redis.call('PEXPIRE', k, ttl_ms)
end

-- Wake every queued request of QUEUE that the holders of LOCK no longer
-- block and that no earlier queued request blocks on this resource: the
-- first entry if exclusive (only when the lock is free), else the run of
-- shared entries at the head (only when no exclusive holder). A dead entry
-- met on the way (owner liveness gone, or request state expired) is
-- removed with its req and wake keys, and the next one is considered, so a
-- dead head never swallows the wake-up. Looks at no more than LIMIT entries.
local function wake_front(prefix, queue, lock, limit, ttl_ms)
  local n = redis.call('HLEN', lock)
  if n == 1 then
    local v = redis.call('HVALS', lock)
    if v[1] == 'x' then return 0 end
  end
  local woken = 0
  local head = redis.call('ZRANGE', queue, 0, limit - 1)
  for _, m in ipairs(head) do
    local t = string.sub(m, 2)
    if owner_pttl(prefix, owner_of(t)) < 0
        or redis.call('EXISTS', prefix .. 'req:' .. t) == 0 then
      -- dead entry (Lua 5.1 has no goto: the live case is the else branch)
      redis.call('ZREM', queue, m)
      redis.call('DEL', prefix .. 'req:' .. t, prefix .. 'wake:' .. t)
    elseif string.sub(m, 1, 1) == 'x' then
      if n == 0 and woken == 0 then
        wake(prefix, t, ttl_ms)
        woken = woken + 1
      end
      return woken
    else
      wake(prefix, t, ttl_ms)
      woken = woken + 1
    end
  end
  return woken
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
local function next_fence(key)
  local t = redis.call('TIME')
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', key) or '0')
  local f = last + 1
  if now_us > f then f = now_us end
  redis.call('SET', key, string.format('%.0f', f))
  return f
end
