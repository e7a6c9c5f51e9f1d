-- check.lua + this. KEYS: epoch, step hash, steps zset, list hash. ARGV: epoch, step
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return 1
