-- check.lua + summary.lua + this. KEYS: epoch, step hash, steps zset, list hash. ARGV: epoch, step, field,
-- value [, field, value ...]
local s = nil
for i = 3, #ARGV, 2 do
  local f, v = ARGV[i], ARGV[i + 1]
  if f == 'created' and v == '' then  -- the server's clock, not the writer's (gc compares with it)
    local t = redis.call('TIME')
    v = t[1] .. '.' .. string.format('%06d', t[2])
  end
  redis.call('HSET', KEYS[2], f, v)
  local kind = string.match(f, '^(%a+)')
  if kind == 'created' or kind == 'target' or kind == 'info' or kind == 'failed' or kind == 'skipped' then
    s = s or summary(KEYS[4], ARGV[2], kind == 'created')
    local tier, rank, session = string.match(f, '^failed:([^:]*):(%d+):(.*)$')
    local skipped, _, skip_session = string.match(f, '^skipped:([^:]*):(%d+):(.*)$')
    if tier then
      redis.call('HSETNX', KEYS[2], 'fail:' .. tier .. ':' .. session, 'rank ' .. rank .. ': ' .. v)
    elseif skipped then
      redis.call('HSETNX', KEYS[2], 'skip:' .. skipped .. ':' .. skip_session, v)
    end
    if s then
      if kind == 'created' then s.c = v
      elseif kind == 'info' then s.i = v
      elseif kind == 'target' then s.t = s.t or {}; s.t[string.sub(f, 8)] = tonumber(v)
      elseif tier then s.f = s.f or {}; if not s.f[tier] then s.f[tier] = 'rank ' .. rank .. ': ' .. v end
      elseif skipped then s.s = s.s or {}; if not s.s[skipped] then s.s[skipped] = tonumber(v) end
      end
    end
  end
end
if s then store(KEYS[4], ARGV[2], s) end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[2])
-- The last write of every script: it always reaches the replicas (a no-op write would not), so the WAIT after
-- a repeated attempt (a retry through a failover) also covers whatever an earlier attempt wrote on this master.
redis.call('INCRBY', KEYS[1], 0)
return 1
