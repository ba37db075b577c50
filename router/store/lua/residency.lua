-- residency: exact residency shared through Redis (router/store/residency.py, keys.py).
-- write: ARGV base, 'write', rid, source, ttl_ms, reset (0/1), maxlen, writer, pairs JSON
--        [[session, tokens or null], ...] -> the entry counter n
--        (reset: forget everything known for rid first; null tokens: the session is unknown there)
-- read:  ARGV base, 'read' -> {last stream id, n, redis ms, {rid, "source|expiry|writer", flat hash}...}
-- drop:  ARGV base, 'drop', rid -> 1 (the writer stops: rid reads 'off')
local op = ARGV[2]
if op == 'write' then
  local rid, src, ttl, reset, maxlen, writer = ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
  local rk = K('res:' .. rid)
  if reset == '1' then redis.call('DEL', rk) end
  local pairs_ = cjson.decode(ARGV[9])
  for _, p in ipairs(pairs_) do
    if p[2] == cjson.null then
      redis.call('HDEL', rk, p[1])
    else
      redis.call('HSET', rk, p[1], p[2])
    end
  end
  local exp = redis_ms() + ttl
  redis.call('HSET', K('ress'), rid, src .. '|' .. exp .. '|' .. writer)
  local n = redis.call('INCR', K('resn'))
  local kind = 'd'
  if reset == '1' then kind = 'r' end
  redis.call('XADD', K('resx'), 'MAXLEN', '~', maxlen, '*', 'n', n, 'r', rid, 'k', kind, 's', src, 't', ttl,
             'd', ARGV[9])
  return n
elseif op == 'read' then
  local last = redis.call('XREVRANGE', K('resx'), '+', '-', 'COUNT', 1)
  local id = '0-0'
  if #last > 0 then id = last[1][1] end
  local out = {id, redis.call('GET', K('resn')) or '0', redis_ms()}
  local src = redis.call('HGETALL', K('ress'))
  for i = 1, #src, 2 do
    out[#out + 1] = {src[i], src[i + 1], redis.call('HGETALL', K('res:' .. src[i]))}
  end
  return out
elseif op == 'drop' then
  redis.call('DEL', K('res:' .. ARGV[3]))
  redis.call('HDEL', K('ress'), ARGV[3])
  local n = redis.call('INCR', K('resn'))
  redis.call('XADD', K('resx'), 'MAXLEN', '~', 100000, '*', 'n', n, 'r', ARGV[3], 'k', 'x', 's', 'off', 't', 0,
             'd', '[]')
  return n
end
return redis.error_reply('kvroute: unknown residency op ' .. tostring(op))
