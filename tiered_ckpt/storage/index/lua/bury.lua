-- check.lua + this. KEYS: epoch, tombstones set. ARGV: epoch, step, 1 to add or 0 to remove
if ARGV[3] == '1' then redis.call('SADD', KEYS[2], ARGV[2]) else redis.call('SREM', KEYS[2], ARGV[2]) end
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return 1
