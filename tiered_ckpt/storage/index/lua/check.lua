-- The prelude of every write script but fence.lua: KEYS[1] is the job's fencing epoch, ARGV[1] the writer's.
-- A newer epoch than the writer's fences it. An older one (0: the key is gone) means the index lost it: a Redis
-- restarted empty, FLUSHDB, a restore from an older snapshot. The writer then sets it back to its own epoch and
-- goes on: only a real newer writer can fence it.
local current, mine = tonumber(redis.call('GET', KEYS[1]) or '0'), tonumber(ARGV[1])
if current > mine then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is stale (current ' .. current .. ')')
end
if current < mine then redis.call('SET', KEYS[1], ARGV[1]) end
