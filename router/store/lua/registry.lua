-- registry: replica upsert / status / remove / engine load, each atomic.
-- ARGV: base, op, replica, now, a, b, c
--   upsert: a = spec JSON, b = status ('' = keep, or joining for a new one), c = expiry (fleet s, 0 = none)
--   status: a = status            -> 0 if the replica is unknown
--   remove
--   engine: a = engine JSON, c = new expiry for registry entries (ignored for static ones)
--   health: a = JSON {replica: "<fleet s>|<fresh s>|<writer>"} (replica ARGV unused): good health checks shared
--           (discovery rule 7), kept for registered replicas only -> how many were kept
--   health_read (replica ARGV unused) -> flat [replica, "<fleet s>|<fresh s>|<writer>", ...]
local op, rid, NOW = ARGV[2], ARGV[3], ARGV[4]
local now, a, b, c = tonumber(NOW), ARGV[5], ARGV[6], ARGV[7]
local rk = K('r:' .. rid)

local function set_status(st)
  local cur, joined = unpack(redis.call('HMGET', rk, 'status', 'joined'))
  if st == 'active' and cur ~= 'active' and tonumber(joined or '0') == 0 then
    redis.call('HSET', rk, 'joined', NOW)
  end
  redis.call('HSET', rk, 'status', st)
end

if op == 'upsert' then
  if redis.call('SISMEMBER', K('replicas'), rid) == 1 and not rep_live(rid, now) then drop_replica(rid) end
  if redis.call('SISMEMBER', K('replicas'), rid) == 0 then
    local st = b
    if st == '' then st = 'joining' end
    local joined = '0'
    if st == 'active' then joined = NOW end
    drop_replica(rid)
    redis.call('HSET', rk, 'spec', a, 'status', st, 'joined', joined, 'engine', '', 'tw', 0, 'actctx', 0, 'exp', c)
    redis.call('SADD', K('replicas'), rid)
    return 1
  end
  redis.call('HSET', rk, 'spec', a, 'exp', c)
  if b ~= '' then set_status(b) end
  return 1
elseif op == 'status' then
  if not rep_live(rid, now) then return 0 end
  set_status(a)
  return 1
elseif op == 'remove' then
  drop_replica(rid)
  return 1
elseif op == 'engine' then
  if not rep_live(rid, now) then return 0 end
  redis.call('HSET', rk, 'engine', a)
  if tonumber(redis.call('HGET', rk, 'exp') or '0') ~= 0 then redis.call('HSET', rk, 'exp', c) end
  return 1
elseif op == 'health' then
  local kept = 0
  for r, v in pairs(cjson.decode(a)) do
    if rep_live(r, now) then
      redis.call('HSET', K('health'), r, v)
      kept = kept + 1
    end
  end
  return kept
elseif op == 'health_read' then
  return redis.call('HGETALL', K('health'))
end
return redis.error_reply('kvroute: unknown registry op ' .. tostring(op))
