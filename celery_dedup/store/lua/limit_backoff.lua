-- limit_backoff: a running body backs off (an HTTP 429 with Retry-After, say): its group
-- key is paused for `after` ms and the run goes back to the head of the key's waiting
-- line, to be the first of the key to start once the pause ends (limit_acquire.lua
-- refuses every start of a paused key, and gives free places to the line in order).
-- Every key is one group's, or its shard's (one hash tag on a Redis Cluster).
--
-- KEYS[1]  conf: the group's run-time values in this shard (HASH, no TTL; see
--          limit_acquire.lua): "k:<key>:paused_until" (ms, server clock; -1: until resumed)
-- KEYS[2]  waiting: ZSET run id -> first arrival (ms), the group key's line in arrival order
-- KEYS[3]  deadlines: ZSET run id -> when it must be back (ms) to keep its place
-- ARGV[1]  key: the group key, as the conf fields name it
-- ARGV[2]  run: the run id (its place in line)
-- ARGV[3]  after: how long the key pauses, ms (from now, on the server clock)
-- ARGV[4]  lease: how late the run may come back and keep its place, ms (its lock TTL)
--
-- The pause only ever grows: it ends at the later of its current end and now + after,
-- and a pause until resumed (-1) stays one.
--
-- Returns paused_until: when the key's pause ends (ms, server clock; -1: until resumed).

local conf, waiting, deadlines = KEYS[1], KEYS[2], KEYS[3]
-- The line outlives its last use by this much (as limit_acquire.lua's keys do).
local KEEP = 60000

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local field = 'k:' .. key .. ':paused_until'
local current = tonumber(redis.call('HGET', conf, field) or 0)
local paused_until = -1
if current ~= -1 then
  paused_until = math.max(current, now + after)
  redis.call('HSET', conf, field, paused_until)
end

-- First in line: before the run at the head (a run at the head already keeps its place).
local head = redis.call('ZRANGE', waiting, 0, 0, 'WITHSCORES')
local arrived = now
if #head > 0 and head[1] ~= run then
  arrived = math.min(now, tonumber(head[2]) - 1)
elseif #head > 0 then
  arrived = tonumber(head[2])
end
redis.call('ZADD', waiting, arrived, run)
redis.call('ZADD', deadlines, now + after + lease, run)
for _, line in ipairs({waiting, deadlines}) do
  if redis.call('PTTL', line) < after + lease + KEEP then
    redis.call('PEXPIRE', line, after + lease + KEEP)
  end
end
return paused_until
