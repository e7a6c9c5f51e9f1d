-- check.lua + summary.lua + this. KEYS: epoch, step hash, list hash. ARGV: epoch, tier, step. Drops every record
-- of one tier (before its data is deleted).
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  local kind, rest = string.match(f, '^(%a+):(.*)$')
  if kind and kind ~= 'rank' and (rest == ARGV[2] or string.sub(rest, 1, #ARGV[2] + 1) == ARGV[2] .. ':') then
    redis.call('HDEL', KEYS[2], f)
  end
end
local s = summary(KEYS[3], ARGV[3], false)
if s then
  for _, part in ipairs({'t', 'k', 'f', 's'}) do if s[part] then s[part][ARGV[2]] = nil end end
  store(KEYS[3], ARGV[3], s)
end
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return 1
