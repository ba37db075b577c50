-- sessions: one session (op 'one') or the sessions homed on a replica (op 'on', admin / drain view).
-- ARGV: base, op, now, session_ttl_s, sid-or-replica, limit[, skip gid ('one' only: left out of in-flight)]
local op, now, ttl, id, limit = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local alive = alive_gateways(redis_ms())
if op == 'one' then return session_row(id, now, ttl, alive, ARGV[7] or '') or {} end
local hk = K('home:' .. id)
local function check(sid)
  local row = session_row(sid, now, ttl, alive)
  if row and row[2] == id then return row end
  redis.call('ZREM', hk, sid)
  return nil
end
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', hk, '-inf', '(' .. string.format('%.17g', now - ttl))) do
  check(sid)
end
local out = {}
for _, sid in ipairs(redis.call('ZRANGE', hk, -limit, -1)) do
  local row = check(sid)
  if row then out[#out + 1] = row end
end
return out
