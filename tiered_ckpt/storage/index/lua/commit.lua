-- check.lua + summary.lua + this. KEYS: epoch, step hash, list hash. ARGV: epoch, tier, session, rank, world,
-- step. This rank's bit in the tier's bitmap of this session; the marker that completes the set commits the
-- tier, atomically. A session whose commit of the tier was abandoned (abandon.lua) takes no marker: the reason
-- comes back instead of 0 or 1.
local tier, session, rank = ARGV[2], ARGV[3], tonumber(ARGV[4])
local abandoned = redis.call('HGET', KEYS[2], 'abandoned:' .. tier .. ':' .. session)
if abandoned then return abandoned end
local count_field, bits_field = 'count:' .. tier .. ':' .. session, 'done:' .. tier .. ':' .. session
local bits = redis.call('HGET', KEYS[2], bits_field) or ''
local at, mask = math.floor(rank / 8) + 1, 2 ^ (7 - rank % 8)
if #bits < at then bits = bits .. string.rep('\0', at - #bits) end
local byte = string.byte(bits, at)
local n
if math.floor(byte / mask) % 2 == 0 then
  redis.call('HSET', KEYS[2], bits_field, string.sub(bits, 1, at - 1) .. string.char(byte + mask) .. string.sub(bits, at + 1))
  n = redis.call('HINCRBY', KEYS[2], count_field, 1)
else
  n = tonumber(redis.call('HGET', KEYS[2], count_field))
end
local done = 0
if n >= tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[2], 'complete:' .. tier, '1')
  local s = summary(KEYS[3], ARGV[6], false)
  if s then s.k = s.k or {}; s.k[tier] = 1; store(KEYS[3], ARGV[6], s) end
  done = 1
end
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return done
