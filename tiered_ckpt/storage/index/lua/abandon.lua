-- check.lua + summary.lua + this. KEYS: epoch, step hash, list hash. ARGV: epoch, tier, session, rank, step,
-- reason. Ends one session's commit of a tier as failed unless the tier is complete already (returns 0 then):
-- from here on commit.lua refuses that session's markers on the tier, so no marker landing late completes it.
-- The node agent runs it before it gives up a save whose memory-tier commit it waited for.
local tier, session, rank, reason = ARGV[2], ARGV[3], ARGV[4], ARGV[6]
if redis.call('HEXISTS', KEYS[2], 'complete:' .. tier) == 1 then
  redis.call('INCRBY', KEYS[1], 0)
  return 0
end
redis.call('HSET', KEYS[2], 'abandoned:' .. tier .. ':' .. session, reason)
redis.call('HSET', KEYS[2], 'failed:' .. tier .. ':' .. rank .. ':' .. session, reason)
redis.call('HSETNX', KEYS[2], 'fail:' .. tier .. ':' .. session, 'rank ' .. rank .. ': ' .. reason)
local s = summary(KEYS[3], ARGV[5], false)
if s then
  s.f = s.f or {}
  if not s.f[tier] then s.f[tier] = 'rank ' .. rank .. ': ' .. reason end
  store(KEYS[3], ARGV[5], s)
end
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return 1
