-- acquire: apply a decision's effects (compare-and-set binds, overflow) and count the request in
-- flight under this gateway's lease, atomically. One round trip.
-- ARGV: base, gid, now (fleet s), session_ttl_s, session_ttl_ms, lease_ms, target, sid ('' = none),
--       n_effects, then per effect: 'B', sid, replica, only_if ('' = unbound), placed ('1'/'0')
--                                or 'O', sid, n, replica * n
--       then, on the fast path only: 'F', check ('1' = the decision does not bind sid itself),
--       assumed home ('' = none): the home the decision was computed against (from a cached view)
--       then, when the request names its conversation: 'C', chain key, max chains kept: the
--       session's field 'ch' ("key=replica,..." oldest first) records where it ran (model.remember_chain)
-- Returns {1, target, disagreement, prev_context, seq, lease_lost[, session row or {}]} or {0, target}
-- (unknown target) or, on the fast path, {2, fresh session row or {}}: the session's real home
-- differs from the assumed one and is not usable, so nothing was applied (the caller re-routes).
-- Session rows on the fast path leave this gateway's own in-flight out (it knows them exactly).
local gid, NOW = ARGV[2], ARGV[3]
local now, ttl, ttl_ms, lease_ms = tonumber(NOW), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local target, sid, neff = ARGV[7], ARGV[8], tonumber(ARGV[9])

local e = 10
for _ = 1, neff do
  if ARGV[e] == 'B' then e = e + 5 else e = e + 3 + tonumber(ARGV[e + 2]) end
end
local fast = ARGV[e] == 'F'
local ce = fast and e + 3 or e
local chain, max_chains = '', 0
if ARGV[ce] == 'C' then chain, max_chains = ARGV[ce + 1], tonumber(ARGV[ce + 2]) end

local tms = redis_ms()
local lost = 0
local sc = redis.call('ZSCORE', K('gw'), gid)
if (not sc) or tonumber(sc) < tms then
  lost = 1
  redis.call('ZADD', K('gw'), tms + lease_ms, gid)
end
local alive = nil
local seq = redis.call('INCR', K('seq'))
redis.call('SET', K('t0'), NOW, 'NX')  -- serving since: replicas ACTIVE later joined by scale-up

local ready = {}
local function ensure_session(s)
  local sk = K('s:' .. s)
  if ready[s] then return sk end
  if redis.call('EXISTS', sk) == 1 then
    local seen = tonumber(redis.call('HGET', sk, 'seen') or '0')
    if seen < now - ttl then
      alive = alive or alive_gateways(tms)
      local fields, _, total = session_fields(sk, alive)
      if total == 0 then  -- idle past its TTL: forgotten, starts afresh
        local home = fields['home']
        if home then
          forget_active(home, s)
          redis.call('ZREM', K('home:' .. home), s)
        end
        redis.call('DEL', sk)
      end
    end
  end
  if redis.call('EXISTS', sk) == 0 then
    redis.call('HSET', sk, 'seen', NOW, 'ctx', 0, 'mark', 0, 'turns', 0)
  end
  redis.call('PEXPIRE', sk, ttl_ms)
  ready[s] = true
  return sk
end

local disagreement = 0
if fast and ARGV[e + 1] == '1' and sid ~= '' then
  -- optimistic check: was the decision computed against the session's real home?
  local sk = K('s:' .. sid)
  local home = ''
  if redis.call('EXISTS', sk) == 1 and tonumber(redis.call('HGET', sk, 'seen') or '0') >= now - ttl then
    home = redis.call('HGET', sk, 'home') or ''
  end
  if home ~= '' and home ~= ARGV[e + 2] then
    if rep_live(home, now) and redis.call('HGET', K('r:' .. home), 'status') == 'active' then
      target = home  -- another gateway moved or bound it: follow, like a lost compare-and-set
      disagreement = 1
      neff = 0  -- the effects were computed against a stale view
    else
      alive = alive_gateways(tms)
      return {2, session_row(sid, now, ttl, alive, gid) or {}}
    end
  end
end

if sid ~= '' then ensure_session(sid) end

local i = 10
for _ = 1, neff do
  local kind = ARGV[i]
  if kind == 'B' then
    local s, rid, only_if, placed = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
    i = i + 5
    local sk = ensure_session(s)
    local home = redis.call('HGET', sk, 'home') or ''
    if home ~= only_if then
      -- compare-and-set lost: keep the existing home; route there if it is usable
      if rid == target and home ~= '' and rep_live(home, now) then
        target = home
        disagreement = 1
      end
    else
      if home ~= '' then
        forget_active(home, s)
        redis.call('ZREM', K('home:' .. home), s)
      end
      local keep = {}
      for r in string.gmatch(redis.call('HGET', sk, 'ovf') or '', '[^,]+') do
        if r ~= rid then keep[#keep + 1] = r end
      end
      redis.call('HSET', sk, 'home', rid, 'mark', 0, 'ovf', table.concat(keep, ','))
      index_home(rid, redis.call('HGET', sk, 'seen'), s, ttl_ms)
      if rep_live(rid, now) then
        if placed == '1' then redis.call('ZADD', K('plc:' .. rid), NOW, seq .. ':' .. i) end
        touch_active(rid, s, NOW, tonumber(redis.call('HGET', sk, 'ctx') or '0'))
      end
    end
  elseif kind == 'O' then
    local s, n = ARGV[i + 1], tonumber(ARGV[i + 2])
    i = i + 3
    local sk = ensure_session(s)
    local home = redis.call('HGET', sk, 'home') or ''
    local keep = {}
    for j = 0, n - 1 do
      if ARGV[i + j] ~= home then keep[#keep + 1] = ARGV[i + j] end
    end
    i = i + n
    redis.call('HSET', sk, 'ovf', table.concat(keep, ','))
  else
    return redis.error_reply('kvroute: unknown effect ' .. tostring(kind))
  end
end

if not rep_live(target, now) then return {0, target} end
redis.call('HINCRBY', K('gw:' .. gid .. ':if'), target, 1)
local prev = 0
if sid ~= '' then
  local sk = K('s:' .. sid)
  redis.call('HINCRBY', sk, 'f:' .. gid .. '|' .. target, 1)
  redis.call('HSET', sk, 'seen', NOW)
  prev = tonumber(redis.call('HGET', sk, 'ctx') or '0')
  if chain ~= '' then
    local kept = {}
    for k, r in string.gmatch(redis.call('HGET', sk, 'ch') or '', '([^=,]+)=([^,]+)') do
      if k ~= chain then kept[#kept + 1] = k .. '=' .. r end
    end
    kept[#kept + 1] = chain .. '=' .. target
    while #kept > max_chains do table.remove(kept, 1) end
    redis.call('HSET', sk, 'ch', table.concat(kept, ','))
  end
  local home = redis.call('HGET', sk, 'home')
  if home then
    index_home(home, NOW, sid, ttl_ms)
    if rep_live(home, now) then touch_active(home, sid, NOW, prev) end
  end
end
if fast then
  local row = {}
  if sid ~= '' then
    alive = alive or alive_gateways(tms)
    row = session_row(sid, now, ttl, alive, gid) or {}
  end
  return {1, target, disagreement, prev, seq, lost, row}
end
return {1, target, disagreement, prev, seq, lost}
