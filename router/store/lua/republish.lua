-- republish: after an outage, bind sessions this gateway placed while Redis was away, each with
-- compare-and-set (only if the home in Redis is still what the gateway believed before).
-- ARGV: base, now, session_ttl_s, session_ttl_ms, n, (sid, replica, only_if, context_tokens) * n
-- Returns the list of winning homes, one per session, in order.
local NOW = ARGV[2]
local now, ttl, ttl_ms, n = tonumber(NOW), tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local alive = alive_gateways(redis_ms())
local out = {}
local i = 6
for _ = 1, n do
  local sid, rid, only_if, ctx = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  i = i + 4
  local sk = K('s:' .. sid)
  if not session_row(sid, now, ttl, alive) then
    redis.call('DEL', sk)
    redis.call('HSET', sk, 'seen', NOW, 'ctx', ctx, 'mark', 0, 'turns', 0)
  end
  local home = redis.call('HGET', sk, 'home') or ''
  if home == only_if then
    if home ~= '' then
      forget_active(home, sid)
      redis.call('ZREM', K('home:' .. home), sid)
    end
    redis.call('HSET', sk, 'home', rid, 'mark', 0)
    index_home(rid, NOW, sid, ttl_ms)
    if rep_live(rid, now) then touch_active(rid, sid, NOW, tonumber(redis.call('HGET', sk, 'ctx'))) end
    home = rid
  end
  redis.call('PEXPIRE', sk, ttl_ms)
  out[#out + 1] = home
end
return out
