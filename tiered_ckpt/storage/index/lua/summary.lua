-- The summary of a step in the job's `list` hash: read, changed, written back by the scripts that include
-- this file. Only begin() (a `created` field) starts one: a step an earlier release wrote keeps none and is
-- listed from its hash, never from a partial summary.
-- A summary is sealed: "TCS1", the SHA-1 of the msgpack body (40 hex digits), the body. One the scripts find
-- damaged is left as it is (never sealed again over a flipped byte); list() rebuilds that step from its hash.
local function summary(key, step, create)
  local raw = redis.call('HGET', key, step)
  if raw then
    if string.sub(raw, 1, 4) ~= 'TCS1' then return cmsgpack.unpack(raw) end
    local body = string.sub(raw, 45)
    if redis.sha1hex(body) ~= string.sub(raw, 5, 44) then return nil end
    return cmsgpack.unpack(body)
  end
  if create then return {} end
  return nil
end
local function store(key, step, s)
  local body = cmsgpack.pack(s)
  redis.call('HSET', key, step, 'TCS1' .. redis.sha1hex(body) .. body)
end
