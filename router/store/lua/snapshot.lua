-- snapshot: every replica (with in-flight summed over live gateways) plus one session. One round trip.
-- ARGV: base, now, active_window_s, ramp_window_s, session_ttl_s, sid ('' = none),
--       [skip gid: leave this gateway's in-flight out of every count (the fast path adds its own)],
--       [part, parts: rows only of the replicas at sorted positions i with (i - 1) % parts == part]
-- Returns {seq, {replica rows}, session row or {}, sessions_active, serving since ('' = not yet)};
-- with parts, also {every replica id, sorted} and {rid, in-flight, ...} of every replica (the fast
-- path's partial refresh: in-flight of all, the rest of a row once every `parts` reads)
local NOW = ARGV[2]
local now, aw, rw, ttl, sid = tonumber(NOW), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local skip = ARGV[7] or ''
local part, parts = tonumber(ARGV[8] or '0'), tonumber(ARGV[9] or '1')
local alive = alive_gateways(redis_ms())
local inflight = inflight_sums(alive, skip)
local ids = redis.call('SMEMBERS', K('replicas'))
table.sort(ids)
local reps, active = {}, 0
for i, rid in ipairs(ids) do
  if parts == 1 or (i - 1) % parts == part then
    local row = replica_row(rid, now, aw, rw, inflight)
    if row then
      reps[#reps + 1] = row
      active = active + row[8]
    end
  end
end
-- the home index keeps a member per session ever homed on a replica until something reads it (the
-- admin view, a drain): each call prunes one replica's (in turn, so a 1,000-replica fleet pays one
-- range query per snapshot, not 1,000), a few members whose session expired or moved
if #ids > 0 then
  local rid = ids[(math.floor(now * 10) % #ids) + 1]
  local hk = K('home:' .. rid)
  local old_home = '(' .. string.format('%.17g', now - ttl)
  for _, s in ipairs(redis.call('ZRANGEBYSCORE', hk, '-inf', old_home, 'LIMIT', 0, 32)) do
    if redis.call('HGET', K('s:' .. s), 'home') ~= rid then redis.call('ZREM', hk, s) end
  end
end
local sess = {}
if sid ~= '' then sess = session_row(sid, now, ttl, alive, skip) or {} end
local head = {redis.call('GET', K('seq')) or '0', reps, sess, active, redis.call('GET', K('t0')) or ''}
if parts == 1 then return head end
local flat = {}
for rid, n in pairs(inflight) do
  flat[#flat + 1] = rid
  flat[#flat + 1] = n
end
head[6], head[7] = ids, flat
return head
