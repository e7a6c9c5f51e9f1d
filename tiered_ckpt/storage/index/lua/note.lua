-- check.lua + this. KEYS: epoch, notes hash. ARGV: epoch, name, data
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return 1
