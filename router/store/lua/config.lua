-- config: the policy configuration every gateway of the fleet routes with (PATCH /admin/config).
-- set: ARGV base, 'set', doc     -> the new generation (counter and document change together)
-- get: ARGV base, 'get', known   -> {generation} when it is `known`, else {generation, doc}
--                                   (generation 0, no doc: nobody has shared one)
local op, key = ARGV[2], K('config')
if op == 'set' then
  local g = redis.call('HINCRBY', key, 'gen', 1)
  redis.call('HSET', key, 'doc', ARGV[3])
  return g
end
local g = tonumber(redis.call('HGET', key, 'gen') or '0')
if g == tonumber(ARGV[3]) then
  return {g}
end
return {g, redis.call('HGET', key, 'doc') or ''}
