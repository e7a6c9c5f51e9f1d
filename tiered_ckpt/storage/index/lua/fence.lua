-- Alone (no check.lua). KEYS: epoch. A new epoch above the current one and above the server's clock in
-- milliseconds, so that an epoch issued after the index lost its counter (restarted empty, restored from a
-- snapshot) is still above every earlier incarnation's: a zombie can never set its own back over a newer
-- writer's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = math.max(tonumber(redis.call('GET', KEYS[1]) or '0') + 1, now)
redis.call('SET', KEYS[1], string.format('%.0f', epoch))
return string.format('%.0f', epoch)
