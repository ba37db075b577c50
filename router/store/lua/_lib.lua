-- Shared prelude of every kvroute script (prepended by router/store/redis.py).
-- ARGV[1] is the key base "{prefix}:"; every key below starts with it, so all keys of a fleet
-- share one Redis Cluster hash slot and may be touched together atomically.
local P = ARGV[1]
local function K(s) return P .. s end

-- Redis server time in ms: gateway leases are judged on the server's clock, never a gateway's.
local function redis_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Gateways whose lease has not expired.
local function alive_gateways(tms)
  local out = {}
  for _, g in ipairs(redis.call('ZRANGEBYSCORE', K('gw'), tms, '+inf')) do out[g] = true end
  return out
end

-- A replica exists if registered and its registry TTL (fleet seconds, 0 = none) has not passed.
local function rep_live(rid, now)
  if redis.call('SISMEMBER', K('replicas'), rid) == 0 then return false end
  local exp = tonumber(redis.call('HGET', K('r:' .. rid), 'exp') or '0')
  return exp == 0 or exp >= now
end

local function drop_replica(rid)
  redis.call('DEL', K('r:' .. rid), K('act:' .. rid), K('actx:' .. rid), K('plc:' .. rid))
  redis.call('SREM', K('replicas'), rid)
  redis.call('HDEL', K('health'), rid)
end

local function forget_active(rid, sid)
  local old = redis.call('HGET', K('actx:' .. rid), sid)
  if old then
    redis.call('HDEL', K('actx:' .. rid), sid)
    redis.call('ZREM', K('act:' .. rid), sid)
    redis.call('HINCRBY', K('r:' .. rid), 'actctx', 0 - tonumber(old))
  end
end

-- The admin / drain index of sessions homed on rid. Its members are stale once their session has been
-- idle for the session TTL, so the key expires that long after its last write: a replica removed for
-- good (or a fleet that stopped) leaves nothing behind. The snapshot prunes it while the replica lives.
local function index_home(rid, score, sid, ttl_ms)
  local hk = K('home:' .. rid)
  redis.call('ZADD', hk, score, sid)
  redis.call('PEXPIRE', hk, ttl_ms)
end

local function touch_active(rid, sid, seen, ctx)
  forget_active(rid, sid)
  redis.call('ZADD', K('act:' .. rid), seen, sid)
  redis.call('HSET', K('actx:' .. rid), sid, ctx)
  redis.call('HINCRBY', K('r:' .. rid), 'actctx', ctx)
end

-- A session hash split into plain fields and in-flight per replica (live gateways only).
-- Fields of dead gateways are deleted on the way. ``skip`` (optional): a gateway whose counts are
-- left out of ``per`` (it knows its own exactly) but still count in ``total``.
local function session_fields(sk, alive, skip)
  local flat = redis.call('HGETALL', sk)
  local fields, per, total, dead = {}, {}, 0, {}
  for i = 1, #flat, 2 do
    local f = flat[i]
    if string.sub(f, 1, 2) == 'f:' then
      local bar = string.find(f, '|', 3, true)
      local g = string.sub(f, 3, bar - 1)
      local n = tonumber(flat[i + 1])
      if alive[g] then
        if n > 0 then
          if g ~= skip then
            local rid = string.sub(f, bar + 1)
            per[rid] = (per[rid] or 0) + n
          end
          total = total + n
        end
      else
        dead[#dead + 1] = f
      end
    else
      fields[f] = flat[i + 1]
    end
  end
  for _, f in ipairs(dead) do redis.call('HDEL', sk, f) end
  return fields, per, total, #flat > 0
end

-- A session as returned to Python, or nil if unknown or idle past the TTL with nothing in flight.
local function session_row(sid, now, ttl, alive, skip)
  local fields, per, total, exists = session_fields(K('s:' .. sid), alive, skip)
  if not exists then return nil end
  if tonumber(fields['seen'] or '0') < now - ttl and total == 0 then return nil end
  local pl = {}
  for rid, n in pairs(per) do pl[#pl + 1] = rid; pl[#pl + 1] = n end
  return {sid, fields['home'] or '', fields['ovf'] or '', fields['ctx'] or '0', fields['seen'] or '0',
          fields['mark'] or '0', fields['turns'] or '0', pl, fields['bpt'] or '0', fields['ch'] or ''}
end

-- One replica's row (pruning its active-session and placement windows), or nil if gone.
local function replica_row(rid, now, aw, rw, inflight)
  local rk = K('r:' .. rid)
  local v = redis.call('HMGET', rk, 'spec', 'status', 'joined', 'engine', 'tw', 'exp', 'hz')
  if not v[1] then
    redis.call('SREM', K('replicas'), rid)
    return nil
  end
  local exp = tonumber(v[6] or '0')
  if exp ~= 0 and exp < now then
    drop_replica(rid)
    return nil
  end
  local ak, axk = K('act:' .. rid), K('actx:' .. rid)
  local h = '(' .. string.format('%.17g', now - aw)
  local old = redis.call('ZRANGEBYSCORE', ak, '-inf', h)
  if #old > 0 then
    local sum = 0
    for _, m in ipairs(old) do
      sum = sum + tonumber(redis.call('HGET', axk, m) or '0')
      redis.call('HDEL', axk, m)
    end
    redis.call('ZREMRANGEBYSCORE', ak, '-inf', h)
    redis.call('HINCRBY', rk, 'actctx', 0 - sum)
  end
  redis.call('ZREMRANGEBYSCORE', K('plc:' .. rid), '-inf', '(' .. string.format('%.17g', now - rw))
  return {rid, v[1], v[2], v[3] or '0', v[4] or '', v[5] or '0', redis.call('HGET', rk, 'actctx') or '0',
          redis.call('ZCARD', ak), redis.call('ZCARD', K('plc:' .. rid)), inflight[rid] or 0, v[7] or '0'}
end

-- Per-replica in-flight summed over live gateways (but ``skip``, optional).
local function inflight_sums(alive, skip)
  local out = {}
  for g, _ in pairs(alive) do
    local flat = {}
    if g ~= skip then flat = redis.call('HGETALL', K('gw:' .. g .. ':if')) end
    for i = 1, #flat, 2 do
      local n = tonumber(flat[i + 1])
      if n > 0 then out[flat[i]] = (out[flat[i]] or 0) + n end
    end
  end
  return out
end
