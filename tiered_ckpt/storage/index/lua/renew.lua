-- Alone. KEYS: epoch, writer lease. ARGV: this writer's token, the TTL in ms, its epoch, its holder record.
-- {'fenced'} (a newer incarnation exists: the lease is released, if still this writer's), {'ok'} (renewed),
-- {'retaken'} (it had expired, or the index lost it: this writer holds it again) or {'lost', holder}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local token = redis.call('HGET', KEYS[2], 'token')
if current > tonumber(ARGV[3]) then
  if token == ARGV[1] then redis.call('DEL', KEYS[2]) end
  return {'fenced'}
end
if token and token ~= ARGV[1] then
  return {'lost', redis.call('HGET', KEYS[2], 'holder') or 'unknown'}
end
if not token then
  redis.call('HSET', KEYS[2], 'token', ARGV[1], 'holder', ARGV[4], 'renewals', '0')
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return {'retaken'}
end
redis.call('HINCRBY', KEYS[2], 'renewals', 1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {'ok'}
