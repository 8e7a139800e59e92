-- finish: record a run's ending and drop its key, only if this run owns it.
--
-- KEYS[1]  held set
-- KEYS[2]  the member's status record (HASH)
-- ARGV[1]  member
-- ARGV[2]  task id that claims ownership (compare-and-delete: no other run's key
--          is ever dropped)
-- ARGV[3]  state to record (succeeded, failed, revoked, started, ...)
-- ARGV[4]  "1" to drop the key now, "0" to keep it held until its deadline
--          (an idempotency window)
-- ARGV[5]  record TTL after release, ms; "0" deletes the record outright (its
--          message was never enqueued)
--
-- Returns 1 if this run owned the key, 0 if another run (or none) does; nothing
-- is changed then.

local held, record = KEYS[1], KEYS[2]
local member, task_id, state = ARGV[1], ARGV[2], ARGV[3]
local drop, record_ms = ARGV[4] == '1', tonumber(ARGV[5])

if redis.call('HGET', record, 'task_id') ~= task_id then
  return 0
end
if drop and record_ms == 0 then
  redis.call('SREM', held, member)
  redis.call('DEL', record)
  return 1
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', record, 'state', state, 'updated_at', now)
if drop then
  redis.call('SREM', held, member)
  redis.call('HSET', record, 'held_until', 0)
  redis.call('PEXPIRE', record, record_ms)
else
  local until_ms = tonumber(redis.call('HGET', record, 'held_until') or 0)
  redis.call('PEXPIRE', record, math.max(until_ms - now, 0) + record_ms)
end
return 1
