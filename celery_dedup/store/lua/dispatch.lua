-- dispatch: push the parked messages of debounced runs that are due.
--
-- KEYS[1]  due_key: P:due (ZSET member -> due time, ms)
-- ARGV[1]  prefix: key prefix
-- ARGV[2]  limit: at most this many runs pushed per call
-- ARGV[3]  history_len: history length
--
-- A run is due when its burst has been quiet for the window, or max wait after
-- its first call (gate.lua keeps the score). Its parked message is LPUSHed
-- onto the queue recorded beside it and the record moves from `pending` to
-- `queued`, in one step: a run is pushed once, whichever worker calls this.
-- Entries whose record is gone or no longer pending are dropped.
--
-- Returns {runs pushed, ms until the next run is due (-1: none is parked)}.

local due_key = KEYS[1]
local now = now_ms()

local pushed = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', due_key, '-inf', now, 'LIMIT', 0, limit)) do
  redis.call('ZREM', due_key, member)
  local record = KEY.record(prefix, member)
  local r = redis.call('HMGET', record, 'state', 'message', 'queue', 'task_id', 'debounced')
  if r[1] == 'pending' and r[2] and r[3] then
    redis.call('LPUSH', r[3], r[2])
    redis.call('HDEL', record, 'message')
    redis.call('HSET', record, 'pushed_at', now)
    local calls = tonumber(r[5] or 0) + 1
    transition(prefix, record, member, 'queued', now, calls .. (calls == 1 and ' call' or ' calls'),
      history_len)
    pushed = pushed + 1
  end
end

local next_due = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
if #next_due == 0 then
  return {pushed, -1}
end
return {pushed, math.max(tonumber(next_due[2]) - now, 0)}
