-- The prelude of fence.lua for a `role = "writer"` engine. KEYS: epoch, writer lease (a hash: token, holder,
-- renewals; with a TTL its holder renews). ARGV: this writer's token, its holder record, the TTL in ms. Held
-- by another token: refused, with {holder, renewals, PTTL} (the caller waits for a dead holder's lease to
-- expire, and gives up when the renewals move). Else the lease is this writer's, and fence.lua starts the new
-- incarnation in the same atomic step.
local held = redis.call('HMGET', KEYS[2], 'token', 'holder', 'renewals')
if held[1] and held[1] ~= ARGV[1] then
  return {held[2] or 'unknown', held[3] or '0', redis.call('PTTL', KEYS[2])}
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'token', ARGV[1], 'holder', ARGV[2], 'renewals', '0')
redis.call('PEXPIRE', KEYS[2], ARGV[3])
