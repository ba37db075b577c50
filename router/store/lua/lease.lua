-- lease: gateway heartbeat ('beat'), absolute restore of this gateway's in-flight ('restore'), or
-- graceful goodbye ('bye').
-- beat:    ARGV base, 'beat', gid, lease_ms                 -> {lease_was_lost, dead_gateways_collected}
-- restore: ARGV base, 'restore', gid, lease_ms, n, (replica, count) * n, m,
--          (sid, k, (replica, count) * k) * m               -> 1
--          sets this gateway's in-flight hash and its fields in the listed sessions to exactly the
--          given counts (the gateway's own truth after a lost lease or a Redis outage).
-- bye:     ARGV base, 'bye', gid                            -> 1
-- live:    ARGV base, 'live', ''                            -> holders whose lease has not expired
local op, gid = ARGV[2], ARGV[3]
local gk = K('gw:' .. gid .. ':if')
local tms = redis_ms()
if op == 'live' then
  return redis.call('ZRANGEBYSCORE', K('gw'), '(' .. tms, '+inf')
end
if op == 'bye' then
  redis.call('ZREM', K('gw'), gid)
  redis.call('DEL', gk)
  return 1
end
local lease_ms = tonumber(ARGV[4])
if op == 'beat' then
  local sc = redis.call('ZSCORE', K('gw'), gid)
  local lost = 0
  if (not sc) or tonumber(sc) < tms then lost = 1 end
  redis.call('ZADD', K('gw'), tms + lease_ms, gid)
  local dead = redis.call('ZRANGEBYSCORE', K('gw'), '-inf', '(' .. tms)
  for _, g in ipairs(dead) do
    redis.call('DEL', K('gw:' .. g .. ':if'))
    redis.call('ZREM', K('gw'), g)
  end
  return {lost, #dead}
elseif op == 'restore' then
  redis.call('ZADD', K('gw'), tms + lease_ms, gid)
  redis.call('DEL', gk)
  local i = 5
  local n = tonumber(ARGV[i]); i = i + 1
  for _ = 1, n do
    redis.call('HSET', gk, ARGV[i], ARGV[i + 1])
    i = i + 2
  end
  local m = tonumber(ARGV[i]); i = i + 1
  local pre = 'f:' .. gid .. '|'
  for _ = 1, m do
    local sk = K('s:' .. ARGV[i])
    local k = tonumber(ARGV[i + 1])
    i = i + 2
    for _, f in ipairs(redis.call('HKEYS', sk)) do
      if string.sub(f, 1, #pre) == pre then redis.call('HDEL', sk, f) end
    end
    for _ = 1, k do
      if redis.call('EXISTS', sk) == 1 and tonumber(ARGV[i + 1]) > 0 then
        redis.call('HSET', sk, pre .. ARGV[i], ARGV[i + 1])
      end
      i = i + 2
    end
  end
  return 1
end
return redis.error_reply('kvroute: unknown lease op ' .. tostring(op))
