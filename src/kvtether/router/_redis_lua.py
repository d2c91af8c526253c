"""The Lua scripts of the Redis conversation store (:mod:`kvtether.router.store_redis`):
each is one atomic round trip. Key layout: that module's docstring."""

from __future__ import annotations

__all__ = ["EXTEND", "LOCK", "SAVE"]

LOCK = """
-- A turn loads the whole conversation; a heartbeat, release or reap what leases need.
local function load()
  if ARGV[2] == 'turn' then return redis.call('HGETALL', KEYS[2]) end
  local out, names = {}, {'meta', 'ret', 'rtok'}
  local values = redis.call('HMGET', KEYS[2], unpack(names))
  for i, name in ipairs(names) do
    if values[i] then out[#out + 1] = name; out[#out + 1] = values[i] end
  end
  return out
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[2] == 'mark' then redis.call('SET', KEYS[4], '1', 'PX', ARGV[3]) end
  local data = {}
  if ARGV[2] ~= 'turn' then data = load() end
  return {0, redis.call('PTTL', KEYS[1]), data}
end
if ARGV[2] ~= 'turn' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('ZREM', KEYS[5], ARGV[4])  -- expired while it held KV: the reaper lets go
  return {-1, 0, {}}
end
local token = redis.call('INCR', KEYS[3])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
return {token, 0, load()}
"""

# ARGV[9]: '0' save only, '1' save and unlock, '2' save and unlock even if a release is pending
# (it stays pending for the next holder). -1: fenced out; 1: saved (and unlocked if asked);
# 2: saved, a release was asked for while the conversation retains KV: still locked.
SAVE = """
local cur = redis.call('GET', KEYS[1])
local token = ARGV[1]
if cur and cur ~= token then return -1 end
local written = tonumber(redis.call('HGET', KEYS[2], 'fence') or '0')
if written > tonumber(token) then return -1 end
local member, tenant, holding = ARGV[3], ARGV[4], ARGV[5]
local ord = redis.call('HGET', KEYS[2], 'rd') or ''
local ort = tonumber(redis.call('HGET', KEYS[2], 'rt') or '0')
if ord ~= '' then
  redis.call('HINCRBY', KEYS[4], ord, -ort)
  redis.call('HINCRBY', KEYS[5], tenant, -ort)
  redis.call('ZREM', holding .. ord, member)
end
local rd, rt = ARGV[6], tonumber(ARGV[7])
if rd ~= '' then
  redis.call('HINCRBY', KEYS[4], rd, rt)
  redis.call('HINCRBY', KEYS[5], tenant, rt)
  redis.call('ZADD', holding .. rd, rt, member)
  redis.call('ZADD', KEYS[6], ARGV[8], member)
else
  redis.call('ZREM', KEYS[6], member)
end
local fields = {'fence', token, 'rd', rd, 'rt', ARGV[7]}
for i = 11, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if ARGV[9] == '0' then return 1 end
if redis.call('EXISTS', KEYS[3]) == 1 then
  if rd == '' then
    redis.call('DEL', KEYS[3])
  elseif ARGV[9] == '1' then
    redis.call('SET', KEYS[1], token, 'PX', ARGV[10])
    return 2
  end
end
if cur then redis.call('DEL', KEYS[1]) end
return 1
"""

EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
