-- release: the request ended. Decrement this gateway's in-flight; learn tokens written, context size
-- and the residency mark. One round trip. Never drives a count below zero.
-- ARGV: base, gid, now, session_ttl_ms, replica, sid ('' = none), ok, has_prompt, prompt, cached, completion,
--       prompt_bytes, active_window_s, found ('1' / '0': the session's previous context was / was not
--       still cached where the request ran, '' = no evidence: ``router.store.base.residency_feedback``),
--       capacity (HBM + host of the replica as the gateway last saw it, 0 = unknown; learn_horizon),
--       samples (outputs per prompt, the request's n: the context grows by completion / samples),
--       ['F': fast path, return the session's row without this gateway's in-flight, else 1]
local gid, NOW = ARGV[2], ARGV[3]
local now, ttl_ms, rid, sid = tonumber(NOW), ARGV[4], ARGV[5], ARGV[6]
local ok, has_prompt = ARGV[7] == '1', ARGV[8] == '1'
local prompt, cached, comp = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local pbytes, window = tonumber(ARGV[12]), tonumber(ARGV[13])

local gk = K('gw:' .. gid .. ':if')
if redis.call('HINCRBY', gk, rid, -1) <= 0 then redis.call('HDEL', gk, rid) end
local live = rep_live(rid, now)
local found = ARGV[14]
if found ~= '' and live and sid ~= '' then
  -- rule 6 feedback, on the session's state before this request changes it (learn_horizon)
  local h0, m0 = unpack(redis.call('HMGET', K('s:' .. sid), 'home', 'mark'))
  local mark = tonumber(m0 or '0')
  if h0 == rid and mark > 0 then
    local since = tonumber(redis.call('HGET', K('r:' .. rid), 'tw') or '0') - mark
    local hz = tonumber(redis.call('HGET', K('r:' .. rid), 'hz') or '0')
    local ref = hz
    if ref == 0 then ref = tonumber(ARGV[15]) end
    if since > 0 and ((found == '0' and (hz == 0 or since < hz) and since >= PLAUSIBLE_EVICTION * ref)
        or (found == '1' and hz > 0 and since > hz)) then
      redis.call('HSET', K('r:' .. rid), 'hz', since)
    end
  end
end
local tw = 0
if live then
  if has_prompt then
    local new = prompt - cached
    if new < 0 then new = 0 end
    tw = redis.call('HINCRBY', K('r:' .. rid), 'tw', new + comp)
  else
    tw = tonumber(redis.call('HGET', K('r:' .. rid), 'tw') or '0')
  end
end
if sid == '' then return 1 end
local sk = K('s:' .. sid)
if redis.call('EXISTS', sk) == 0 then return 1 end
local f = 'f:' .. gid .. '|' .. rid
if redis.call('HINCRBY', sk, f, -1) <= 0 then redis.call('HDEL', sk, f) end
redis.call('HSET', sk, 'seen', NOW)
local home = redis.call('HGET', sk, 'home')
local ctx = tonumber(redis.call('HGET', sk, 'ctx') or '0')
if ok and has_prompt and home and rid == home then
  local c = prompt + math.floor(comp / tonumber(ARGV[16]))
  -- a smaller context (a sub-agent's, or the main chain after a compaction) replaces the session's
  -- only once its larger one has not been seen for a whole active window
  if c >= ctx or now - tonumber(redis.call('HGET', sk, 'ctxat') or '0') > window then
    ctx = c
    redis.call('HSET', sk, 'ctx', ctx, 'ctxat', NOW)
  end
  redis.call('HINCRBY', sk, 'turns', 1)
  if prompt > 0 and pbytes > 0 then redis.call('HSET', sk, 'bpt', pbytes / prompt) end
  if live then redis.call('HSET', sk, 'mark', tw) end
end
if home then
  index_home(home, NOW, sid, ttl_ms)
  if rep_live(home, now) then touch_active(home, sid, NOW, ctx) end
end
redis.call('PEXPIRE', sk, ttl_ms)
if ARGV[17] == 'F' then
  return session_row(sid, now, tonumber(ttl_ms) / 1000, alive_gateways(redis_ms()), gid) or 1
end
return 1
