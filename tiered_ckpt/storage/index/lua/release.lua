-- Alone. KEYS: writer lease. ARGV: this writer's token. The lease goes only if it is still this writer's.
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
